"""The training ops' forward references against independent computations."""
from __future__ import annotations

import math

import numpy as np
import pytest

from vkdsl_golden import reference_train as T
from vkdsl_golden.store import load_case

from golden_common import (_case, _close, f64, rng0)


# =======================================================================================
# phase 2 forward references vs independent computations
# =======================================================================================

def test_dpo_policy_equals_reference_is_ln2():
    pc, pr = np.array([-12.0, -40.0, -3.5]), np.array([-20.0, -8.0, -3.6])
    loss, rows = T.dpo(pc, pr, pc, pr, beta=0.1)
    assert abs(float(loss) - math.log(2)) < 1e-15 and np.allclose(rows, math.log(2), rtol=0, atol=1e-15)
    assert abs(float(load_case(_case(None, "dpo[n=3,policy=ref]"))["out"]) - 0.693147) < 1e-6
    # a far-apart margin stays finite (softplus, not log(sigmoid))
    big, _ = T.dpo(np.array([0.0]), np.array([-1e4]), np.array([-1e4]), np.array([0.0]), 1.0)
    assert float(big) < 1e-300 or float(big) == 0.0
    worse, _ = T.dpo(np.array([-1e4]), np.array([0.0]), np.array([0.0]), np.array([-1e4]), 1.0)
    assert float(worse) == 2e4


def test_cross_entropy_vs_loops_and_errors():
    r = rng0(20)
    x, lab = r.standard_normal((5, 7)) * 3, np.array([0, -100, 6, 3, -100])
    loss, rows = T.cross_entropy(x, lab)
    want = [math.log(math.fsum(math.exp(v) for v in x[i])) - x[i, lab[i]] for i in (0, 2, 3)]
    assert abs(float(loss) - math.fsum(want) / 3) < 1e-14
    assert rows[1] == rows[4] == 0.0
    with pytest.raises(ValueError, match="no supervised"):
        T.cross_entropy(x, np.full(5, -100))
    with pytest.raises(ValueError, match="no supervised"):
        T.tmkl(x, x, np.full(5, -100))
    with pytest.raises(ValueError, match="labels must be"):
        T.cross_entropy(x, np.array([0, 7, 1, 1, 1]))


def test_lora_at_init_is_base_and_da_is_zero():
    a = load_case(_case(None, "lora_linear[7x33x17,r=4,B=0]"))
    x, w = a["in0"].astype(f64), a["in1"].astype(f64)
    np.testing.assert_allclose(a["out"], x @ w, rtol=1e-12, atol=1e-12)
    assert np.all(a["grad_in2"] == 0.0) and np.any(a["grad_in3"] != 0.0)
    np.testing.assert_allclose(a["grad_in1"], x.T @ a["gout"].astype(f64), rtol=1e-12, atol=1e-12)


def test_rmsnorm_vs_loops():
    r = rng0(21)
    x, w = r.standard_normal((2, 9)), r.uniform(0.5, 1.5, 9)
    y = T.rmsnorm(x, w, 1e-5)
    for i in range(2):
        inv = 1.0 / math.sqrt(math.fsum(v * v for v in x[i]) / 9 + 1e-5)
        _close(y[i], [x[i, j] * inv * w[j] for j in range(9)], 1e-15)


def test_rope_is_complex_rotation_and_matches_hf_after_gguf_permutation():
    r = rng0(22)
    T_, H, D, base = 4, 2, 8, 10000.0
    x, pos = r.standard_normal((T_, H, D)), np.array([0, 1, 5, 1000])
    y = T.rope(x, pos, base)
    # complex view: (x[2i] + i x[2i+1]) * exp(i * pos * base^(-2i/D))
    z = x[..., 0::2] + 1j * x[..., 1::2]
    ang = pos[:, None, None] * base ** (-2.0 * np.arange(D // 2) / D)
    w = z * np.exp(1j * ang)
    np.testing.assert_allclose(y[..., 0::2], w.real, atol=1e-14)
    np.testing.assert_allclose(y[..., 1::2], w.imag, atol=1e-14)
    assert np.array_equal(y[0], x[0])                      # position 0 is the identity
    # GGUF row 2i + j holds HF row (D/2) j + i; HF rotates halves (rotate_half)
    perm = np.array([(D // 2) * j + i for i in range(D // 2) for j in range(2)])
    xh = r.standard_normal((T_, H, D))
    c, s = np.cos(ang), np.sin(ang)
    lo, hi = xh[..., : D // 2], xh[..., D // 2:]
    yh = np.concatenate([lo * c - hi * s, hi * c + lo * s], -1)
    np.testing.assert_allclose(T.rope(xh[..., perm], pos, base), yh[..., perm], atol=1e-13)


def test_attention_vs_naive_loops_and_gqa_equals_repeated_heads():
    r = rng0(23)
    q, k, v = r.standard_normal((5, 4, 3)), r.standard_normal((5, 2, 3)), r.standard_normal((5, 2, 3))
    out = T.attention(q, k, v)
    for t in range(5):
        for h in range(4):
            kv = h // 2
            s = [math.fsum(q[t, h] * k[j, kv]) / math.sqrt(3) for j in range(t + 1)]
            e = [math.exp(si - max(s)) for si in s]
            o = [math.fsum(e[j] * v[j, kv, d] for j in range(t + 1)) / math.fsum(e) for d in range(3)]
            np.testing.assert_allclose(out[t, h], o, rtol=1e-13, atol=1e-14)
    rep = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)     # HF repeat_kv order
    np.testing.assert_allclose(T.attention(q, *rep), out, rtol=1e-14, atol=1e-15)


def test_kl_and_tmkl_vs_explicit_removal():
    r = rng0(24)
    a, b = r.standard_normal((4, 6)) * 2, r.standard_normal((4, 6)) * 2
    sm = lambda z: np.exp(z - z.max()) / np.exp(z - z.max()).sum()  # noqa: E731
    kl_rows = [sum(pi * math.log(pi / qi) for pi, qi in zip(sm(a[i]), sm(b[i]))) for i in range(4)]
    np.testing.assert_allclose(T.kl(a, b)[1], kl_rows, rtol=1e-12)
    assert abs(float(T.kl(a, a)[0])) < 1e-15 and np.all(T.kl(a, b)[1] > 0)
    lab = np.array([3, -100, 0, 5])
    want = []
    for i in (0, 2, 3):
        p, q = sm(np.delete(a[i], lab[i])), sm(np.delete(b[i], lab[i]))
        want.append(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)))
    loss, rows = T.tmkl(a, b, lab)
    np.testing.assert_allclose(float(loss), np.mean(want), rtol=1e-12)
    assert rows[1] == 0.0
    # only the target logit differs: TMKL is exactly zero
    b2 = a.copy()
    b2[0, 3] += 5.0
    assert float(T.tmkl(a[:1], b2[:1], lab[:1])[0]) < 1e-15


def _adamw_torch_style(p, g, m, v, t, lr, b1, b2, eps, wd):
    """Scalar loop written the way torch.optim.AdamW (foreach=False) computes it."""
    p, m, v = p.copy(), m.copy(), v.copy()
    for i in range(p.size):
        p.flat[i] *= 1 - lr * wd
        m.flat[i] = m.flat[i] * b1 + g.flat[i] * (1 - b1)
        v.flat[i] = v.flat[i] * b2 + g.flat[i] * g.flat[i] * (1 - b2)
        denom = math.sqrt(v.flat[i]) / math.sqrt(1 - b2 ** t) + eps
        p.flat[i] -= (lr / (1 - b1 ** t)) * m.flat[i] / denom
    return p, m, v


def test_adamw_vs_torch_style_loop():
    r = rng0(25)
    p, m, v = r.standard_normal(20), np.zeros(20), np.zeros(20)
    pw, mw, vw = p.copy(), m.copy(), v.copy()
    for t in range(1, 6):
        g = r.standard_normal(20)
        p, m, v = T.adamw(p, g, m, v, t, 1e-2, 0.9, 0.99, 1e-8, 0.1)
        pw, mw, vw = _adamw_torch_style(pw, g, mw, vw, t, 1e-2, 0.9, 0.99, 1e-8, 0.1)
    np.testing.assert_allclose(p, pw, rtol=1e-13)
    np.testing.assert_allclose(m, mw, rtol=1e-13)
    np.testing.assert_allclose(v, vw, rtol=1e-13)
    # first step from zero moments: bias correction makes the step lr * g / (|g| + eps)
    a = load_case(_case(None, "adamw[33x17,step=1]"))
    x, g = a["in0"].astype(f64), a["in1"].astype(f64)
    np.testing.assert_allclose(a["out"], x * (1 - 1e-5) - 1e-3 * g / (np.abs(g) + 1e-8),
                               rtol=0, atol=1e-15)
    assert np.allclose(a["out_m"], 0.1 * g, rtol=1e-15) and np.allclose(a["out_v"], 0.001 * g * g, rtol=1e-15)


def test_clip_grad_norm():
    r = rng0(26)
    gs = [r.standard_normal((3, 4)), r.standard_normal(5)]
    norm = float(np.linalg.norm(np.concatenate([g.ravel() for g in gs])))
    clipped, n = T.clip_grad_norm(gs, 1.0)
    assert abs(float(n) - norm) < 1e-13
    new = float(np.linalg.norm(np.concatenate([g.ravel() for g in clipped])))
    assert abs(new - norm / (norm + 1e-6)) < 1e-12                 # torch's eps
    same, _ = T.clip_grad_norm(gs, 100.0)
    assert all(np.array_equal(a, b) for a, b in zip(same, gs))
