"""Grouped-query attention: the composition of primitives (the contract, and what training
differentiates), the fused streaming kernel for the forward (kernels/attention.comp), and the
selector between them.

The kernel earns its place in `vkdsl bench model`: the composed version materializes (Hq, T, T)
scores and spends most of a 512-token prefill in them. Its gradient recomputes the composed
attention and differentiates that, so training stays on the verified composite."""
from __future__ import annotations

import math
import struct

from vkdsl import Tensor
from vkdsl.autograd import grad
from vkdsl.compiler import compile_glsl, kernel_source
from vkdsl.custom import CustomOp, custom
from vkdsl.handwritten import build_kernel
from vkdsl.tensor import ShapeError

from .nn import causal_mask, softmax


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = True,
              fused: bool = True) -> Tensor:
    """Grouped-query attention (see attention_composed for the contract). fused: the streaming
    kernel (kernels/attention.comp) for the forward; its gradient is the composite's."""
    B, Tq, Hq, D = q.shape
    # The kernel gives each workgroup 64 queries of one head: with a handful of queries (decode)
    # most lanes idle, and the composed form is faster.
    if fused and Tq >= 16 and D % 4 == 0 and D <= 256 and k.ndim == 4 and k.shape[0] == B and Hq % k.shape[2] == 0 \
            and v.shape == k.shape and (not causal or Tq == k.shape[1]):
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


PUSH = "<7If"      # AttnPush in kernels/attention.comp (declared inline there)
PUSH_SIZE = struct.calcsize(PUSH)


class FusedAttention(CustomOp):
    def __init__(self, B, Tq, Tk, Hq, Hkv, D, causal, has_mask):
        self.dims, self.causal, self.has_mask = (B, Tq, Tk, Hq, Hkv, D), causal, has_mask
        self.name = f"attention_d{D}"

    def record(self, rec, out, srcs):
        B, Tq, Tk, Hq, Hkv, D = self.dims
        k = build_kernel(rec.device, "attention.comp", self.name, {"D": D}, 5, PUSH_SIZE, (64, 1, 1))
        mask = srcs[3] if self.has_mask else srcs[0]      # an unused binding still needs a buffer
        groups = (-(-Tq // 64), Hq, B)          # a workgroup = 64 queries of one (batch, head)
        rec.dispatch(k, [out, srcs[0], srcs[1], srcs[2], mask], groups,
                     struct.pack(PUSH, B, Tq, Tk, Hq, Hkv, int(self.causal), int(self.has_mask),
                                 1.0 / math.sqrt(D)))

    def flops(self, node) -> int:
        B, Tq, Tk, Hq, Hkv, D = self.dims
        return 4 * B * Hq * Tq * Tk * D // (2 if self.causal else 1)      # QK^T and PV, half under causality

    def backward(self, node, g, q, k, v, *mask):
        ins = [t for t in (q, k, v) if t.requires_grad]
        out = attention_composed(q, k, v, mask[0] if mask else None, self.causal)
        gs = iter(grad(out, ins, upstream=g, local=True))
        return tuple(next(gs) if t.requires_grad else None for t in (q, k, v)) + (None,) * len(mask)


def fused_attention(q, k, v, mask, causal):
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    srcs = [q, k, v] + ([mask.expand((B, Tq, Tk)) if mask.ndim == 3 else mask.reshape(1, Tq, Tk).expand((B, Tq, Tk))]
                        if mask is not None else [])
    op = FusedAttention(B, Tq, Tk, Hq, Hkv, D, causal, mask is not None)
    return custom(op, srcs, q.shape)


def builtin_variants(dev) -> list[str]:
    """Compile (to SPIR-V) the fused kernel for the head sizes of the bundled models, for bundles."""
    names = []
    for d in (64, 128):
        compile_glsl(f"attention_d{d}", kernel_source("attention.comp"), {"D": d})
        names.append(f"attention_d{d}")
    return names
