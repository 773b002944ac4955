"""Transformer pieces as compositions of vkdsl primitives; gradients come from vkdsl.autograd."""
from __future__ import annotations

import math

import numpy as np

from vkdsl import Tensor
from vkdsl.autograd import with_gradient
from vkdsl.tensor import ShapeError


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    """Stable for logits of +-1e4 and rows holding -inf (not a whole row of -inf)."""
    e = (x - x.max(axis, keepdim=True)).exp()
    return e / e.sum(axis, keepdim=True)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    z = x - x.max(axis, keepdim=True)
    return z - z.exp().sum(axis, keepdim=True).log()


def logsumexp(x: Tensor, axis: int = -1, keepdim: bool = False) -> Tensor:
    """log(sum(exp(x))) along axis. Its gradient is softmax(x) = exp(x - lse), given as the rule:
    the max only steadies the sum, and differentiating through it adds a term that is zero in
    exact arithmetic (1 - sum of the softmax) yet costs two more passes over x and a softmax kept
    for the backward (over an LM head's vocabulary, the largest tensors of a training step)."""
    m = x.max(axis, keepdim=True)
    lse = (x - m).exp().sum(axis, keepdim=True).log() + m
    out = with_gradient(lse, (x,), lambda g, x: (g * (x - lse).exp(),))
    return (out if keepdim
            else out.reshape(tuple(s for i, s in enumerate(out.shape) if i != axis % x.ndim)))


def sigmoid(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + (-x).exp())


def silu(x: Tensor) -> Tensor:
    return x / (1.0 + (-x).exp())


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up. Its backward reads gate and up only (with s = sigmoid(gate)):
    d up = g * gate * s, d gate = g * up * s * (1 + gate * (1 - s))."""
    def rule(g, gate, up):
        s = 1.0 / (1.0 + (-gate).exp())
        return (g * up * s * (1.0 + gate * (1.0 - s)) if gate.requires_grad else None,
                g * gate * s if up.requires_grad else None)
    return with_gradient(silu(gate) * up, (gate, up), rule)


def rmsnorm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis."""
    return x * ((x * x).mean(-1, keepdim=True) + eps).rsqrt() * weight


def rope_tables(positions, head_dim: int, base: float,
                divisors=None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape (T, head_dim/2): angle = pos * base^(-2i/head_dim) / divisors[i], in
    float64 (divisors: a scaled RoPE such as Llama 3's; None: plain)."""
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if divisors is not None:
        inv = inv / np.asarray(divisors, np.float64)
    ang = np.asarray(positions, np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding in the GGUF / llama.cpp layout: adjacent pairs (2i, 2i+1) of each head
    rotate together. x: (..., T, H, D); cos, sin: (T, D/2), or (..., T, D/2) when each sequence
    has its own positions (packed rows restart theirs)."""
    *lead, T, H, D = x.shape
    if D % 2 or cos.shape not in ((T, D // 2), (*lead, T, D // 2)) or sin.shape != cos.shape:
        raise ShapeError(f"rope: x {x.shape} needs cos/sin of shape ({T}, {D // 2}), got "
                         f"{cos.shape}, {sin.shape}")
    xp = x.reshape(*lead, T, H, D // 2, 2)
    x0, x1 = xp[..., 0], xp[..., 1]                       # (..., T, H, D/2)
    c, s = cos.reshape(*cos.shape[:-1], 1, D // 2), sin.reshape(*sin.shape[:-1], 1, D // 2)
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


def embedding(table: Tensor, ids: Tensor) -> Tensor:
    return table.gather(ids)
