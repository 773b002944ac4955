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
    temps = {id(b) for b in prog.buffers() if b.label == "temp"}
    assert len(prog.steps) == 20 and len(temps) <= 2


def _random_ops(rng, n=48):
    """A program of n values of mixed sizes, each made from one or two earlier ones; some read
    much later (long lives), most soon after (short ones)."""
    ops = []
    for i in range(n):
        a = int(rng.integers(max(0, i - 4), i + 1)) if rng.random() < 0.8 else int(rng.integers(0, i + 1))
        b = int(rng.integers(0, i + 1))
        ops.append((int(rng.integers(3)), a, b, int(rng.choice([64, 256, 1024, 4096]))))
    return ops


def _run_ops(ops, x, T):
    """The ops on x with T = vkdsl (each value materialized) or numpy float64."""
    vals = [x]
    for kind, a, b, n in ops:
        u, v = vals[a][:n], vals[b][:n]
        m = min(u.shape[0], v.shape[0])
        y = u * 0.5 + 0.25 if kind == 0 else (u[:m] + v[:m] if kind == 1 else (u * 0.1).tanh() if T else
                                               np.tanh(u * 0.1))
        vals.append(y.contiguous() if T else y)
    return [vals[-1], sum(v.sum() for v in vals[1::5])]


def test_values_share_a_slot_only_when_their_lives_do_not_overlap(rng):
    """slots.buffer_slots on random programs: two values alive at the same time never share a
    slot, every slot holds its values, and the results equal numpy's (a clobbered value would not);
    the slots' total stays near the peak of bytes alive at once."""
    from vkdsl.slots import buffer_slots, value_bytes
    for trial in range(4):
        ops = _random_ops(rng)
        x = rng.standard_normal(4096).astype(np.float32)
        fn = vkdsl.trace(lambda x: _run_ops(ops, x, True))
        got = fn(x)
        want = _run_ops(ops, x.astype(np.float64), False)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
        prog = fn.program(x)
        slot_of, slots = buffer_slots(prog.steps, prog.outputs)
        made = {id(s.node): i for i, s in enumerate(prog.steps)}
        last = dict(made)
        for i, s in enumerate(prog.steps):
            for t in s.inputs:
                while t.op == "reshape" and id(t) not in made:
                    t = t.src[0]
                last[id(t)] = max(last.get(id(t), i), i)
        by_slot = {}
        for key, k in slot_of.items():
            by_slot.setdefault(k, []).append((made[key], last[key]))
            node = prog.steps[made[key]].node
            assert slots[k][0] >= value_bytes(node)
        for lives in by_slot.values():
            lives.sort()
            assert all(b[0] > a[1] for a, b in zip(lives, lives[1:])), lives
        alive = [sum(value_bytes(prog.steps[made[k]].node) for k in slot_of if made[k] <= i <= last[k])
                 for i in range(len(prog.steps))]
        assert sum(n for n, _ in slots) <= 1.3 * max(alive), (sum(n for n, _ in slots), max(alive))


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


def test_a_concatenation_of_many_chunks_binds_few_buffers_per_kernel():
    """60 chunks joined by pads and adds (as the chunked LM head's gradient rows are): fused whole,
    one kernel would bind 61 buffers, past llvmpipe's 32 per shader (a crash, not an error); the
    schedule gives partial sums buffers instead. The result is the numpy concatenation."""
    from vkdsl.schedule import plan
    xs = [np.full((4, 8), i, np.float32) for i in range(60)]

    def join(*parts):
        out = parts[0].pad(((0, 236), (0, 0)))
        for i, x in enumerate(parts[1:], 1):
            out = out + x.pad(((4 * i, 236 - 4 * i), (0, 0)))
        return out
    steps, _ = plan([join(*[vkdsl.tensor(x) for x in xs])], [])     # checked before anything runs
    assert max(len(s.inputs) for s in steps) + 1 <= 32           # llvmpipe: 32 buffers per shader, output included
    np.testing.assert_array_equal(np.asarray(vkdsl.trace(join)(*xs)), np.concatenate(xs))


def test_programs_of_other_shapes_give_way_when_the_device_is_full(monkeypatch):
    """Programs stay, one per shape, while memory allows; one that would pass the budget first
    releases the least recently used programs (of any traced function: runtime.context.RECLAIM),
    and every result is right. With nothing to reclaim the same calls run out of memory."""
    import gc
    from vkdsl.runtime import DeviceMemoryError, context, default_device
    dev = default_device()
    gc.collect()
    n = 1 << 18                                  # a program: its 1 MiB input, a few small buffers
    fs = [vkdsl.trace(lambda x, k=k: (x * float(k) + 1.0).sum()) for k in (2, 3)]
    limit = dev.allocated_bytes + int(2.5 * 4 * n)
    monkeypatch.setenv("VKDSL_DEVICE_MEMORY_LIMIT", str(limit))

    def calls():
        for i in range(6):                       # six shapes, two functions: three fit at most
            k = 2 + i % 2
            x = np.full(n + 64 * i, 0.5, np.float32)
            assert float(np.asarray(fs[i % 2](x))) == pytest.approx((0.5 * k + 1.0) * x.size)
            assert dev.allocated_bytes <= limit
    calls()
    assert 1 <= sum(len(f.programs) for f in fs) < 6
    for f in fs:
        f.programs.clear()
    gc.collect()
    monkeypatch.setattr(context, "RECLAIM", [])
    with pytest.raises(DeviceMemoryError):
        calls()
