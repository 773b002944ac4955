"""The training step on a tiny model: lambda = 0 is a separately written plain SFT step, k micro-batches equal
one batch k times larger, the TMKL term equals ops.losses.tmkl and a float64 numpy reference."""
import numpy as np
import pytest

import vkdsl
from vkdsl.autograd import grad
from vkdsl.models import load_model_files
from vkdsl.models.llama import Llama
from vkdsl.ops import losses
from vkdsl.train.config import TrainConfig
from vkdsl.train.inject import InjectError, inject, params_of
from vkdsl.train.step import Stepper, select
from fixtures.synthetic import build_tiny
from fixtures.train_data import batch

IGN = -100


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny_obj"), seed=3)


def model_with_adapters(tiny, **kw):
    ck, tok = load_model_files(tiny.gguf_path)
    m = Llama(ck)
    cfg = TrainConfig(**{**dict(targets=["attn_q", "v_proj", "blk.1.ffn_down"], rank=4, alpha=8.0, lr=0.05), **kw})
    names = inject(m, cfg)
    return m, names, cfg


def set_params(params, arrays):
    for p, a in zip(params, arrays):
        p.assign(vkdsl.tensor(a))


def test_patterns(tiny):
    m, names, _ = model_with_adapters(tiny)
    assert names == ["blk.0.attn_q", "blk.0.attn_v", "blk.1.attn_q", "blk.1.attn_v", "blk.1.ffn_down"]
    m2 = Llama(load_model_files(tiny.gguf_path)[0])
    with pytest.raises(InjectError, match="'qq_proj' matched no module.*attn_q.*q_proj"):
        inject(m2, TrainConfig(targets=["qq_proj"]))
    assert inject(m2, TrainConfig(targets=["up_proj"], layers="1", rank=2)) == ["blk.1.ffn_up"]


def adamw_reference(p, g, m, v, t, lr, b1, b2, eps, wd):
    """One AdamW step written from Loshchilov & Hutter's algorithm, float64, bias-corrected."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mhat, vhat = m / (1 - b1 ** t), v / (1 - b2 ** t)
    return p - lr * (mhat / (np.sqrt(vhat) + eps) + wd * p), m, v


def test_lambda_zero_is_plain_sft(tiny):
    m, names, cfg = model_with_adapters(tiny, tmkl=0.0, clip=0.0)
    params = params_of(m, names)
    init = [p.numpy() for p in params]
    ids, lab = batch()
    calls = []
    fwd = m.forward
    m.forward = lambda *a, **k: (calls.append(k.get("adapters_on", True)), fwd(*a, **k))[1]
    st = Stepper(m, params, cfg)
    for _ in range(3):
        st.step([(ids, lab)], cfg.lr)
    got = [p.numpy() for p in params]
    assert False not in calls, "lambda = 0 must not build a base (adapters off) forward"
    m.forward = fwd
    # Plain SFT written separately: mean masked CE over the full (B*T, V) logits (no position
    # selection, no TMKL code), its autodiff gradient, and the test's own float64 AdamW.
    set_params(params, init)

    @vkdsl.trace
    def sft(ids_t, lab_t):
        loss, _ = losses.cross_entropy(m.forward(ids_t), lab_t)
        return grad(loss, params)
    b1, b2 = cfg.betas
    state = [(p.astype(np.float64), np.zeros(p.shape), np.zeros(p.shape)) for p in init]
    for t in range(1, 4):
        gs = [np.asarray(g, np.float64) for g in sft(ids, lab)]
        state = [adamw_reference(p, g, mo, v, t, cfg.lr, b1, b2, cfg.eps, cfg.weight_decay)
                 for (p, mo, v), g in zip(state, gs)]
        set_params(params, [p.astype(np.float32) for p, _, _ in state])
    # Adam's first steps move each weight by ~lr whatever the gradient's size, so fp32 gradient
    # noise shows only where g is tiny: relative to lr, not to the weight
    for a, (b, _, _) in zip(got, state):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * cfg.lr)
    assert any(np.abs(a - i).max() > cfg.lr for a, i in zip(got, init))      # it did train


def test_accumulation_equals_bigger_batch(tiny):
    m, names, cfg = model_with_adapters(tiny, tmkl=0.1, clip=0.0)
    params = params_of(m, names)
    init = [p.numpy() for p in params]
    ids, lab = batch(B=4, seed=1)
    one = Stepper(m, params, cfg)
    r1 = one.step([(ids, lab)], cfg.lr)
    r1b = one.step([(ids, lab)], cfg.lr)                  # second step: A and the TMKL term are live
    after_one = [p.numpy() for p in params]
    set_params(params, init)
    two = Stepper(m, params, cfg)
    # two micro-batches of 2 rows with different supervised counts (5 and 9 tokens)
    micro = [(ids[:2], lab[:2]), (ids[2:], lab[2:])]
    r2 = two.step(micro, cfg.lr)
    r2b = two.step(micro, cfg.lr)
    assert r1["tokens"] == r2["tokens"] == int((lab != IGN).sum())
    assert r1b["loss"] == pytest.approx(r2b["loss"], rel=1e-5)
    assert r1b["tmkl"] == pytest.approx(r2b["tmkl"], rel=1e-3, abs=1e-7)
    for a, b in zip(r1b["raw_grads"], r2b["raw_grads"]):     # fp32 sums in another order: relative to the tensor
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())
    for a, p in zip(after_one, params):
        np.testing.assert_allclose(a, p.numpy(), rtol=1e-4, atol=1e-5)   # Adam divides by sqrt(v)
    # a naive mean of per-micro-batch means would weight the 5-token half like the 9-token half
    assert r1["loss"] == pytest.approx(r2["loss"], rel=1e-5)


def numpy_tmkl(za, zb, labels):
    """Float64 reference: remove the target, renormalise both, KL(adapted || base), mean."""
    out = []
    for a, b, y in zip(za.astype(np.float64), zb.astype(np.float64), labels):
        if y == IGN:
            continue
        keep = np.arange(a.size) != y
        la = a[keep] - np.log(np.exp(a[keep] - a[keep].max()).sum()) - a[keep].max()
        lb = b[keep] - np.log(np.exp(b[keep] - b[keep].max()).sum()) - b[keep].max()
        out.append(float((np.exp(la) * (la - lb)).sum()))
    return float(np.mean(out))


def test_tmkl_term_matches_references(tiny):
    m, names, cfg = model_with_adapters(tiny, tmkl=0.5)
    params = params_of(m, names)
    ids, lab = batch(B=2, seed=2)
    st = Stepper(m, params, cfg)
    r0 = st.step([(ids, lab)], cfg.lr)
    assert r0["tmkl"] == 0.0                               # B = 0: adapted == base exactly
    st.step([(ids, lab)], cfg.lr)
    n = int((lab != IGN).sum())
    pos, sl = select(lab)
    out = st.fn(ids, pos, sl, np.array([1.0 / n], np.float32), st.base_cache.logits(ids, lab, pos))
    kl_step = float(out[1]) / n
    za = m.forward(vkdsl.tensor(ids)).numpy().reshape(-1, 300)
    zb = m.forward(vkdsl.tensor(ids), adapters_on=False).numpy().reshape(-1, 300)
    ops_kl = losses.tmkl(vkdsl.tensor(za), vkdsl.tensor(zb), vkdsl.tensor(lab.reshape(-1))).item()
    ref = numpy_tmkl(za, zb, lab.reshape(-1))
    assert ref > 1e-6
    assert kl_step == pytest.approx(ops_kl, rel=1e-3)
    assert kl_step == pytest.approx(ref, rel=1e-3)


def test_tmkl_pulls_toward_base(tiny):
    """With only the KL term at work (no supervised signal difference), steps shrink the KL."""
    m, names, cfg = model_with_adapters(tiny, tmkl=1.0, lr=0.02, clip=0.0)
    params = params_of(m, names)
    rng = np.random.default_rng(7)
    set_params(params, [p.numpy() + rng.normal(0, 0.3, p.shape).astype(np.float32) for p in params])
    ids, lab = batch(B=2, seed=4)
    base_cfg = TrainConfig(**{**cfg.__dict__, "tmkl": 1.0})
    st = Stepper(m, params, base_cfg)
    kls = [st.step([(ids, lab)], base_cfg.lr)["tmkl"] for _ in range(6)]
    assert kls[-1] < kls[0]


def test_cached_base_logits_give_the_same_training(tiny):
    # TMKL with the base logits cached per row (one base forward per row) trains as the in-step base
    # forward does, to 1e-6; the second and third visits of the rows run no base forward
    runs = {}
    for budget in (0, 1 << 30):
        m, names, cfg = model_with_adapters(tiny, tmkl=0.5, clip=0.0, tmkl_cache_bytes=budget)
        params = params_of(m, names)
        st = Stepper(m, params, cfg)
        ids, lab = batch(B=4, seed=2)
        recs = [st.step([(ids[:2], lab[:2]), (ids[2:], lab[2:])], cfg.lr) for _ in range(3)]
        runs[budget] = ([p.numpy() for p in params], recs, st.base_cache)
    (p0, r0, none), (p1, r1, cache) = runs[0], runs[1 << 30]
    assert none is None and cache.misses == 2 and cache.hits == 4 and cache.bytes > 0
    for a, b in zip(r0, r1):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["tmkl"] == pytest.approx(b["tmkl"], rel=1e-5)
    for a, b in zip(p0, p1):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_cached_base_logits_follow_the_whole_reply(tiny):
    # two rows equal up to their first supervised target, different after: each must get its own
    # base logits (what an uncached base forward gives), not the other's
    m, names, cfg = model_with_adapters(tiny, tmkl=0.5)
    st = Stepper(m, params_of(m, names), cfg)
    ids, lab = batch(B=2, seed=5)
    ids[1], lab[1] = ids[0], lab[0]
    sup = np.flatnonzero(lab[1] != IGN)
    ids[1, sup[-1]] = (ids[1, sup[-1]] + 7) % 300       # a later reply token differs
    pos, _ = select(lab)
    st.base_cache.logits(ids[:1], lab[:1], select(lab[:1])[0])     # row 0 cached first
    got = st.base_cache.logits(ids, lab, pos)
    want = st.base_cache.fn(ids, pos)
    np.testing.assert_allclose(got[:int((lab != IGN).sum())], want[:int((lab != IGN).sum())], atol=1e-5)


def test_a_cache_over_budget_computes_in_step(tiny):
    m, names, cfg = model_with_adapters(tiny, tmkl=0.5, clip=0.0, tmkl_cache_bytes=1)
    st = Stepper(m, params_of(m, names), cfg)
    ids, lab = batch(B=2, seed=4)
    st.step([(ids, lab)], cfg.lr)
    st.step([(ids, lab)], cfg.lr)
    assert st.base_cache.bytes == 0 and st.base_cache.hits == 0 and st.base_cache.misses == 2


def test_profile_classes_cover_every_dispatch(tiny):
    # `vkdsl bench train --by-kernel` on the tiny model: each timed dispatch lands in one class, the
    # rows add up to the step's wall, and the base logits a first visit computes (another program)
    # are a row of their own, not "host" (as they were filed until the device counted its waits)
    from vkdsl.train.profile import CLASSES, PROGRAMS, table, timed
    m, names, cfg = model_with_adapters(tiny, tmkl=0.1)
    st = Stepper(m, params_of(m, names), cfg)
    ids, lab = batch(B=2, seed=4)
    st.step([(ids, lab)], cfg.lr)                                     # compiles
    ids, lab = batch(B=2, seed=5)                                     # a first visit
    wall, waited = timed(lambda: st.step([(ids, lab)], cfg.lr))
    pos, sl = select(lab)
    prog = st.fn.program(ids, pos, sl, np.ones(1, np.float32), st.base_cache.logits(ids, lab, pos))
    assert set(waited) == {prog.recording.label, "base_hidden", "base_head", "assign"}
    rows = table(prog, m.cfg.vocab_size, wall, "sft", waited)
    kernels = [r for r in rows if r["class"] in CLASSES]
    assert sum(r["calls"] for r in kernels) == sum(1 for s in prog.steps if s.kind != "assign")
    assert {"LoRA (narrow matmuls)", "LM head + cross-entropy"} <= {r["class"] for r in kernels}
    assert all(r["gflops"] is None or r["gflops"] > 0 for r in rows)
    parts = {r["class"]: r["seconds"] for r in rows if r["class"] != "step wall"}
    assert sum(parts.values()) == pytest.approx(wall, rel=1e-9)
    base = PROGRAMS["base_hidden"]
    assert parts[base] == pytest.approx(waited["base_hidden"] + waited["base_head"], rel=1e-9)
    host = next(s for c, s in parts.items() if c.startswith("host"))
    assert 0 < host < wall


def test_profile_names_the_delta_rules_solve_apart_from_the_embedding_gather():
    # the chunk solve is a hand-written kernel of its own, not an "embedding gather" (as it was filed)
    import vkdsl
    from vkdsl.ops.gated_delta import tri_inverse
    from vkdsl.realize import Program
    from vkdsl.train.profile import CLASSES, kernel_class
    a = vkdsl.tensor(np.tril(np.random.default_rng(0).standard_normal((2, 8, 8)).astype(np.float32), -1))
    prog = Program([tri_inverse(a) * 2.0])
    classes = [kernel_class(s, vocab=50) for s in prog.steps if s.kind == "custom"]
    assert classes == [CLASSES[10]] and "delta rule" in CLASSES[10] and "gather" not in CLASSES[10]
