"""Float64 numpy references for the training ops, with closed-form gradients.

Every `*_backward(..., g)` returns the gradient of the scalar  L = sum(out * g)  with respect to
each differentiable input, where `out` is the forward's main output and `g` the upstream gradient
(same shape as `out`). Integer inputs (labels, positions) get no gradient. Sums go through
reference.exact_sum / reference.matmul (math.fsum) and exp/log/sin/cos through golden.elementary, so
results do not depend on BLAS, summation order or the CPU. numpy only; nothing from vkdsl's core is
imported. Quantization references are in reference_quant.
"""
from __future__ import annotations

import math

import numpy as np

from . import elementary as E
from .reference import exact_sum, log_softmax, matmul, softmax

IGNORE_INDEX = -100

__all__ = [
    "IGNORE_INDEX",
    "cross_entropy", "cross_entropy_backward",
    "lora_linear", "lora_linear_backward",
    "rmsnorm", "rmsnorm_backward",
    "rope", "rope_backward",
    "silu", "silu_backward", "swiglu", "swiglu_backward",
    "attention", "attention_backward",
    "kl", "kl_backward", "tmkl", "tmkl_backward",
    "dpo", "dpo_backward", "sequence_logprob", "sequence_logprob_backward",
    "adamw", "clip_grad_norm",
]


def _f64(x) -> np.ndarray:
    """Cast to a float64 ndarray (exact for float32 inputs)."""
    return np.asarray(x, dtype=np.float64)


def _mm(a, b) -> np.ndarray:
    """2-D matmul with correctly rounded sums."""
    return matmul(a, b)


# ---- masked cross-entropy ---------------------------------------------------------------

def _supervised(labels, n_classes: int) -> np.ndarray:
    """Boolean mask of supervised rows; ValueError on bad labels or none supervised."""
    labels = np.asarray(labels)
    sup = labels != IGNORE_INDEX
    bad = sup & ((labels < 0) | (labels >= n_classes))
    if bad.any():
        raise ValueError(f"labels must be -100 or in [0, {n_classes}); got {labels[bad][:5]}")
    if not sup.any():
        raise ValueError("no supervised token (every label is -100)")
    return sup


def cross_entropy(logits, labels):
    """Mean CE over supervised rows of logits (n, V) -> (loss, per-row loss, 0 where ignored)."""
    lsm = log_softmax(logits, -1)
    labels = np.asarray(labels)
    sup = _supervised(labels, lsm.shape[-1])
    rows = np.zeros(lsm.shape[0])
    rows[sup] = -lsm[sup, labels[sup]]
    loss = exact_sum(rows[sup]) / sup.sum()
    return np.asarray(loss), rows


def cross_entropy_backward(logits, labels, g):
    """d(g * mean CE)/dlogits = g * (softmax - onehot) / n_supervised on supervised rows, else 0."""
    p = softmax(logits, -1)
    labels = np.asarray(labels)
    sup = _supervised(labels, p.shape[-1])
    p[sup, labels[sup]] -= 1.0
    p[~sup] = 0.0
    return p * (float(_f64(g)) / sup.sum())


# ---------------------------------------------------------------------------------------
# LoRA linear:  y = x @ W + s * (x @ A) @ B
#   x (n, d_in), W (d_in, d_out), A (d_in, r), B (r, d_out)
# ---------------------------------------------------------------------------------------

def lora_linear(x, w, a, b, s: float) -> np.ndarray:
    """x @ W + s * (x @ A) @ B; W stored (d_in, d_out)."""
    x = _f64(x)
    return _mm(x, w) + s * _mm(_mm(x, a), b)


def lora_linear_backward(x, w, a, b, s: float, g):
    """Returns (dx, dW, dA, dB); dA contains B, so B == 0 gives dA == 0 exactly."""
    x, w, a, b, g = map(_f64, (x, w, a, b, g))
    gbt = _mm(g, b.T)                            # (n, r)
    dx = _mm(g, w.T) + s * _mm(gbt, a.T)
    dw = _mm(x.T, g)                             # outer-product sum, rank <= n
    da = s * _mm(x.T, gbt)
    db = s * _mm(_mm(x, a).T, g)
    return dx, dw, da, db


# ---- RMSNorm over the last axis:  y = x * rsqrt(mean(x^2) + eps) * w --------------------

def _rms_r(x, eps):
    """rsqrt(mean(x^2) + eps) with keepdims over the last axis."""
    return 1.0 / np.sqrt(exact_sum(x * x, -1, keepdims=True) / x.shape[-1] + eps)


def rmsnorm(x, w, eps: float = 1e-5) -> np.ndarray:
    """x * rsqrt(mean(x^2, -1) + eps) * w; x (..., d), w (d,)."""
    x, w = _f64(x), _f64(w)
    return x * _rms_r(x, eps) * w


def rmsnorm_backward(x, w, eps: float, g):
    """Returns (dx, dw): dx = r*u - r^3 * x * mean(u*x), u = g*w; dw = sum over rows of g*x*r."""
    x, w, g = _f64(x), _f64(w), _f64(g)
    r = _rms_r(x, eps)
    u = g * w
    dx = r * u - r * r * r * x * (exact_sum(u * x, -1, keepdims=True) / x.shape[-1])
    dw = exact_sum((g * x * r).reshape(-1, x.shape[-1]), 0)
    return dx, dw


# ---------------------------------------------------------------------------------------
# RoPE, GGUF/llama.cpp "normal" convention: adjacent pairs (2i, 2i+1) of each head,
# angle = pos * base^(-2i/head_dim).  x (T, H, D), pos int (T,)
# ---------------------------------------------------------------------------------------

def _rope_cos_sin(pos, d: int, base: float):
    """cos, sin of shape (T, 1, D/2)."""
    i = np.arange(d // 2, dtype=np.float64)
    theta = E.pow_pos(float(base), -2.0 * i / d)
    ang = _f64(pos)[:, None] * theta[None, :]
    return E.cos(ang)[:, None, :], E.sin(ang)[:, None, :]


def _rotate(x, c, s):
    """Rotate adjacent pairs of x by the angle whose cos/sin are c, s."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    y = np.empty_like(x)
    y[..., 0::2] = x0 * c - x1 * s
    y[..., 1::2] = x0 * s + x1 * c
    return y


def rope(x, pos, base: float = 10000.0) -> np.ndarray:
    """Rotate pairs (x[2i], x[2i+1]) of each head by pos * base^(-2i/D); x (T, H, D), pos (T,)."""
    x = _f64(x)
    if x.shape[-1] % 2:
        raise ValueError("head dim must be even")
    c, s = _rope_cos_sin(pos, x.shape[-1], base)
    return _rotate(x, c, s)


def rope_backward(x, pos, base: float, g) -> np.ndarray:
    """dx = g rotated by the negative angle (the rotation is orthogonal)."""
    g = _f64(g)
    c, s = _rope_cos_sin(pos, g.shape[-1], base)
    return _rotate(g, c, -s)


# ---- SiLU / SwiGLU ----------------------------------------------------------------------

def _sigmoid(x):
    """1 / (1 + exp(-x)) without overflow for large |x|."""
    return E.sigmoid(x)


def silu(x) -> np.ndarray:
    """x * sigmoid(x)."""
    x = _f64(x)
    return x * _sigmoid(x)


def silu_backward(x, g) -> np.ndarray:
    """g * sigmoid(x) * (1 + x * (1 - sigmoid(x)))."""
    x, g = _f64(x), _f64(g)
    sg = _sigmoid(x)
    return g * sg * (1.0 + x * (1.0 - sg))


def swiglu(gate, up) -> np.ndarray:
    """silu(gate) * up."""
    return silu(gate) * _f64(up)


def swiglu_backward(gate, up, g):
    """Returns (dgate, dup)."""
    up, g = _f64(up), _f64(g)
    return silu_backward(gate, g * up), g * silu(gate)


# ---------------------------------------------------------------------------------------
# causal self-attention, grouped-query: q (T, Hq, D), k, v (T, Hkv, D); query head h reads
# kv head h // (Hq // Hkv) (Hugging Face repeat_kv order); scale 1/sqrt(D) by default.
# ---------------------------------------------------------------------------------------

def _attn_mm(t: int):
    """The matmul for T x T attention products: correctly rounded sums up to T = 512; above, a
    sequential float64 sum over K (fsum would take minutes per case at the 2048- and 4096-token
    verify rows). Its error (<= K * 2^-53 relative, ~5e-13 at 4096) is 10^5 below any fp32 limit,
    and unlike BLAS its order of additions is fixed, so every machine writes the same bytes."""
    return _mm if t <= 512 else _ordered_mm


def _ordered_mm(a, b):
    """a @ b, accumulated over K in index order (each step one exactly rounded add, multiply)."""
    out = np.zeros((a.shape[0], b.shape[1]))
    for j in range(a.shape[1]):
        out += a[:, j, None] * b[None, j, :]
    return out


def _attn_probs(qh, kh, scale):
    """Causal softmax(q k^T * scale) for one head: (T, T), zeros above the diagonal."""
    s = _attn_mm(qh.shape[0])(qh, kh.T) * scale
    t = s.shape[0]
    s[np.triu(np.ones((t, t), dtype=bool), 1)] = -np.inf
    return softmax(s, -1)


def _attn_shapes(q, k, v):
    """Checks shapes; returns (T, Hq, Hkv, D, rep)."""
    t, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d or hq % k.shape[1]:
        raise ValueError(f"bad attention shapes q{q.shape} k{k.shape} v{v.shape}")
    return t, hq, k.shape[1], d, hq // k.shape[1]


def attention(q, k, v, scale: float | None = None) -> np.ndarray:
    """Causal GQA attention; returns (T, Hq, D)."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    t, hq, hkv, d, rep = _attn_shapes(q, k, v)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.empty_like(q)
    for h in range(hq):
        p = _attn_probs(q[:, h], k[:, h // rep], scale)
        out[:, h] = _attn_mm(t)(p, v[:, h // rep])
    return out


def attention_backward(q, k, v, g, scale: float | None = None):
    """Returns (dq, dk, dv); dk, dv sum over the query heads sharing a kv head."""
    q, k, v, g = map(_f64, (q, k, v, g))
    t, hq, hkv, d, rep = _attn_shapes(q, k, v)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    mm = _attn_mm(t)
    for h in range(hq):
        j = h // rep
        p = _attn_probs(q[:, h], k[:, j], scale)
        dp = mm(g[:, h], v[:, j].T)                                  # (T, T)
        ds = p * (dp - exact_sum(dp * p, -1, keepdims=True))         # softmax backward
        dq[:, h] = mm(ds, k[:, j]) * scale
        dk[:, j] += mm(ds.T, q[:, h]) * scale
        dv[:, j] += mm(p.T, g[:, h])
    return dq, dk, dv


# ---- KL(p || q) from logits, and target-masked KL ---------------------------------------

def _kl_rows(lp, lq):
    """Per-row KL(softmax(lp) || softmax(lq)) and what the backward needs; -inf entries allowed."""
    logp, logq = log_softmax(lp, -1), log_softmax(lq, -1)
    p, q = E.exp(logp), E.exp(logq)
    live = p > 0  # 0 * log 0 = 0; masked entries carry -inf in both rows
    diff = np.where(live, logp - np.where(live, logq, 0.0), 0.0)
    rows = exact_sum(np.where(live, p * diff, 0.0), -1)
    return rows, p, q, diff


def kl(logits_p, logits_q):
    """Mean over rows of KL(softmax(logits_p) || softmax(logits_q)) -> (mean 0-d, rows (n,))."""
    rows, *_ = _kl_rows(_f64(logits_p), _f64(logits_q))
    return np.asarray(exact_sum(rows) / rows.shape[0]), rows


def kl_backward(logits_p, logits_q, g):
    """Returns (dlogits_p, dlogits_q) = g/n * (p*(log p - log q - KL_row), q - p)."""
    rows, p, q, diff = _kl_rows(_f64(logits_p), _f64(logits_q))
    c = float(_f64(g)) / rows.shape[0]
    dlp = c * p * (diff - rows[:, None])
    dlq = c * (q - p)
    return dlp, dlq


def _tm_logits(logits, labels, sup):
    """Supervised rows of logits, each row's target logit set to -inf (removed, renormalized)."""
    lg = _f64(logits)[sup].copy()
    lg[np.arange(lg.shape[0]), np.asarray(labels)[sup]] = -np.inf
    return lg


def tmkl(adapted_logits, base_logits, labels):
    """Target-masked KL(adapted || base) over supervised rows -> (mean, rows, 0 where ignored)."""
    a = _f64(adapted_logits)
    if a.shape[-1] < 2:
        raise ValueError("TMKL needs at least 2 classes")
    sup = _supervised(labels, a.shape[-1])
    r, *_ = _kl_rows(_tm_logits(a, labels, sup), _tm_logits(base_logits, labels, sup))
    rows = np.zeros(a.shape[0])
    rows[sup] = r
    return np.asarray(exact_sum(r) / sup.sum()), rows


def tmkl_backward(adapted_logits, base_logits, labels, g):
    """Returns (d adapted_logits, d base_logits); zero on ignored rows and at the target entries."""
    a = _f64(adapted_logits)
    sup = _supervised(labels, a.shape[-1])
    r, p, q, diff = _kl_rows(_tm_logits(a, labels, sup), _tm_logits(base_logits, labels, sup))
    c = float(_f64(g)) / sup.sum()
    da, db = np.zeros_like(a), np.zeros_like(a)
    da[sup] = c * p * (diff - r[:, None])   # p == 0 at the removed target, so its grad is 0
    db[sup] = c * (q - p)
    return da, db


# ---- DPO --------------------------------------------------------------------------------

def sequence_logprob(logits, labels) -> np.ndarray:
    """Sum of token log-probs over response tokens: logits (B, T, V) aligned with labels (B, T);
    -100 = not scored."""
    lsm = log_softmax(logits, -1)
    labels = np.asarray(labels)
    m = labels != IGNORE_INDEX
    tok = np.where(m, np.take_along_axis(lsm, np.where(m, labels, 0)[..., None], -1)[..., 0], 0.0)
    return exact_sum(tok, -1)


def sequence_logprob_backward(logits, labels, g) -> np.ndarray:
    """d(sum_b g_b * logprob_b)/dlogits = g_b * (onehot - softmax) on scored tokens, else 0."""
    p = softmax(logits, -1)
    labels = np.asarray(labels)
    m = labels != IGNORE_INDEX
    onehot = np.zeros_like(p)
    np.put_along_axis(onehot, np.where(m, labels, 0)[..., None], 1.0, -1)
    return np.where(m[..., None], onehot - p, 0.0) * _f64(g)[:, None, None]


def _dpo_z(pc, pr, rc, rr, beta):
    """beta * ((pc - pr) - (rc - rr)) per pair."""
    pc, pr, rc, rr = map(_f64, (pc, pr, rc, rr))
    return beta * ((pc - pr) - (rc - rr))


def dpo(pc, pr, rc, rr, beta: float = 0.1):
    """Mean over pairs of -log sigmoid(beta*((pc-pr)-(rc-rr))); pc/pr policy chosen/rejected, rc/rr
    reference; returns (mean 0-d, per-pair (n,))."""
    rows = E.softplus(-_dpo_z(pc, pr, rc, rr, beta))   # -log sigmoid(z), stable
    return np.asarray(exact_sum(rows) / rows.shape[0]), rows


def dpo_backward(pc, pr, rc, rr, beta: float, g):
    """Returns (dpc, dpr, drc, drr); dloss/dz = sigmoid(z) - 1 = -sigmoid(-z)."""
    z = _dpo_z(pc, pr, rc, rr, beta)
    dz = -E.sigmoid(-z) * (float(_f64(g)) / z.shape[0]) * beta
    return dz, -dz, -dz, dz


# ---- optimizer pieces -------------------------------------------------------------------

def _ipow(b: float, n: int) -> float:
    """b**n by repeated multiplication (libm pow may differ in the last bit across platforms)."""
    out = 1.0
    for _ in range(n):
        out *= b
    return out


def adamw(param, grad, m, v, step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999,
          eps: float = 1e-8, weight_decay: float = 0.0):
    """One AdamW step (PyTorch semantics, step counted from 1); returns (param, m, v)."""
    if step < 1:
        raise ValueError("step counts from 1")
    p, g, m, v = map(_f64, (param, grad, m, v))
    p = p * (1.0 - lr * weight_decay)                 # decoupled decay, before the update
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    mhat = m / (1.0 - _ipow(beta1, step))
    vhat = v / (1.0 - _ipow(beta2, step))
    return p - lr * mhat / (np.sqrt(vhat) + eps), m, v


def clip_grad_norm(grads, max_norm: float, eps: float = 1e-6):
    """Global L2 clip (torch.nn.utils.clip_grad_norm_): coef = min(1, max_norm/(norm+eps)); returns
    (clipped list, norm 0-d)."""
    gs = [_f64(g) for g in grads]
    norm = math.sqrt(math.fsum(float(exact_sum(g * g)) for g in gs))
    coef = min(1.0, max_norm / (norm + eps))
    return [g * coef for g in gs], np.asarray(norm)
