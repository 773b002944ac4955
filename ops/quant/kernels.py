"""Device kernels over packed weights (shapes in push constants, one pipeline per format and form):

    plan_qmatmul / record_qmatmul     C = X . W^T (form 'nt', forward) or C = X . W ('nn', dX),
                                      with a LoRA layer's low-rank term fused in (lora_rank > 0)
    plan_dequant / record_dequant     W -> fp32
    plan_quantize / record_quantize   fp32 -> int4 / int4_f16 / nf4, on the device
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from vkdsl import tuning
from vkdsl.handwritten import (DEFAULT_TILE, KernelVariant, PushLayout, grid_for, lvp_variant,
                               lvp_widths, texel_fits, variant_family, widest)
from vkdsl.matmul import PUSH as MATMUL_PUSH
from vkdsl.matmul import gpu_variant, precision_variant, tiled_variants

from .formats import FORMATS, NF4_GROUP, Format, array_nbytes, check_shape, get_format

QUANT_PUSH = PushLayout("<2I", "quant_push.glsl")        # QuantPush: N, K
LORA_PUSH = PushLayout("<6IIf", "matmul_lora.glsl")      # MatmulPush, rank, scale
MV_ROWS = 4          # up to this many rows of X use the matrix-vector kernel (qmatvec.comp)
# its workgroup: small, so a 576-column matrix is 9 workgroups for the driver's threads
MV_LOCAL = 16


@dataclass(frozen=True)
class QuantPlan:
    name: str
    kernel: object
    groups: tuple
    push: bytes
    fmt: str
    N: int
    K: int
    bytes_x: int = 0             # qmatmul: smallest X and C buffers
    bytes_c: int = 0
    bytes_lora: tuple = ()       # fused LoRA: smallest U and V buffers
    flops: int = 0
    kernel2: object = None       # nf4 quantize: the second pass
    groups2: tuple = ()
    scratch_bytes: int = 0

    @property
    def dispatches(self) -> int:
        """Dispatches (descriptor sets) the plan records: size Recording(dev, n_sets) with it."""
        return 2 if self.kernel2 is not None else 1


def qtile_fits(tile: tuple, form: str) -> bool:
    """Whether qmatmul_lvp.glsl takes this (rows, columns) tile: nn dequantizes 32-weight ranges
    across an invocation's columns, so it needs exactly 32 of them."""
    return tile[1] % 4 == 0 and (form == "nt" or tile[1] == 32)


WORD_FORMATS = {1: "r32ui", 2: "rg32ui", 4: "rgba32ui"}


def weight_texels(f: Format) -> dict:
    """binding -> texel format of a packed weight's arrays (bindings 2...)."""
    return {2 + i: WORD_FORMATS[w] for i, w in enumerate(f.words)}


def qmatmul_variant(dev, f: Format, form: str, variant: str, vec: int, sv: int, texel: bool = False,
                    tile: tuple = DEFAULT_TILE, rows: int = 0, cols: int = 0,
                    batch: int = 1, lora: bool = False) -> KernelVariant:
    """A qmatmul variant; texel (lvp): X and the weight's arrays read as texel buffers; the GPU
    variants' block follows the output's rows x cols x batch (handwritten.gpu_config); lora: with
    the low-rank term (matmul_lora.glsl), its U and V bound after the weight's arrays."""
    base = dict(f.defines, TB=int(form == "nt"))
    if lora:
        base.update(LORA=1, LORA_BIND=2 + len(f.arrays))
    prefix = f"qmatmul_{form}_{f.name}" + ("_lora" if lora else "")
    if variant in ("gpu", "gpu16", "coop"):
        return gpu_variant(dev, variant, "qmatmul.comp", prefix, base, rows, cols, batch,
                           "qmatmul")
    if variant != "lvp":
        raise ValueError(f"unknown qmatmul variant {variant!r} (lvp, gpu, gpu16 or coop)")
    if not texel:
        return lvp_variant("qmatmul.comp", prefix, base, vec, sv, tile)
    texels = {1: "rgba32f" if vec == 4 else "r32f", **weight_texels(f)}
    return lvp_variant("qmatmul.comp", prefix, dict(base, QTEXEL=1), vec, sv, tile, texels)


def lora_fits(form: str, rank: int, cols: int, batch: int = 1) -> bool:
    """Whether the fused low-rank term takes this product: vec4 reads along the rank (and along
    the output's columns in form nt), one product rather than a batch of them."""
    return batch == 1 and rank > 0 and rank % 4 == 0 and (form == "nn" or cols % 4 == 0)


def qmatvec_variant(f: Format, texel: bool) -> KernelVariant:
    """The few-row kernel; texel: X and the weight read as uniform texel buffers (vector gathers
    on CPU drivers, where a storage load in a loop is a loop over the lanes)."""
    d = dict(f.defines, MV_ROWS=MV_ROWS, **({"QTEXEL": 1} if texel else {}))
    return KernelVariant("qmatvec.comp", f"qmatvec_{f.name}" + ("_t" if texel else ""), d,
                         (MV_LOCAL, 1, 1),
                         texels={1: "rgba32f", **weight_texels(f)} if texel else {})


def plan_qmatmul(dev, fmt, *, M: int, N: int, K: int, form: str = "nt", batch: int = 1,
                 batch_stride_x: int | None = None, variant: str | None = None,
                 precision: str = "fp32", tile: tuple | None = None, lora_rank: int = 0,
                 lora_scale: float = 1.0) -> QuantPlan:
    """Matmul with a quantized N x K weight W (dequantized in the shader):
    form 'nt': C (M x N) = X (M x K) . W^T;   form 'nn': C (M x K) = X (M x N) . W.
    lora_rank r > 0: plus lora_scale U V (nt, V r x N) or lora_scale U V^T (nn, V K x r), U M x r
    (matmul_lora.glsl; lora_fits says which shapes take it).
    X is fp32, batched with batch_stride_x elements (None: dense; 0: one X for every batch).
    precision fp16: X and the dequantized W rounded to fp16, fp32 sums (vkdsl.matmul.fp16_choice).
    tile: the lvp kernel's rows x columns per invocation (None: vkdsl.tuning's choice)."""
    f = get_format(fmt)
    M, N, K, batch = int(M), int(N), int(K), int(batch)
    check_shape(f, N, K)
    if form not in ("nt", "nn"):
        raise ValueError(f"qmatmul form is 'nt' (X . W^T) or 'nn' (X . W), not {form!r}")
    rows, cols, red = (M, N, K) if form == "nt" else (M, K, N)
    sx = rows * red if batch_stride_x is None else int(batch_stride_x)
    sc = rows * cols
    if lora_rank and not lora_fits(form, lora_rank, cols, batch):
        raise ValueError(f"qmatmul {form} {M}x{N}x{K}: a fused rank-{lora_rank} term needs rank "
                         f"% 4 == 0, one batch, and (nt) N % 4 == 0")
    variant = precision_variant(dev, precision, variant, "qmatmul")
    words = [n // (4 * w) for n, w in zip(array_nbytes(f.name, N, K), f.words)]
    if (form == "nt" and batch == 1 and 0 < M <= MV_ROWS and variant == "lvp" and K % 4 == 0
            and not lora_rank):
        # decode-sized inputs: a tile of 16 rows would waste most of its work on M = 1
        kv = qmatvec_variant(f, texel_fits(dev, M * K // 4, *words))
        return QuantPlan(name=kv.name, kernel=kv.build(dev, 2 + len(f.arrays), MATMUL_PUSH),
                         groups=grid_for(dev, -(-N // 4), MV_LOCAL),
                         push=MATMUL_PUSH.pack(M, N, K, 0, 0, 0), fmt=f.name, N=N, K=K,
                         bytes_x=4 * M * K, bytes_c=4 * M * N, flops=2 * M * N * K)
    last = max(batch - 1, 0)
    texel = variant == "lvp" and texel_fits(dev, last * sx + rows * red, *words)
    vec = widest([red, sx], (4, 1) if texel else lvp_widths(dev))
    if variant != "lvp" or tile is None:
        tile = tuning.tile(dev, f"qmatmul:{f.name}", form, M, N, K, lambda t: qtile_fits(t, form)) \
            if variant == "lvp" else DEFAULT_TILE
    elif not qtile_fits(tile, form):
        raise ValueError(f"qmatmul {form} tile {tile} does not fit the kernel")
    kv = qmatmul_variant(dev, f, form, variant, vec, 4 if cols % 4 == 0 else 1, texel, tile, rows,
                         cols, batch, lora=bool(lora_rank))
    push = (LORA_PUSH.pack(rows, cols, red, sx, 0, sc, lora_rank, lora_scale) if lora_rank else
            MATMUL_PUSH.pack(rows, cols, red, sx, 0, sc))
    return QuantPlan(name=kv.name,
                     kernel=kv.build(dev, 2 + len(f.arrays) + 2 * bool(lora_rank),
                                     LORA_PUSH if lora_rank else MATMUL_PUSH),
                     groups=kv.grid(dev, rows, cols, batch, f"qmatmul {form} {M}x{N}x{K}"),
                     push=push, fmt=f.name, N=N, K=K,
                     bytes_x=4 * (last * sx + rows * red), bytes_c=4 * (last * sc + rows * cols),
                     bytes_lora=(4 * rows * lora_rank, 4 * lora_rank * cols) if lora_rank else (),
                     flops=2 * rows * cols * (red + lora_rank) * batch)


def _check_arrays(plan: QuantPlan, qbuffers):
    want = array_nbytes(plan.fmt, plan.N, plan.K)
    if len(qbuffers) != len(want):
        raise ValueError(f"{plan.name}: {plan.fmt} takes {len(want)} arrays "
                         f"({', '.join(get_format(plan.fmt).arrays)}), got {len(qbuffers)}")
    for name, b, n in zip(get_format(plan.fmt).arrays, qbuffers, want):
        if b.nbytes < n:
            raise ValueError(f"{plan.name}: array {name} holds {b.nbytes} bytes, the weight "
                             f"needs {n}")


def record_qmatmul(rec, plan: QuantPlan, C, X, *qbuffers, lora: tuple = ()):
    """lora: the low-rank term's U and V buffers, for a plan made with lora_rank."""
    _check_arrays(plan, qbuffers)
    if len(lora) != len(plan.bytes_lora):
        raise ValueError(f"{plan.name}: takes {len(plan.bytes_lora)} low-rank buffers, "
                         f"got {len(lora)}")
    for what, buf, need in (("C", C, plan.bytes_c), ("X", X, plan.bytes_x),
                            *zip(("U", "V"), lora, plan.bytes_lora)):
        if buf.nbytes < need:
            raise ValueError(f"{plan.name}: buffer {what} holds {buf.nbytes} bytes, the plan "
                             f"needs {need}")
    rec.dispatch(plan.kernel, [C, X, *qbuffers, *lora], plan.groups, plan.push, writes=[0])


def dequant_variant(f: Format) -> KernelVariant:
    return KernelVariant("quant_dequant.comp", f"dequant_{f.name}", f.defines, (64, 1, 1))


def gather_variant(f: Format) -> KernelVariant:
    """Rows of a packed table dequantized as they are gathered (ops.quant.gather)."""
    return KernelVariant("quant_gather.comp", f"qgather_{f.name}", f.defines, (64, 1, 1))


# the device quantizers: int4 and int4_f16 in one pass; nf4 in two (block absmaxes, then scales)
QUANTIZERS = {
    "int4": (KernelVariant("quant_pack_int4.comp", "quantize_int4", {"INT4_F16": 0}, (64, 1, 1)),),
    "int4_f16": (KernelVariant("quant_pack_int4.comp", "quantize_int4_f16", {"INT4_F16": 1},
                               (64, 1, 1)),),
    "nf4": (KernelVariant("quant_pack_nf4.comp", "quantize_nf4_blocks", {"PASS": 1}, (64, 1, 1)),
            KernelVariant("quant_pack_nf4.comp", "quantize_nf4_scales", {"PASS": 2}, (8, 1, 1)))}


def plan_dequant(dev, fmt, *, N: int, K: int) -> QuantPlan:
    f = get_format(fmt)
    check_shape(f, N, K)
    kernel = dequant_variant(f).build(dev, 1 + len(f.arrays), QUANT_PUSH)
    return QuantPlan(name=f"dequant_{f.name}", kernel=kernel, groups=grid_for(dev, N * K // 32),
                     push=QUANT_PUSH.pack(N, K), fmt=f.name, N=N, K=K, bytes_c=4 * N * K)


def record_dequant(rec, plan: QuantPlan, W, *qbuffers):
    """W (fp32 N x K) = the dequantized weight."""
    _check_arrays(plan, qbuffers)
    if W.nbytes < plan.bytes_c:
        raise ValueError(f"{plan.name}: output holds {W.nbytes} bytes, needs {plan.bytes_c}")
    rec.dispatch(plan.kernel, [W, *qbuffers], plan.groups, plan.push, writes=[0])


def plan_quantize(dev, fmt, *, N: int, K: int) -> QuantPlan:
    """fp32 -> int4 / int4_f16 / nf4 on the device: the bytes of quantize_int4 / quantize_nf4."""
    f = get_format(fmt)
    check_shape(f, N, K)
    push = QUANT_PUSH.pack(N, K)
    groups = N * K // 64
    if f.name in ("int4", "int4_f16"):
        items = -(-groups // 2) if f.name == "int4_f16" else groups     # f16: a pair of groups each
        k = QUANTIZERS[f.name][0].build(dev, 3, QUANT_PUSH)
        return QuantPlan(name=f"quantize_{f.name}", kernel=k, groups=grid_for(dev, items),
                         push=push, fmt=f.name, N=N, K=K)
    if f.name == "nf4":
        k1, k2 = (v.build(dev, 5, QUANT_PUSH) for v in QUANTIZERS["nf4"])
        return QuantPlan(name="quantize_nf4", kernel=k1, groups=grid_for(dev, groups), push=push,
                         fmt="nf4", N=N, K=K, kernel2=k2,
                         groups2=grid_for(dev, -(-groups // NF4_GROUP), 8),
                         scratch_bytes=4 * groups)
    raise ValueError(f"no device quantizer for {f.name} (int4, int4_f16 and nf4 have one)")


def record_quantize(rec, plan: QuantPlan, W, *qbuffers, scratch=None):
    """qbuffers (the format's arrays, written) = quantize(W). nf4 needs a scratch buffer of
    plan.scratch_bytes (the fp32 block absmaxes between its two passes)."""
    _check_arrays(plan, qbuffers)
    if W.nbytes < 4 * plan.N * plan.K:
        raise ValueError(f"{plan.name}: W holds {W.nbytes} bytes, needs {4 * plan.N * plan.K}")
    n = len(qbuffers)
    if plan.kernel2 is None:
        rec.dispatch(plan.kernel, [*qbuffers, W], plan.groups, plan.push, writes=list(range(n)))
        return
    if scratch is None or scratch.nbytes < plan.scratch_bytes:
        raise ValueError(f"{plan.name}: needs a scratch buffer of {plan.scratch_bytes} bytes")
    bufs = [*qbuffers, W, scratch]
    rec.dispatch(plan.kernel, bufs, plan.groups, plan.push, writes=[2, 4])
    rec.dispatch(plan.kernel2, bufs, plan.groups2, plan.push, writes=[0, 1])



@variant_family("quantized weights")
def quant_variants(dev) -> list[KernelVariant]:
    """Every quantized-weight kernel this device can pick: qmatmul in both forms, with and without
    the fused LoRA term, the few-row kernel, dequantize and gather per format, the device
    quantizers."""
    out = []
    for f in FORMATS.values():
        for form, lora in itertools.product(("nt", "nn"), (False, True)):
            out += tiled_variants(dev, lambda var, vec, sv, texel: qmatmul_variant(
                dev, f, form, var, vec, sv, texel, lora=lora))
        out += [qmatvec_variant(f, texel) for texel in (False, True)]
        out += [dequant_variant(f), gather_variant(f)]
    return out + [v for vs in QUANTIZERS.values() for v in vs]
