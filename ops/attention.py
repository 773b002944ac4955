"""Grouped-query attention: the composition of primitives (the contract and the reference), the
fused streaming kernels (kernels/attention.comp forward, kernels/attention_backward.comp its
gradient), and the selector between them.

The composed version materializes (B, Hq, T, T) scores and probabilities, and training keeps them
for the backward of every layer. The fused forward streams over the keys with an online softmax;
the fused backward recomputes the probabilities from q, k and each query's log-sum-exp
(FlashAttention-2 style), so neither direction ever holds a T x T tensor. On lavapipe at 4 x 256,
SmolLM2-135M's heads, forward + backward: `python -m vkdsl.ops.attention` times both."""
from __future__ import annotations

import math
import struct

from vkdsl import Tensor
from vkdsl.autograd import grad
from vkdsl.custom import CustomOp, custom
from vkdsl.handwritten import KernelVariant, has_int64, texel_reads, variant_family
from vkdsl.tensor import ShapeError

from .nn import causal_mask, softmax


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = True,
              fused: bool = True, spans: Tensor | None = None) -> Tensor:
    """Grouped-query attention (see attention_composed for the contract). fused: the streaming
    kernels, forward and backward, where they apply; else the composite. spans: (B, T, 2) int32,
    each token's row [start, end) in packed sequences (train.packing), causal self-attention only:
    a query sees the earlier keys of its own row (the fused kernels skip every other key)."""
    if spans is not None and (not causal or mask is not None or spans.shape != q.shape[:2] + (2,)):
        raise ShapeError(f"attention: spans {spans.shape} need causal self-attention "
                         f"without a mask and shape {q.shape[:2] + (2,)}")
    if fused and fused_applies(q, k, v, causal):
        return fused_attention(q, k, v, mask, causal, spans)
    if spans is not None:
        mask = spans_mask(spans)
    return attention_composed(q, k, v, mask, causal)


def spans_mask(spans: Tensor) -> Tensor:
    """(B, T, T) additive: 0 where key j >= the query's row start, else -inf (the causal mask adds
    the rest: rows are contiguous, so start <= j <= i is the row's own earlier tokens)."""
    B, T = spans.shape[:2]
    start = spans[:, :, 0].reshape(B, T, 1)
    return (Tensor.arange(T).reshape(1, 1, T) < start).where(-math.inf, 0.0)


def fused_applies(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> bool:
    """The kernels give each workgroup 64 queries (or keys) of one (batch, kv head): with a handful
    of queries (decode) most lanes idle and the composite is faster. They load 8 floats at a time
    (D % 8 == 0: as 64-bit integers with shaderInt64, else as two vec4: kernels/pack8.glsl) and keep
    G = Hq / Hkv heads of D floats in registers."""
    B, Tq, Hq, D = q.shape
    return (Tq >= 16 and D % 8 == 0 and D <= 256 and k.ndim == 4 and k.shape[0] == B
            and Hq % k.shape[2] == 0
            and Hq // k.shape[2] <= 8 and v.shape == k.shape and (not causal or Tq == k.shape[1]))


def _defines(dev, D, G, **more) -> dict:
    """The kernels' defines: head size, heads per kv head, and NO_INT64 where the device lacks
    it."""
    return {"D": D, "G": G, **more, **({} if has_int64(dev) else {"NO_INT64": 1})}


def _variant(source, name, defines, n_buffers, mask_binding, stats_binding=None,
             texel=False) -> KernelVariant:
    """One of the fused kernels, its operands read as texel buffers where that is the fast load
    (texel: kernels/attention_io.glsl), else as storage buffers."""
    if not texel:
        return KernelVariant(source, name, defines, (64, 1, 1))
    texels = {b: "rgba32f" for b in range(1, n_buffers) if b not in (mask_binding, stats_binding)}
    texels[mask_binding] = "r32ui"
    if stats_binding is not None:
        texels[stats_binding] = "r32f"
    return KernelVariant(source, name + "_t", {**defines, "TEXEL": 1}, (64, 1, 1), texels=texels)


def _kernel(dev, source, name, defines, n_buffers, dims, mask_binding, stats_binding=None):
    """Build one of the fused kernels, through texel buffers on the CPU-driver kernel family when
    its operands fit maxTexelBufferElements (handwritten.texel_reads)."""
    B, Tq, Tk, Hq, Hkv, D = dims
    # floats of q, dO, O (and the stats); of k, v; of the mask (the spans are fewer)
    sizes = (B * Tq * Hq * D, B * Tk * Hkv * D, B * Tq * max(Tk, 2))
    return _variant(source, name, defines, n_buffers, mask_binding, stats_binding,
                    texel_reads(dev, *sizes)).build(dev, n_buffers, PUSH_SIZE)


def attention_composed(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                       causal: bool = True) -> Tensor:
    """Self-attention with grouped-query heads.
    q: (B, Tq, Hq, D); k, v: (B, Tk, Hkv, D), Hq a multiple of Hkv (query head h reads kv head
    h // (Hq/Hkv), as in Llama). causal (Tq == Tk): key j is visible to query i when j <= i.
    mask: optional additive (B, Tq, Tk) or (Tq, Tk) on top (e.g. a KV cache's unused slots).
    Returns (B, Tq, Hq, D)."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if k.shape != (B, Tk, Hkv, D) or v.shape != k.shape or Hq % Hkv:
        raise ShapeError(f"attention: q {q.shape}, k {k.shape}, v {v.shape}: need k, v (B, "
                         f"Tk, Hkv, D) with Hq divisible by Hkv")
    if causal and Tq != Tk:
        raise ShapeError(f"attention: a causal mask needs as many keys as queries ({Tq} vs {Tk})")
    g = Hq // Hkv
    # rows: (j, t)
    qh = q.reshape(B, Tq, Hkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * Tq, D)
    kh = k.permute(0, 2, 1, 3)  # (B, Hkv, Tk, D)
    vh = v.permute(0, 2, 1, 3)
    s = (qh @ kh.transpose(-1, -2)) * (1.0 / math.sqrt(D))  # (B, Hkv, g*Tq, Tk)
    s = s.reshape(B, Hkv, g, Tq, Tk)
    if causal:
        s = s + causal_mask(Tq)
    if mask is not None:
        s = s + (mask.reshape(B, 1, 1, Tq, Tk) if mask.ndim == 3 else mask)
    p = softmax(s, -1).reshape(B, Hkv, g * Tq, Tk)
    o = p @ vh  # (B, Hkv, g*Tq, D)
    return o.reshape(B, Hkv, g, Tq, D).permute(0, 3, 1, 2, 4).reshape(B, Tq, Hq, D)


PUSH = "<7If"      # AttnPush in kernels/attention.comp (declared inline there)
PUSH_SIZE = struct.calcsize(PUSH)


class FusedAttention(CustomOp):
    def __init__(self, B, Tq, Tk, Hq, Hkv, D, causal, has_mask):
        """has_mask: 0 none, 1 an additive (B, Tq, Tk) mask, 2 packed rows' spans (B, T, 2)."""
        self.dims, self.causal, self.has_mask = (B, Tq, Tk, Hq, Hkv, D), causal, has_mask
        self.name = f"attention_d{D}_g{Hq // Hkv}"

    def record(self, rec, out, srcs):
        B, Tq, Tk, Hq, Hkv, D = self.dims
        k = _kernel(rec.device, "attention.comp", self.name, _defines(rec.device, D, Hq // Hkv),
                    5, self.dims, 4)
        mask = srcs[3] if self.has_mask else srcs[0]      # an unused binding still needs a buffer
        groups = (-(-Tq // 64), Hkv, B)         # a workgroup = 64 queries of one (batch, kv head)
        rec.dispatch(k, [out, srcs[0], srcs[1], srcs[2], mask], groups,
                     struct.pack(PUSH, B, Tq, Tk, Hq, Hkv, int(self.causal), int(self.has_mask),
                                 1.0 / math.sqrt(D)))

    def flops(self, node) -> int:
        B, Tq, Tk, Hq, Hkv, D = self.dims
        # QK^T and PV, half under causality
        return 4 * B * Hq * Tq * Tk * D // (2 if self.causal else 1)

    def backward(self, node, g, q, k, v, *mask):
        B, Tq, Tk, Hq, Hkv, D = self.dims
        args = (self.dims, self.causal, self.has_mask)
        stats = custom(AttentionBackward(*args, PASS_STATS), [q, k, g, node, *mask], (B, Tq, Hq, 2),
                       requires_grad=False)
        dq = custom(AttentionBackward(*args, PASS_DQ), [q, k, v, g, stats, *mask], q.shape,
                    requires_grad=False) if q.requires_grad else None
        dk = dv = None
        if k.requires_grad or v.requires_grad:
            dkv = custom(AttentionBackward(*args, PASS_DKV), [q, k, v, g, stats, *mask],
                         (2,) + k.shape, requires_grad=False)
            dk, dv = (dkv[0] if k.requires_grad else None), (dkv[1] if v.requires_grad else None)
        return (dq, dk, dv) + (None,) * len(mask)


PASS_STATS, PASS_DQ, PASS_DKV = 0, 1, 2
# which source fills each binding of kernels/attention_backward.comp (out, q, k, v, g, stats, o,
# mask)
_BINDINGS = {PASS_STATS: ("q", "k", None, "g", None, "o"),
             PASS_DQ: ("q", "k", "v", "g", "stats", None),
             PASS_DKV: ("q", "k", "v", "g", "stats", None)}


class AttentionBackward(CustomOp):
    """One pass of the fused attention backward (kernels/attention_backward.comp): stats (lse and
    dO.O per query), dq (a workgroup per 64 queries), or dk and dv packed as (2, B, Tk, Hkv, D)
    (a workgroup per 64 keys). The probabilities are recomputed in each pass, never stored."""

    def __init__(self, dims, causal, has_mask, pass_):
        self.dims, self.causal, self.has_mask, self.pass_ = dims, causal, has_mask, pass_
        self.name = f"attention_backward{pass_}_d{dims[-1]}_g{dims[3] // dims[4]}"

    def record(self, rec, out, srcs):
        B, Tq, Tk, Hq, Hkv, D = self.dims
        names = _BINDINGS[self.pass_]
        given = dict(zip([n for n in names if n], srcs))
        mask = srcs[-1] if self.has_mask else srcs[0]        # unused bindings still need a buffer
        bufs = [out] + [given.get(n, srcs[0]) if n else srcs[0] for n in names] + [mask]
        k = _kernel(rec.device, "attention_backward.comp", self.name,
                    _defines(rec.device, D, Hq // Hkv, PASS=self.pass_), 8, self.dims, 7, 5)
        groups = (-(-Tk // 128), Hkv, B) if self.pass_ == PASS_DKV else (-(-Tq // 64), Hkv, B)
        rec.dispatch(k, bufs, groups, struct.pack(PUSH, B, Tq, Tk, Hq, Hkv, int(self.causal),
                                                  int(self.has_mask), 1.0 / math.sqrt(D)))

    def flops(self, node) -> int:
        B, Tq, Tk, Hq, Hkv, D = self.dims
        pairs = B * Hq * Tq * Tk // (2 if self.causal else 1)
        return pairs * 2 * D * (1, 3, 4)[self.pass_]


def fused_attention(q, k, v, mask, causal, spans=None):
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if spans is not None:
        srcs, kind = [q, k, v, spans], 2
    elif mask is not None:
        srcs, kind = [q, k, v, mask.expand((B, Tq, Tk)) if mask.ndim == 3 else
                      mask.reshape(1, Tq, Tk).expand((B, Tq, Tk))], 1
    else:
        srcs, kind = [q, k, v], 0
    op = FusedAttention(B, Tq, Tk, Hq, Hkv, D, causal, kind)
    return custom(op, srcs, q.shape)


@variant_family("attention")
def attention_variants(dev) -> list[KernelVariant]:
    """The fused kernels for common head shapes (D 64 with 3 query heads per kv head, as
    SmolLM2-135M; D 64 without grouping), storage and texel loads."""
    out = []
    for d, g in ((64, 3), (64, 1)):
        for texel in (False, True):
            out.append(_variant("attention.comp", f"attention_d{d}_g{g}", _defines(dev, d, g), 5,
                                4, texel=texel))
            out += [_variant("attention_backward.comp", f"attention_backward{p}_d{d}_g{g}",
                             _defines(dev, d, g, PASS=p), 8, 7, 5, texel)
                    for p in (PASS_STATS, PASS_DQ, PASS_DKV)]
    return out


def _traced_steps(B, T, Hq, Hkv, D, fns) -> tuple[dict, object]:
    """({name: a traced causal forward + backward (dq, dk, dv) of fn, run once}, the upstream
    gradient it takes), on the same random q, k, v."""
    import numpy as np

    import vkdsl
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s, dtype=np.float32)
              for s in ((B, T, Hq, D), (B, T, Hkv, D), (B, T, Hkv, D))]
    g = rng.standard_normal((B, T, Hq, D), dtype=np.float32)
    steps = {}
    for name, fn in fns:
        q, k, v = (vkdsl.tensor(a, requires_grad=True) for a in arrays)

        @vkdsl.trace
        def step(up, q=q, k=k, v=v, fn=fn):
            return grad((fn(q, k, v) * up).sum(), [q, k, v])
        step(g)
        steps[name] = step
    return steps, g


def bench(B=4, T=256, Hq=9, Hkv=3, D=64, reps=5, composed=True):
    """Seconds of one forward + backward (dq, dk, dv) of causal attention, fused and composed, each
    the best of `reps` replays of its own traced program, alternating so both see the same load
    (composed=False: the fused kernels alone, for lengths whose T x T scores would not fit)."""
    import time
    fns = (("fused", attention), ("composed", attention_composed))[:2 if composed else 1]
    steps, g = _traced_steps(B, T, Hq, Hkv, D, fns)
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(reps):
        for name, step in steps.items():
            t = time.perf_counter()
            step(g)
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def bench_kernels(B=4, T=256, Hq=9, Hkv=3, D=64, reps=5) -> dict:
    """Seconds of each fused kernel of one causal forward + backward (forward, stats, dq, dkv), each
    dispatch timed alone, best of `reps`."""
    from vkdsl.bench import time_steps
    steps, g = _traced_steps(B, T, Hq, Hkv, D, [("fused", attention)])
    best = {}
    for _ in range(reps):
        for s, dt in time_steps(steps["fused"].program(g)):
            if s.kind == "custom":
                best[s.node.arg.name] = min(best.get(s.node.arg.name, float("inf")), dt)
    return best


if __name__ == "__main__":
    # python -m vkdsl.ops.attention [B T Hq Hkv D] [--fused-only | --by-kernel]
    import sys
    dims = [int(a) for a in sys.argv[1:6] if a.isdigit()] or [4, 256, 9, 3, 64]
    if "--by-kernel" in sys.argv:
        for name, secs in bench_kernels(*dims).items():
            print(f"{name:32s} {secs * 1e3:8.2f} ms")
        sys.exit(0)
    both = "--fused-only" not in sys.argv
    best = bench(*dims, reps=5 if both else 2, composed=both)
    B, T, Hq, Hkv, D = dims
    # forward 1x, backward 3.5x its flops
    rate = 4.5 * 4 * B * Hq * T * T / 2 * D / best["fused"] / 1e9
    print(f"attention forward + backward {dims}: fused {best['fused']:.3f} s (~{rate:.1f} GFLOP/s)"
          + (f", composed {best['composed']:.3f} s, ratio {best['composed'] / best['fused']:.2f}"
             if both else ""))
