"""vkdsl.trace: compile once, replay with new inputs; buffer reuse; assigns; no per-dispatch work."""
import numpy as np
import pytest

import vkdsl
from vkdsl.runtime.commands import Recording

from conftest import nmse


def test_replay_with_new_inputs_matches_numpy(rng):
    w = rng.standard_normal((16, 8)).astype(np.float32)
    W = vkdsl.tensor(w)

    @vkdsl.trace
    def f(x, y):
        h = (x @ W).tanh()
        return (h * y).sum(axis=-1), h.max(axis=0)
    for _ in range(3):
        x, y = rng.standard_normal((5, 16)).astype(np.float32), rng.standard_normal((5, 8)).astype(np.float32)
        s, m = f(x, y)
        h = np.tanh(x.astype(np.float64) @ w)
        assert nmse(s, (h * y).sum(-1)) < 1e-10 and nmse(m, h.max(0)) < 1e-10
    assert len(f.programs) == 1                  # same shapes -> same recorded program


def test_replay_does_no_per_dispatch_python_work(rng, monkeypatch):
    @vkdsl.trace
    def chain(x):
        for _ in range(50):
            x = (x * 0.5 + 1.0).contiguous()
        return x
    x = np.ones(64, np.float32)
    chain(x)
    calls = []
    monkeypatch.setattr(Recording, "dispatch", lambda *a, **k: calls.append(a))
    out = chain(x)
    assert calls == []                           # replay never records again
    ref = np.ones(64)
    for _ in range(50):
        ref = ref * 0.5 + 1.0
    np.testing.assert_allclose(out, ref, rtol=1e-6)


def test_intermediate_buffers_are_reused(rng):
    @vkdsl.trace
    def chain(x):
        for _ in range(20):
            x = (x + 1.0).contiguous()
        return x
    prog = chain.program(np.zeros(1024, np.float32))
    temps = {id(b) for b in prog.bufs.values() if b.label == "temp"}
    assert len(prog.steps) == 20 and len(temps) <= 2


def test_traced_assign_applies_each_replay(rng):
    w = vkdsl.tensor(np.zeros(4, np.float32))
    m = vkdsl.tensor(np.zeros(4, np.float32))

    @vkdsl.trace
    def step(g):
        m_new = m * 0.5 + g               # reads see the values from before this call
        m.assign(m_new)
        w.assign(w - m_new)               # uses the new m through the expression, not the buffer
        return m_new
    g = np.ones(4, np.float32)
    mr, wr = np.zeros(4), np.zeros(4)
    for _ in range(4):
        step(g)
        mr = mr * 0.5 + 1
        wr = wr - mr
    np.testing.assert_allclose(m.numpy(), mr, rtol=1e-6)
    np.testing.assert_allclose(w.numpy(), wr, rtol=1e-6)


def test_new_shapes_make_a_new_program(rng):
    f = vkdsl.trace(lambda x: x.sum(axis=-1))
    np.testing.assert_allclose(f(np.ones((2, 3), np.float32)), [3, 3])
    np.testing.assert_allclose(f(np.ones((4, 5), np.float32)), [5] * 4)
    assert len(f.programs) == 2


def test_zero_dim_inputs_keep_their_shape():
    # a 0-d input (a scalar upstream gradient, a learning rate) stays 0-d inside the trace
    f = vkdsl.trace(lambda s, x: x * s)
    out = f(np.float32(2.5), np.arange(3, dtype=np.float32))
    assert f.program(np.float32(2.5), np.arange(3, dtype=np.float32)).inputs[0].shape == ()
    assert np.array_equal(out, np.arange(3, dtype=np.float32) * np.float32(2.5))


def test_keep_holds_at_most_that_many_programs_and_frees_the_others():
    import vkdsl
    from vkdsl.runtime import default_device
    f = vkdsl.trace(lambda x: (x * 2.0 + 1.0).sum(), keep=1)
    dev = default_device()
    before = dev.allocated_bytes
    for n, want in ((1 << 18, 2.0 * (1 << 18) * 2 + 1), (1 << 19, None), (1 << 18, None)):
        out = f(np.full(n, 0.5, np.float32))
        assert float(np.asarray(out)) == pytest.approx(2.0 * n)          # 0.5 * 2 + 1 per element
        assert len(f.programs) == 1
        assert dev.allocated_bytes - before < 4 * n + 4096                # the other shape's buffers are gone
