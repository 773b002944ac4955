"""The fused attention kernels (forward and FlashAttention-2-style backward) against an independent
float64 numpy attention, at shapes that cross their 64-query and 128-key workgroups, with grouped
heads, with an additive mask (block-diagonal rows and -inf holes) and without causality; a finite-
difference check of the fused gradient; and proof that training through it keeps no T x T tensor.

Tolerance: fp32 dot products of D <= 64 terms and sums over <= 300 keys: NMSE ~ 1e-13 measured;
the limit 1e-10 leaves room and still catches any wrong term (a dropped key or head is ~1e-2)."""
import numpy as np
import pytest

import vkdsl
from vkdsl.autograd import grad
from vkdsl.ops import attention as A

from conftest import check_grads as check, f32, nmse

LIMIT = 1e-10


def _probs(q, k, v, mask, causal):
    """float64 (q, kv heads repeated per query head, p (B, Hq, Tq, Tk), G); rows with no key are 0."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, Tq, Hq, D = q.shape
    Tk, G = k.shape[1], Hq // k.shape[2]
    kk, vv = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, kk) / np.sqrt(D)
    if causal:
        s = s + np.where(np.arange(Tk)[None, :] <= np.arange(Tq)[:, None] + (Tk - Tq), 0.0, -np.inf)
    if mask is not None:
        s = s + np.asarray(mask, np.float64)[:, None]
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(-1, keepdims=True)
    return q, kk, vv, np.where(l > 0, p / np.where(l > 0, l, 1.0), 0.0), G


def reference(q, k, v, mask=None, causal=True):
    """float64 grouped-query attention: q (B, Tq, Hq, D), k, v (B, Tk, Hkv, D), mask (B, Tq, Tk)."""
    _, _, vv, p, _ = _probs(q, k, v, mask, causal)
    return np.einsum("bhij,bjhd->bihd", p, vv)


def reference_grads(q, k, v, g, mask=None, causal=True):
    """d sum(out * g) / d(q, k, v) in float64, from the reference by the chain rule written out."""
    q, kk, vv, p, G = _probs(q, k, v, mask, causal)
    g, D = np.asarray(g, np.float64), q.shape[-1]
    dv = np.einsum("bhij,bihd->bjhd", p, g)
    dp = np.einsum("bihd,bjhd->bhij", g, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(D)
    dq = np.einsum("bhij,bjhd->bihd", ds, kk)
    dk = np.einsum("bhij,bihd->bjhd", ds, q)
    fold = lambda x: x.reshape(*x.shape[:2], -1, G, D).sum(3)        # noqa: E731  query heads -> kv head
    return dq, fold(dk), fold(dv)


@pytest.fixture(params=["texel", "storage"])
def loads(request, dev, monkeypatch):
    """The kernels read their operands as texel buffers (lavapipe's choice) or as storage buffers (GPUs'
    choice, and a CPU driver's where an operand is beyond maxTexelBufferElements): both run here."""
    if request.param == "storage":
        monkeypatch.setattr(A, "texel_reads", lambda *a: False)
    elif dev.info.kind != "cpu" or not dev.limits.max_texel_elements:
        pytest.skip("texel loads are a CPU-driver choice")
    return request.param


def built_attention(dev) -> set:
    """Names of the fused attention kernels this device has built."""
    return {key[2] for key in dev.kernels
            if isinstance(key, tuple) and key[0] == "variant" and key[1].startswith("attention")}


def device(q, k, v, g, mask=None, causal=True):
    Q, K, V = (vkdsl.tensor(a, requires_grad=True) for a in (q, k, v))
    M = None if mask is None else vkdsl.tensor(mask)
    assert A.fused_applies(Q, K, V, causal), "the fused kernels must be the ones under test"
    out = A.attention(Q, K, V, mask=M, causal=causal)
    grads = grad((out * vkdsl.tensor(g)).sum(), [Q, K, V])
    return out.numpy(), [x.numpy() for x in grads]


SHAPES = [  # B, T, Hq, Hkv, D: one workgroup; several (70 > 64 queries); more keys than one 128 block
    (1, 17, 9, 3, 64), (2, 70, 4, 2, 16), (1, 130, 9, 3, 64), (2, 24, 4, 4, 8)]


@pytest.mark.parametrize("B,T,Hq,Hkv,D", SHAPES)
def test_fused_causal_matches_float64(dev, rng, loads, B, T, Hq, Hkv, D):
    q, k, v = f32(rng, B, T, Hq, D), f32(rng, B, T, Hkv, D), f32(rng, B, T, Hkv, D)
    g = f32(rng, B, T, Hq, D)
    out, grads = device(q, k, v, g)
    names = {n for n in built_attention(dev) if n.endswith(f"_d{D}_g{Hq // Hkv}" + "_t" * (loads ==
                                                                                      "texel"))}
    assert len(names) == 4, f"{loads} loads: the forward and three backward passes, built {names}"
    assert nmse(out, reference(q, k, v)) < LIMIT
    for name, got, want in zip("qkv", grads, reference_grads(q, k, v, g)):
        assert nmse(got, want) < LIMIT, f"d{name}: nmse {nmse(got, want):.2e}"


def segment_mask(B, T, rng, holes=True):
    """Block-diagonal rows (a packed batch: each row sees its own segment only) plus random -inf holes
    that never empty a query's keys (the diagonal stays visible), and finite biases elsewhere."""
    seg = np.cumsum(rng.random((B, T)) < 0.15, axis=1)
    mask = np.where(seg[:, :, None] == seg[:, None, :], rng.uniform(-1, 1, (B, T, T)), -np.inf)
    if holes:
        mask = np.where((rng.random((B, T, T)) < 0.2) & ~np.eye(T, dtype=bool), -np.inf, mask)
    return mask.astype(np.float32)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_with_mask_matches_float64(dev, rng, loads, causal):
    B, T, Hq, Hkv, D = 2, 75, 6, 2, 16
    q, k, v = f32(rng, B, T, Hq, D), f32(rng, B, T, Hkv, D), f32(rng, B, T, Hkv, D)
    g, mask = f32(rng, B, T, Hq, D), segment_mask(B, T, rng)
    out, grads = device(q, k, v, g, mask, causal)
    assert nmse(out, reference(q, k, v, mask, causal)) < LIMIT
    for name, got, want in zip("qkv", grads, reference_grads(q, k, v, g, mask, causal)):
        assert nmse(got, want) < LIMIT, f"d{name}: nmse {nmse(got, want):.2e}"


def test_a_query_that_sees_no_key_gets_zeros(dev, rng):
    B, T, H, D = 1, 20, 2, 8
    q, k, v, g = f32(rng, B, T, H, D), f32(rng, B, T, H, D), f32(rng, B, T, H, D), f32(rng, B, T, H, D)
    mask = np.zeros((B, T, T), np.float32)
    mask[0, 5, :] = -np.inf                          # query 5 sees nothing: zeros, not NaN
    out, grads = device(q, k, v, g, mask, causal=False)
    assert np.all(np.isfinite(out)) and np.all(out[0, 5] == 0)
    assert all(np.all(np.isfinite(x)) for x in grads) and np.all(grads[0][0, 5] == 0)
    assert nmse(out, reference(q, k, v, mask, False)) < LIMIT


def test_fused_gradient_against_finite_differences(dev, rng):
    """The fused path (T >= 16) against central differences of golden's float64 attention."""
    from vkdsl_golden import reference_train as RT
    T, Hq, Hkv, D = 18, 4, 2, 8
    q, k, v = f32(rng, T, Hq, D), f32(rng, T, Hkv, D), f32(rng, T, Hkv, D)
    check(lambda a, b, c: A.attention(a.reshape(1, T, Hq, D), b.reshape(1, T, Hkv, D),
                                      c.reshape(1, T, Hkv, D)).reshape(T, Hq, D),
          RT.attention, [q, k, v], [0, 1, 2], rng)


def test_training_through_it_keeps_no_t_by_t_tensor(dev, rng):
    """A traced forward + backward at T = 256: no buffer as large as one head's T x T scores (the
    composite allocates B x Hq x T x T several times over)."""
    B, T, Hq, Hkv, D = 1, 256, 4, 2, 16
    q, k, v = (vkdsl.tensor(f32(rng, B, T, h, D), requires_grad=True) for h in (Hq, Hkv, Hkv))

    def program(fn):
        @vkdsl.trace
        def step(up):
            return grad((fn(q, k, v) * up).sum(), [q, k, v])
        return step.program(f32(rng, B, T, Hq, D))
    biggest = lambda prog: max(b.nbytes for b in prog.buffers())      # noqa: E731
    assert biggest(program(A.attention_composed)) >= B * Hq * T * T * 4        # the test can fail
    assert biggest(program(A.attention)) < T * T * 4


def spans_of(lengths, T):
    """(1, T, 2) int32 row spans of rows of these lengths packed from 0; the rest padding rows of one."""
    span = np.stack([np.arange(T), np.arange(T) + 1], -1)
    at = 0
    for n in lengths:
        span[at:at + n] = (at, at + n)
        at += n
    return span[None].astype(np.int32)


@pytest.mark.parametrize("T,lengths", [(300, [70, 130, 25, 55]), (2048, [900, 600, 400, 100])],
                         ids=["300", "2048"])
def test_packed_rows_by_span_match_float64_and_finite_differences(dev, rng, loads, T, lengths):
    """Rows packed into one long sequence (fused attention with row spans): forward and gradients
    against float64 with the rows' block-diagonal mask, and the gradient along a random direction
    against central differences of that float64 forward (a small width: 2 query heads, D = 8)."""
    B, Hq, Hkv, D = 1, 2, 1, 8
    q, k, v, g = f32(rng, B, T, Hq, D), f32(rng, B, T, Hkv, D), f32(rng, B, T, Hkv, D), f32(rng, B, T, Hq, D)
    spans = spans_of(lengths, T)
    mask = np.where(np.arange(T)[None, None, :] >= spans[:, :, :1], 0.0, -np.inf)      # + causal: the row
    Q, K, V = (vkdsl.tensor(a, requires_grad=True) for a in (q, k, v))
    out = A.attention(Q, K, V, spans=vkdsl.tensor(spans))
    grads = [x.numpy() for x in grad((out * vkdsl.tensor(g)).sum(), [Q, K, V])]
    assert nmse(out.numpy(), reference(q, k, v, mask)) < LIMIT
    for name, got, want in zip("qkv", grads, reference_grads(q, k, v, g, mask)):
        assert nmse(got, want) < LIMIT, f"d{name}: nmse {nmse(got, want):.2e}"
    eps = 1e-4
    for i, a in enumerate((q, k, v)):
        d = rng.standard_normal(a.shape)
        args = [x.astype(np.float64) for x in (q, k, v)]
        plus, minus = list(args), list(args)
        plus[i], minus[i] = args[i] + eps * d, args[i] - eps * d
        fd = ((reference(*plus, mask) - reference(*minus, mask)) * g).sum() / (2 * eps)
        assert (grads[i] * d).sum() == pytest.approx(fd, rel=1e-4)


@pytest.mark.parametrize("profile,T,texel", [("minimal", 256, True), ("minimal", 1100, False),
                                             ("mobile-mali", 256, False)])
def test_devices_without_int64_train_through_the_fused_kernels(tmp_path, rng, profile, T, texel):
    """Without shaderInt64 (the minimal and Mali-like profiles: a device is opened once per process, so
    in a child) the fused kernels load 8 floats as two vec4 (NO_INT64): the fused path is still taken
    (no T x T buffer), the kernels built are the NO_INT64 ones, and the forward and gradients match
    the float64 reference. The minimal profile's 65,536 texels hold T = 256's operands (texel loads)
    but not T = 1100's q (storage loads); the Mali-like GPU profile always loads from storage."""
    import os
    import subprocess
    import sys
    B, Hq, Hkv, D = 1, 4, 2, 16
    x = [f32(rng, B, T, h, D) for h in (Hq, Hkv, Hkv)]
    up = f32(rng, B, T, Hq, D)
    np.savez(tmp_path / "in.npz", q=x[0], k=x[1], v=x[2], up=up)
    code = f"""
import numpy as np, vkdsl
from vkdsl.autograd import grad
from vkdsl.ops import attention as A
from vkdsl.runtime import default_device
a = np.load({str(tmp_path / "in.npz")!r})
q, k, v = (vkdsl.tensor(a[n], requires_grad=True) for n in "qkv")
@vkdsl.trace
def step(u):
    o = A.attention(q, k, v)
    return [o] + grad((o * u).sum(), [q, k, v])
out = step(a["up"])
big = max(b.nbytes for b in step.program(a["up"]).buffers())
built = [key for key in default_device().kernels if isinstance(key, tuple) and key[0] == "variant"]
no64 = any("attention" in key[1] and ("NO_INT64", 1) in key[3] for key in built)
names = {{key[2] for key in built if "attention" in key[1]}}
np.savez({str(tmp_path / "out.npz")!r}, o=out[0], dq=out[1], dk=out[2], dv=out[3], big=big, no64=no64,
         texel=[n.endswith("_t") for n in sorted(names)])
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "VKDSL_PROFILE": profile})
    assert p.returncode == 0, p.stderr
    got = np.load(tmp_path / "out.npz")
    assert bool(got["no64"]) and int(got["big"]) < T * T * 4
    assert len(got["texel"]) == 4 and all(got["texel"] == texel), got["texel"]
    assert nmse(got["o"], reference(*x)) < 1e-10
    for name, want in zip(("dq", "dk", "dv"), reference_grads(*x, up)):
        assert nmse(got[name], want) < 1e-10, name
