"""Device kernels over packed weights (shapes in push constants, one pipeline per format and form):

    plan_qmatmul / record_qmatmul     C = X . W^T (form 'nt', forward) or C = X . W ('nn', dX)
    plan_dequant / record_dequant     W -> fp32
    plan_quantize / record_quantize   fp32 -> int4 / int4_f16 / nf4, on the device
"""
from __future__ import annotations

from dataclasses import dataclass

from vkdsl import tuning
from vkdsl.compiler import compile_glsl, kernel_source
from vkdsl.handwritten import (LVP_TILE, PushLayout, build_kernel, each_gpu_block, grid_for,
                               lvp_widths, widest)
from vkdsl.matmul import PUSH as MATMUL_PUSH
from vkdsl.matmul import fp16_variants, gpu_variant, precision_variant, texel_fits

from .formats import FORMATS, NF4_GROUP, Format, array_nbytes, check_shape, get_format

QUANT_PUSH = PushLayout("<2I", "quant_push.glsl")        # QuantPush: N, K
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


def qmatmul_variant(dev, f: Format, form: str, variant: str, vec: int, sv: int, texel: bool = False,
                    tile: tuple = tuning.DEFAULT_TILE, rows: int = 0, cols: int = 0,
                    batch: int = 1):
    """(kernel name, defines, local size, rows and columns per workgroup) of a qmatmul variant; the
    GPU variants' block follows the output's rows x cols x batch (handwritten.gpu_config)."""
    tb = int(form == "nt")
    if variant in ("gpu", "gpu16", "coop"):
        return gpu_variant(dev, variant, f"qmatmul_{form}_{f.name}", dict(f.defines, TB=tb), rows,
                           cols, batch, "qmatmul")
    if variant != "lvp":
        raise ValueError(f"unknown qmatmul variant {variant!r} (lvp, gpu, gpu16 or coop)")
    tm, tn = tile
    d = dict(f.defines, TB=tb, VEC=vec, SV=sv, TM=tm, TN=tn)
    if texel:
        d.update(TEXEL=1, QTEXEL=1)
    lx, ly, _ = LVP_TILE["LOCAL"]
    name = (f"qmatmul_{form}_{f.name}_lvp_{'t' if texel else 'v'}{vec}s{sv}"
            + (f"_{tm}x{tn}" if tuple(tile) != tuning.DEFAULT_TILE else ""))
    return name, d, LVP_TILE["LOCAL"], ly * tm, lx * tn


WORD_FORMATS = {1: "r32ui", 2: "rg32ui", 4: "rgba32ui"}


def qtexel_bindings(f: Format, defines: dict) -> dict:
    """binding -> texel format: X (1) with TEXEL, the weight's arrays (2...) with QTEXEL."""
    out = {1: "rgba32f" if defines["VEC"] == 4 else "r32f"} if defines.get("TEXEL") else {}
    if defines.get("QTEXEL"):
        out.update({2 + i: WORD_FORMATS[w] for i, w in enumerate(f.words)})
    return out


def qmatvec_variant(f: Format, texel: bool) -> tuple[str, dict]:
    """(name, defines) of the few-row kernel; texel: its weight read as uniform texel buffers (a
    vector gather on CPU drivers; X stays a storage buffer, its loads are uniform there)."""
    d = dict(f.defines, MV_ROWS=MV_ROWS, **({"QTEXEL": 1} if texel else {}))
    return f"qmatvec_{f.name}" + ("_t" if texel else ""), d


def plan_qmatmul(dev, fmt, *, M: int, N: int, K: int, form: str = "nt", batch: int = 1,
                 batch_stride_x: int | None = None, variant: str | None = None,
                 precision: str = "fp32", tile: tuple | None = None) -> QuantPlan:
    """Matmul with a quantized N x K weight W (dequantized in the shader):
    form 'nt': C (M x N) = X (M x K) . W^T;   form 'nn': C (M x K) = X (M x N) . W.
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
    variant = precision_variant(dev, precision, variant, "qmatmul")
    words = [n // (4 * w) for n, w in zip(array_nbytes(f.name, N, K), f.words)]
    if form == "nt" and batch == 1 and 0 < M <= MV_ROWS and variant == "lvp" and K % 4 == 0:
        # decode-sized inputs: a tile of 16 rows would waste most of its work on M = 1
        name, defines = qmatvec_variant(f, texel_fits(dev, *words))
        kernel = build_kernel(dev, "qmatvec.comp", name, defines, 2 + len(f.arrays), MATMUL_PUSH,
                              (MV_LOCAL, 1, 1), texels=qtexel_bindings(f, defines))
        return QuantPlan(name=name, kernel=kernel, groups=grid_for(dev, -(-N // 4), MV_LOCAL),
                         push=MATMUL_PUSH.pack(M, N, K, 0, 0, 0), fmt=f.name, N=N, K=K,
                         bytes_x=4 * M * K, bytes_c=4 * M * N, flops=2 * M * N * K)
    last = max(batch - 1, 0)
    texel = variant == "lvp" and texel_fits(dev, last * sx + rows * red, *words)
    vec = widest([red, sx], (4, 1) if texel else lvp_widths(dev))
    if variant != "lvp" or tile is None:
        tile = tuning.tile(dev, f"qmatmul:{f.name}", form, M, N, K, lambda t: qtile_fits(t, form)) \
            if variant == "lvp" else tuning.DEFAULT_TILE
    elif not qtile_fits(tile, form):
        raise ValueError(f"qmatmul {form} tile {tile} does not fit the kernel")
    name, defines, local, bm, bn = qmatmul_variant(dev, f, form, variant, vec,
                                                   4 if cols % 4 == 0 else 1, texel, tile, rows,
                                                   cols, batch)
    kernel = build_kernel(dev, "qmatmul.comp", name, defines, 2 + len(f.arrays), MATMUL_PUSH, local,
                          coopmat=variant == "coop", texels=qtexel_bindings(f, defines))
    groups = (-(-cols // bn), -(-rows // bm), batch) if min(rows, batch) > 0 else (0, 0, 0)
    return QuantPlan(name=name, kernel=kernel, groups=groups,
                     push=MATMUL_PUSH.pack(rows, cols, red, sx, 0, sc), fmt=f.name, N=N, K=K,
                     bytes_x=4 * (last * sx + rows * red), bytes_c=4 * (last * sc + rows * cols),
                     flops=2 * rows * cols * red * batch)


def _check_arrays(plan: QuantPlan, qbuffers):
    want = array_nbytes(plan.fmt, plan.N, plan.K)
    if len(qbuffers) != len(want):
        raise ValueError(f"{plan.name}: {plan.fmt} takes {len(want)} arrays "
                         f"({', '.join(get_format(plan.fmt).arrays)}), got {len(qbuffers)}")
    for name, b, n in zip(get_format(plan.fmt).arrays, qbuffers, want):
        if b.nbytes < n:
            raise ValueError(f"{plan.name}: array {name} holds {b.nbytes} bytes, the weight "
                             f"needs {n}")


def record_qmatmul(rec, plan: QuantPlan, C, X, *qbuffers):
    _check_arrays(plan, qbuffers)
    for what, buf, need in (("C", C, plan.bytes_c), ("X", X, plan.bytes_x)):
        if buf.nbytes < need:
            raise ValueError(f"{plan.name}: buffer {what} holds {buf.nbytes} bytes, the plan "
                             f"needs {need}")
    rec.dispatch(plan.kernel, [C, X, *qbuffers], plan.groups, plan.push, writes=[0])


def plan_dequant(dev, fmt, *, N: int, K: int) -> QuantPlan:
    f = get_format(fmt)
    check_shape(f, N, K)
    kernel = build_kernel(dev, "quant_dequant.comp", f"dequant_{f.name}", f.defines,
                          1 + len(f.arrays), QUANT_PUSH, (64, 1, 1))
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
        k = build_kernel(dev, "quant_pack_int4.comp", f"quantize_{f.name}",
                         {"INT4_F16": f.defines["INT4_F16"]}, 3, QUANT_PUSH, (64, 1, 1))
        return QuantPlan(name=f"quantize_{f.name}", kernel=k, groups=grid_for(dev, items),
                         push=push, fmt=f.name, N=N, K=K)
    if f.name == "nf4":
        k1 = build_kernel(dev, "quant_pack_nf4.comp", "quantize_nf4_blocks", {"PASS": 1}, 5,
                          QUANT_PUSH, (64, 1, 1))
        k2 = build_kernel(dev, "quant_pack_nf4.comp", "quantize_nf4_scales", {"PASS": 2}, 5,
                          QUANT_PUSH, (8, 1, 1))
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



def builtin_variants(dev) -> list[str]:
    """Compile (to SPIR-V, no pipelines) every quantized-weight kernel this device can pick, for
    bundles."""
    jobs = []
    for f in FORMATS.values():
        for form in ("nt", "nn"):
            variants = []
            for _ in each_gpu_block(dev):
                variants += [qmatmul_variant(dev, f, form, v, 1, 1)
                             for v in ["gpu"] + fp16_variants(dev)
                             if v != "coop"]
            variants += [qmatmul_variant(dev, f, form, v, 1, 1) for v in fp16_variants(dev)
                         if v == "coop"]
            variants += [qmatmul_variant(dev, f, form, "lvp", vec, sv) for vec in lvp_widths(dev)
                         for sv in (4, 1)]
            variants += [qmatmul_variant(dev, f, form, "lvp", vec, sv, True) for vec in (4, 1)
                         for sv in (4, 1)]
            jobs += [("qmatmul.comp", name, d) for name, d, _, _, _ in variants]
        jobs += [("qmatvec.comp", *qmatvec_variant(f, texel)) for texel in (False, True)]
        jobs.append(("quant_dequant.comp", f"dequant_{f.name}", f.defines))
    jobs += [("quant_pack_int4.comp", "quantize_int4", {"INT4_F16": 0}),
             ("quant_pack_int4.comp", "quantize_int4_f16", {"INT4_F16": 1}),
             ("quant_pack_nf4.comp", "quantize_nf4_blocks", {"PASS": 1}),
             ("quant_pack_nf4.comp", "quantize_nf4_scales", {"PASS": 2})]
    jobs += [("quant_gather.comp", f"qgather_{f.name}", f.defines) for f in FORMATS.values()]
    for source, name, defines in jobs:
        compile_glsl(name, kernel_source(source), defines, coopmat="VARIANT_COOP" in defines)
    return [name for _, name, _ in jobs]
