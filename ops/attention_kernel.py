"""Fused attention as a hand-written kernel (kernels/attention.comp): it earns its place in
`vkdsl bench model` (the composed version materializes (Hq, T, T) scores and spends most of a
512-token prefill in them). Its gradient recomputes the composed attention and differentiates
that, so training stays on the verified composite."""
from __future__ import annotations

import math
import struct

from vkdsl.compiler import compile_glsl, kernel_source
from vkdsl.custom import CustomOp, custom
from vkdsl.runtime import get_kernel

PUSH = "<7If"      # AttnPush in kernels/attention.comp


class FusedAttention(CustomOp):
    def __init__(self, B, Tq, Tk, Hq, Hkv, D, causal, has_mask):
        self.dims, self.causal, self.has_mask = (B, Tq, Tk, Hq, Hkv, D), causal, has_mask
        self.name = f"attention_d{D}"

    def record(self, rec, out, srcs):
        B, Tq, Tk, Hq, Hkv, D = self.dims
        k = get_kernel(rec.device, self.name, compile_glsl(self.name, kernel_source("attention.comp"), {"D": D}),
                       5, struct.calcsize(PUSH), (64, 1, 1))
        mask = srcs[3] if self.has_mask else srcs[0]      # an unused binding still needs a buffer
        groups = (-(-Tq // 64), Hq, B)          # a workgroup = 64 queries of one (batch, head)
        rec.dispatch(k, [out, srcs[0], srcs[1], srcs[2], mask], groups,
                     struct.pack(PUSH, B, Tq, Tk, Hq, Hkv, int(self.causal), int(self.has_mask),
                                 1.0 / math.sqrt(D)))

    def backward(self, node, g, q, k, v, *mask):
        from vkdsl.autograd import grad
        from .nn import attention_composed
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
