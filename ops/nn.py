"""Transformer pieces as compositions of vkdsl primitives; gradients come from vkdsl.autograd."""
from __future__ import annotations

import math

import numpy as np

from vkdsl import Tensor
from vkdsl.tensor import ShapeError


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    """Stable for logits of +-1e4 and rows holding -inf (not a whole row of -inf)."""
    e = (x - x.max(axis, keepdim=True)).exp()
    return e / e.sum(axis, keepdim=True)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    z = x - x.max(axis, keepdim=True)
    return z - z.exp().sum(axis, keepdim=True).log()


def logsumexp(x: Tensor, axis: int = -1, keepdim: bool = False) -> Tensor:
    m = x.max(axis, keepdim=True)
    out = (x - m).exp().sum(axis, keepdim=True).log() + m
    return out if keepdim else out.reshape(tuple(s for i, s in enumerate(out.shape) if i != axis % x.ndim))


def sigmoid(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + (-x).exp())


def silu(x: Tensor) -> Tensor:
    return x / (1.0 + (-x).exp())


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return silu(gate) * up


def rmsnorm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis."""
    return x * ((x * x).mean(-1, keepdim=True) + eps).rsqrt() * weight


def rope_tables(positions, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape (T, head_dim/2): angle = pos * base^(-2i/head_dim), in float64."""
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.asarray(positions, np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding in the GGUF / llama.cpp layout: adjacent pairs (2i, 2i+1) of each head
    rotate together. x: (..., T, H, D); cos, sin: (T, D/2)."""
    *lead, T, H, D = x.shape
    if D % 2 or cos.shape != (T, D // 2) or sin.shape != cos.shape:
        raise ShapeError(f"rope: x {x.shape} needs cos/sin of shape ({T}, {D // 2}), got {cos.shape}, {sin.shape}")
    xp = x.reshape(*lead, T, H, D // 2, 2)
    x0, x1 = xp[..., 0], xp[..., 1]                       # (..., T, H, D/2)
    c, s = cos.reshape(T, 1, D // 2), sin.reshape(T, 1, D // 2)
    y0 = x0 * c - x1 * s
    y1 = x0 * s + x1 * c
    pad = ((0, 0),) * (len(lead) + 3)
    y = y0.reshape(*lead, T, H, D // 2, 1).pad(pad + ((0, 1),)) + \
        y1.reshape(*lead, T, H, D // 2, 1).pad(pad + ((1, 0),))
    return y.reshape(*lead, T, H, D)


def causal_mask(T: int) -> Tensor:
    """(T, T): 0 where key <= query, -inf above the diagonal."""
    q = Tensor.arange(T).reshape(T, 1)
    k = Tensor.arange(T).reshape(1, T)
    return (q < k).where(-math.inf, 0.0)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = True,
              fused: bool = True) -> Tensor:
    """Grouped-query attention (see attention_composed for the contract). fused: the streaming
    kernel (kernels/attention.comp) for the forward; its gradient is the composite's."""
    B, Tq, Hq, D = q.shape
    # The kernel gives each workgroup 64 queries of one head: with a handful of queries (decode)
    # most lanes idle, and the composed form is faster.
    if fused and Tq >= 16 and D % 4 == 0 and D <= 256 and k.ndim == 4 and k.shape[0] == B and Hq % k.shape[2] == 0 \
            and v.shape == k.shape and (not causal or Tq == k.shape[1]):
        from .attention_kernel import fused_attention
        return fused_attention(q, k, v, mask, causal)
    return attention_composed(q, k, v, mask, causal)


def attention_composed(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = True) -> Tensor:
    """Self-attention with grouped-query heads.
    q: (B, Tq, Hq, D); k, v: (B, Tk, Hkv, D), Hq a multiple of Hkv (query head h reads kv head
    h // (Hq/Hkv), as in Llama). causal (Tq == Tk): key j is visible to query i when j <= i.
    mask: optional additive (B, Tq, Tk) or (Tq, Tk) on top (e.g. a KV cache's unused slots).
    Returns (B, Tq, Hq, D)."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if k.shape != (B, Tk, Hkv, D) or v.shape != k.shape or Hq % Hkv:
        raise ShapeError(f"attention: q {q.shape}, k {k.shape}, v {v.shape}: need k, v (B, Tk, Hkv, D) "
                         f"with Hq divisible by Hkv")
    if causal and Tq != Tk:
        raise ShapeError(f"attention: a causal mask needs as many keys as queries ({Tq} vs {Tk})")
    g = Hq // Hkv
    qh = q.reshape(B, Tq, Hkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * Tq, D)  # rows: (j, t)
    kh = k.permute(0, 2, 1, 3)                                                           # (B, Hkv, Tk, D)
    vh = v.permute(0, 2, 1, 3)
    s = (qh @ kh.transpose(-1, -2)) * (1.0 / math.sqrt(D))                              # (B, Hkv, g*Tq, Tk)
    s = s.reshape(B, Hkv, g, Tq, Tk)
    if causal:
        s = s + causal_mask(Tq)
    if mask is not None:
        s = s + (mask.reshape(B, 1, 1, Tq, Tk) if mask.ndim == 3 else mask)
    p = softmax(s, -1).reshape(B, Hkv, g * Tq, Tk)
    o = p @ vh                                                                           # (B, Hkv, g*Tq, D)
    return o.reshape(B, Hkv, g, Tq, D).permute(0, 3, 1, 2, 4).reshape(B, Tq, Hq, D)


def embedding(table: Tensor, ids: Tensor) -> Tensor:
    return table.gather(ids)
