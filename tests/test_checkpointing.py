"""Activation checkpointing (vkdsl.autograd.checkpoint, Llama.forward(checkpoint=K)): the backward
recomputes a group of layers from its input. The gradients must be those of the graph that keeps
every activation (itself checked against finite differences in test_grad.py) to 1e-6, the
checkpointed composition must match finite differences of a float64 reference on its own, and the
traced step must hold fewer device bytes. Traced.plan, the bytes a program will hold decided before
anything is allocated, must equal what building it allocates."""
import gc

import numpy as np
import pytest

import vkdsl
from vkdsl.autograd import checkpoint, grad
from vkdsl.runtime import default_device

from conftest import check_grads, f32
from fixtures.train_data import batch


def _block(x, w, a, b):
    """A residual block with a frozen weight and a low-rank trainable path: x + tanh(x W) * (x A B)."""
    return x + (x @ w).tanh() * ((x @ a) @ b)


def _block64(x, w, a, b):
    return x + np.tanh(x @ w) * ((x @ a) @ b)


def test_a_checkpointed_block_matches_finite_differences(rng):
    x, w, a, b = f32(rng, 6, 8), f32(rng, 8, 8, scale=0.4), f32(rng, 8, 3, scale=0.4), f32(rng, 3, 8, scale=0.4)
    check_grads(lambda x, w, a, b: checkpoint(lambda h: _block(h, w, a, b), x, [a, b]).sum(axis=1),
                lambda x, w, a, b: _block64(x, w, a, b).sum(1), [x, w, a, b], [0, 2, 3], rng)


def _program_bytes(fn, *arrays):
    dev = default_device()
    gc.collect()                        # earlier programs freed now, not during the measurement
    before = dev.allocated_bytes
    prog = vkdsl.trace(fn).program(*arrays)
    used = dev.allocated_bytes - before
    return prog, used


@pytest.mark.parametrize("order", ["layer order", "reversed"])
def test_a_checkpointed_chain_gives_the_same_gradients_in_fewer_bytes(rng, order):
    # whichever order a program lists its gradients in (the schedule walks them last first)
    L, R, C = 6, 256, 64
    ws = [vkdsl.tensor(f32(rng, C, C, scale=0.2)) for _ in range(L)]
    ab = [(vkdsl.tensor(f32(rng, C, 4, scale=0.3), requires_grad=True),
           vkdsl.tensor(f32(rng, 4, C, scale=0.3), requires_grad=True)) for _ in range(L)]
    params = [t for pair in ab for t in pair]
    if order == "reversed":
        params = params[::-1]
    x0 = f32(rng, R, C)

    def step(every):
        def fn(x):
            h = x
            for i in range(L):
                blk = lambda h, i=i: _block(h, ws[i], *ab[i])        # noqa: E731
                h = checkpoint(blk, h, list(ab[i])) if every else blk(h)
            return [(h * h).sum()] + grad((h * h).sum(), params)
        return fn
    plans = {every: vkdsl.trace(step(every)).plan(x0)["total"] for every in (False, True)}
    _, kept = _program_bytes(step(False), x0)
    _, recomputed = _program_bytes(step(True), x0)
    # planned before allocating: the bytes building allocates (exact on lavapipe; a driver may round
    # each allocation up to its alignment)
    assert kept == pytest.approx(plans[False], rel=0.01) and recomputed == pytest.approx(plans[True], rel=0.01)
    plain = vkdsl.trace(step(False))(x0)
    ckpt = vkdsl.trace(step(True))(x0)
    assert float(ckpt[0]) == pytest.approx(float(plain[0]), rel=1e-6)
    for g0, g1 in zip(plain[1:], ckpt[1:]):
        np.testing.assert_allclose(g1, g0, rtol=1e-6, atol=1e-6 * np.abs(g0).max())
    assert recomputed < kept, f"checkpointed {recomputed} bytes vs {kept} keeping every activation"


@pytest.mark.parametrize("K,packed", [(1, False), (2, False), (1, True)])
def test_the_tiny_models_step_is_unchanged_by_checkpointing(tiny_model, K, packed):
    """The trainer's traced SFT + TMKL step on the tiny Llama: loss, KL and every adapter gradient
    with layers recomputed (every layer, or pairs; rows packed two to a sequence) equal the step
    that keeps every activation."""
    from vkdsl.train.step import build_grad_fn, select
    m, params = tiny_model
    ids, lab = batch(B=4, T=16, seed=3)
    pos, sl = select(lab)
    args = [ids, pos, sl, np.array([1.0 / int((lab != -100).sum())], np.float32)]
    if packed:                          # two rows of 8 tokens per sequence: positions restart, row spans
        start = np.arange(16) // 8 * 8
        spans = np.stack([start, start + 8], -1)
        args += [np.tile(np.arange(16) % 8, (4, 1)).astype(np.int32), np.tile(spans, (4, 1, 1)).astype(np.int32)]
    outs = {}
    for k in (0, K):
        fn = build_grad_fn(m, params, 0.5, checkpoint=k, packed=packed)
        planned = fn.plan(*args)["total"]
        dev = default_device()
        gc.collect()
        before = dev.allocated_bytes
        fn.program(*args)
        assert dev.allocated_bytes - before == pytest.approx(planned, rel=0.01)
        outs[k] = [np.asarray(o) for o in fn(*args)]
    for a, b in zip(outs[0], outs[K]):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * max(1e-30, np.abs(a).max()))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from fixtures.synthetic import build_tiny
    from vkdsl.models import load_model_files
    from vkdsl.models.llama import Llama
    from vkdsl.train.config import TrainConfig
    from vkdsl.train.inject import inject, params_of
    ck, _ = load_model_files(build_tiny(tmp_path_factory.mktemp("tiny_ckpt"), seed=3).gguf_path)
    m = Llama(ck)
    cfg = TrainConfig(targets=["attn_q", "attn_v", "ffn_down"], layers="", rank=4, alpha=8.0)
    names = inject(m, cfg)
    params = params_of(m, names)
    rng = np.random.default_rng(0)
    for p in params:                         # B away from 0, so every path carries a gradient
        p.assign(vkdsl.tensor(p.numpy() + rng.normal(0, 0.05, p.shape).astype(np.float32)))
    return m, params


def test_the_tiny_models_dpo_step_is_unchanged_by_checkpointing(tiny_model):
    from vkdsl.train.dpo import build_dpo_step
    from vkdsl.train.step import select
    m, params = tiny_model
    ids, lab = batch(B=2, T=16, seed=4)
    ids_r, lab_r = batch(B=2, T=16, seed=5)
    args = []
    for i, l in ((ids, lab), (ids_r, lab_r)):
        pos, sl = select(l)
        seg = np.zeros((2, len(pos)), np.float32)
        live = sl != -100
        seg[pos[live] // 16, np.flatnonzero(live)] = 1.0
        args += [i, pos, sl, seg]
    args += [np.array([0.1, -0.2], np.float32), np.array([0.05], np.float32)]
    outs = {k: [np.asarray(o) for o in build_dpo_step(m, params, 0.1, 1.0, checkpoint=k)(*args)] for k in (0, 1)}
    for a, b in zip(outs[0], outs[1]):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * max(1e-30, np.abs(a).max()))


def test_the_setting_is_parsed_and_bad_values_are_refused():
    from vkdsl.train.config import ConfigError, TrainConfig
    assert [TrainConfig(checkpoint=c).checkpoint_layers for c in ("none", "layers", "every:3")] == [0, 1, 3]
    for bad in ("every:0", "every:x", "all", "2"):
        with pytest.raises(ConfigError, match="checkpoint must be none, layers or every:K"):
            TrainConfig(checkpoint=bad).validate()


def test_smollm2s_step_is_unchanged_by_checkpointing():
    """The real model (SmolLM2-135M, Q4_1 packed base): the SFT + TMKL step with adapters on the
    top 4 layers, every layer recomputed, equals the step that keeps every activation."""
    from vkdsl.models import load_model_files
    from vkdsl.models.default import default_model_path
    from vkdsl.models.llama import Llama
    from vkdsl.train.config import TrainConfig
    from vkdsl.train.inject import inject, params_of
    from vkdsl.train.step import build_grad_fn, select
    m = Llama(load_model_files(default_model_path())[0])
    params = params_of(m, inject(m, TrainConfig(targets=["attn_q", "attn_v", "ffn_down"], layers="last:4")))
    rng = np.random.default_rng(1)
    for p in params:
        p.assign(vkdsl.tensor(p.numpy() + rng.normal(0, 0.02, p.shape).astype(np.float32)))
    ids = rng.integers(3, 49000, (2, 32)).astype(np.int32)
    lab = np.where(np.arange(32) >= 20, np.roll(ids, -1, 1), -100).astype(np.int32)
    pos, sl = select(lab)
    inv = np.array([1.0 / int((lab != -100).sum())], np.float32)
    outs = {k: [np.asarray(o) for o in build_grad_fn(m, params, 0.3, checkpoint=k)(ids, pos, sl, inv)]
            for k in (0, 1)}
    for a, b in zip(outs[0], outs[1]):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * max(1e-30, np.abs(a).max()))


def test_chunked_head_rows_die_with_their_chunk(rng):
    """A loss over a wide (R, V) matrix in 8 row chunks (vkdsl.autograd.rowwise, as the LM head
    runs), the loss reported and differentiated: each chunk's V-wide temporaries must be freed
    before the next chunk's are made, so the program holds one chunk's working set, not eight."""
    from vkdsl.autograd import rowwise
    from vkdsl.ops import losses
    R, C, V, n = 512, 64, 4096, 64
    w = vkdsl.tensor(f32(rng, C, V, scale=0.1))
    labels = rng.integers(0, V, R).astype(np.int32)
    chunk = n * V * 4                                   # one chunk's logits: 1 MiB

    def step(x, lab):
        x.requires_grad = True
        parts = [rowwise(lambda h, l: (lambda ce: (ce, ce))(-losses.token_logprobs(h @ w, l)[0]),
                         x[s:s + n], lab[s:s + n]) for s in range(0, R, n)]
        loss = sum(p[0].sum() for p in parts[1:]) + parts[0][0].sum()
        report = sum(p[1].sum() for p in parts[1:]) + parts[0][1].sum()
        return [report] + grad(loss, [x])
    prog, used = _program_bytes(step, f32(rng, R, C), labels)
    # one chunk's logits, softmax, one-hot and gradient rows are ~4 chunks' worth; all eight chunks'
    # logits alone would be 8
    assert used < 6 * chunk, f"{used / chunk:.1f} chunks' worth of V-wide buffers held"
    out = vkdsl.trace(step)(f32(rng, R, C), labels)
    assert np.isfinite(float(out[0]))


def test_bench_train_plans_the_steps_without_running_them():
    import json
    from fixtures.cli import run
    plans = {}
    for c in ("none", "layers"):
        rows = [json.loads(line) for line in run(["bench", "train", "--plan", "--checkpoint", c, "--json"]).stdout
                .splitlines() if line.startswith("{")]
        assert [r["case"].split(" (")[0] for r in rows] == ["sft 4x256, adapters on q,v", "sft 4x256, adapters on all seven"]
        assert all(r["weights_bytes"] > 0 and r["plan_total_bytes"] > r["plan_temporaries_bytes"] > 0 for r in rows)
        plans[c] = [r["plan_temporaries_bytes"] for r in rows]
    assert all(b < a / 2 for a, b in zip(plans["none"], plans["layers"])), plans


# ---- fp16 saved activations (vkdsl.autograd.saved_activations, TrainConfig.activations) ----

def _mlp_grads(X, W1, W2, dtype):
    """loss = sum((tanh(X W1) W2)^2) and its gradients in W1, W2, kept activations in `dtype`."""
    from vkdsl.autograd import saved_activations
    w1, w2 = vkdsl.tensor(W1, requires_grad=True), vkdsl.tensor(W2, requires_grad=True)

    def step(x):
        y = (x @ w1).tanh() @ w2
        loss = (y * y).sum()
        with saved_activations(dtype):
            return [loss] + grad(loss, [w1, w2])
    return [np.asarray(o) for o in vkdsl.trace(step)(X)]


def test_fp16_saved_activations_are_the_gradients_at_the_fp16_rounded_values(rng):
    """Against float64 numpy: the forward is unchanged (fp32 values), and the backward reads h =
    tanh(X W1) and y = h W2 rounded to fp16 -- d W2 = h16^T 2 y16, d W1 = X^T ((2 y16 W2^T) (1 - h16^2)).
    The fp32 path is farther from that reference than the tolerance: the rounding is real."""
    X, W1, W2 = f32(rng, 64, 32), f32(rng, 32, 48, scale=0.3), f32(rng, 48, 16, scale=0.3)
    X64, W164, W264 = (a.astype(np.float64) for a in (X, W1, W2))
    h = np.tanh(X64 @ W164)
    y = h @ W264
    r16 = lambda a: a.astype(np.float32).astype(np.float16).astype(np.float64)     # noqa: E731
    h16, gy = r16(h), 2 * r16(y)
    ref = [np.sum(y * y), X64.T @ ((gy @ W264.T) * (1 - h16 * h16)), h16.T @ gy]
    half, full = _mlp_grads(X, W1, W2, "float16"), _mlp_grads(X, W1, W2, "float32")
    assert float(half[0]) == float(full[0])                     # the forward is not touched
    np.testing.assert_allclose(half[0], ref[0], rtol=1e-5)
    for got, fp32, want in zip(half[1:], full[1:], ref[1:]):
        err = lambda a: np.abs(a - want).max() / np.abs(want).max()     # noqa: E731
        assert err(got) < 2e-5, err(got)
        assert err(fp32) > 5 * err(got), (err(fp32), err(got))


def test_fp16_saved_activations_halve_what_the_tiny_models_step_keeps(tiny_model):
    """The trainer's SFT step on the tiny Llama, activations fp16 vs fp32: the same losses (the
    forward is unchanged), adapter gradients within 1% of the fp32 step's, and the kept values
    stored in half the bytes -- the program holds less, and building it allocates what the plan said.
    (The values alive at the step's peak fall by 28% here; the program's buffers by less, since a
    freed slot is reused only by a value of its exact size. SmolLM2 at 4 x 256: BENCHMARKS.md.)"""
    from vkdsl.train.step import build_grad_fn, select
    m, params = tiny_model
    ids, lab = batch(B=8, T=64, seed=3)
    pos, sl = select(lab)
    args = [ids, pos, sl, np.array([1.0 / int((lab != -100).sum())], np.float32)]
    outs, planned = {}, {}
    for act in ("fp32", "fp16"):
        fn = build_grad_fn(m, params, 0.5, activations=act)
        planned[act] = fn.plan(*args)["temporaries"]
        _, used = _program_bytes(lambda *a, fn=fn: fn.fn(*a), *args)
        assert used == pytest.approx(fn.plan(*args)["total"], rel=0.01)
        outs[act] = [np.asarray(o) for o in fn(*args)]
    assert planned["fp16"] < 0.95 * planned["fp32"], planned
    for a, b in zip(outs["fp32"][:2], outs["fp16"][:2]):
        assert float(a) == float(b)
    for a, b in zip(outs["fp32"][2:], outs["fp16"][2:]):
        assert np.abs(b - a).max() <= 1e-2 * np.abs(a).max()


def test_the_activations_setting_is_checked():
    from vkdsl.train.config import ConfigError, TrainConfig
    assert TrainConfig(activations="fp16").validate().activations == "fp16"
    with pytest.raises(ConfigError, match="activations 'bf16': expected fp32 or fp16"):
        TrainConfig(activations="bf16").validate()
