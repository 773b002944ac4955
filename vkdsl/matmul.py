"""fp32 matmul kernels: plan once per shape (a pipeline and push constants), record as often as needed.

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

Kernel names are systematic: matmul_{nn,nt,tn,tt}_{lvp,gpu}[_v{VEC}s{SV}]. Both variants are
correct on every device; `variant=` overrides the choice (tests run `gpu` on lavapipe too).
"""
from __future__ import annotations

from dataclasses import dataclass

from .compiler import compile_glsl, kernel_source
from .handwritten import LVP_TILE, PushLayout, build_kernel, default_variant, gpu_config, lvp_widths, widest

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


def variant_defines(dev, variant: str, ta: bool, tb: bool, M: int, N: int, K: int,
                    stride_a: int, stride_b: int, stride_c: int):
    """(kernel name, defines, local size, rows and columns per workgroup) of one variant."""
    form = FORMS[(bool(ta), bool(tb))]
    base = {"TA": int(ta), "TB": int(tb)}
    if variant == "gpu":
        cfg = gpu_config(dev)
        d = dict(base, VARIANT_GPU=1, VEC=1, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], TM=cfg["TM"], TN=cfg["TN"])
        return f"matmul_{form}_gpu{cfg['BM']}", d, cfg["LOCAL"], cfg["BM"], cfg["BN"]
    if variant != "lvp":
        raise ValueError(f"unknown matmul variant {variant!r} (lvp or gpu)")
    # the contiguous dimension of each stored operand, and the batch strides, must be multiples of VEC
    contiguous = [M if ta else K, K if tb else N, stride_a, stride_b]
    vec = widest(contiguous, lvp_widths(dev))
    sv = 4 if N % 4 == 0 and stride_c % 4 == 0 else 1
    return lvp_defines(ta, tb, vec, sv)


def lvp_defines(ta: bool, tb: bool, vec: int, sv: int):
    t = LVP_TILE
    d = {"TA": int(ta), "TB": int(tb), "VEC": vec, "SV": sv, "TM": t["TM"], "TN": t["TN"]}
    lx, ly, _ = t["LOCAL"]
    return f"matmul_{FORMS[(bool(ta), bool(tb))]}_lvp_v{vec}s{sv}", d, t["LOCAL"], ly * t["TM"], lx * t["TN"]


def plan_matmul(dev, *, M: int, N: int, K: int, batch: int = 1, ta: bool = False, tb: bool = False,
                batch_stride_a: int | None = None, batch_stride_b: int | None = None,
                variant: str | None = None) -> MatmulPlan:
    """C[b] (M x N) = op(A[b]) . op(B[b]); op transposes when ta / tb (A stored K x M, B stored N x K).
    Batch strides are in elements; None means dense (M*K, K*N), 0 broadcasts one matrix."""
    M, N, K, batch = int(M), int(N), int(K), int(batch)
    if min(M, N, K, batch) < 0:
        raise ValueError(f"negative matmul size M={M} N={N} K={K} batch={batch}")
    sa = M * K if batch_stride_a is None else int(batch_stride_a)
    sb = K * N if batch_stride_b is None else int(batch_stride_b)
    sc = M * N
    variant = variant or default_variant(dev)
    name, defines, local, bm, bn = variant_defines(dev, variant, ta, tb, M, N, K, sa, sb, sc)
    push = PUSH.pack(M, N, K, sa, sb, sc)
    groups = (-(-N // bn), -(-M // bm), batch)
    if min(M, N, batch) == 0:
        groups = (0, 0, 0)      # nothing to write; the runtime skips empty dispatches
    if max(groups) > 0 and any(g > lim for g, lim in zip(groups, dev.limits.max_workgroup_count)):
        raise ValueError(f"matmul {M}x{N}x{K} batch {batch}: {groups} workgroups exceed the device limit")
    last = max(batch - 1, 0)
    return MatmulPlan(name=name, kernel=build_kernel(dev, "matmul.comp", name, defines, 3, PUSH, local), groups=groups, push=push,
                      M=M, N=N, K=K, batch=batch, ta=bool(ta), tb=bool(tb),
                      bytes_a=4 * (last * sa + M * K), bytes_b=4 * (last * sb + K * N),
                      bytes_c=4 * (last * sc + M * N))


def record_matmul(rec, plan: MatmulPlan, C, A, B):
    """Record C = op(A) . op(B) into a Recording. The shader trusts the plan's sizes, so buffers
    smaller than the plan needs are refused here."""
    for what, buf, need in (("C", C, plan.bytes_c), ("A", A, plan.bytes_a), ("B", B, plan.bytes_b)):
        if buf.nbytes < need:
            raise ValueError(f"{plan.name}: buffer {what} holds {buf.nbytes} bytes, the plan needs {need}")
    rec.dispatch(plan.kernel, [C, A, B], plan.groups, plan.push, writes=[0])


def builtin_variants(dev) -> list[str]:
    """Compile (to SPIR-V, no pipelines) every matmul variant this device can pick, for bundles."""
    names = []
    for ta, tb in FORMS:
        variants = [lvp_defines(ta, tb, vec, sv) for vec in lvp_widths(dev) for sv in (4, 1)]
        variants.append(variant_defines(dev, "gpu", ta, tb, 1, 1, 1, 0, 0, 0))
        for name, d, _, _, _ in variants:
            compile_glsl(name, kernel_source("matmul.comp"), d)
            names.append(name)
    return names


def bench(sizes=(256, 512, 1024, 2048), forms=("nn", "nt", "tn"), variant=None, rounds=3, dev=None):
    """GFLOP/s of C = op(A) . op(B) (n x n x n) beside numpy in the same process: best of `rounds`
    rounds of 5 submits (3 at n >= 2048), alternating device and numpy so both see the same load."""
    import time

    import numpy as np

    from .runtime import Buffer, Recording, default_device
    dev = dev or default_device()
    rng = np.random.default_rng(0)
    rows = []
    for form in forms:
        ta, tb = form[0] == "t", form[1] == "t"
        for n in sizes:
            a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
            p = plan_matmul(dev, M=n, N=n, K=n, ta=ta, tb=tb, variant=variant)
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
            rows.append({"kernel": p.name, "form": form, "n": n, "device_gflops": p.flops / best_dev / 1e9,
                         "numpy_gflops": p.flops / best_np / 1e9})
    return rows


if __name__ == "__main__":
    # python -m vkdsl.matmul [sizes] [forms] [variant]   e.g. python -m vkdsl.matmul 1024 nn,nt lvp
    import sys
    args = sys.argv[1:]
    sizes = tuple(int(s) for s in args[0].split(",")) if args else (256, 512, 1024, 2048)
    forms = tuple(args[1].split(",")) if len(args) > 1 else ("nn", "nt", "tn")
    for r in bench(sizes, forms, args[2] if len(args) > 2 else None):
        print(f"{r['kernel']:22s} {r['n']:5d}^3  {r['device_gflops']:6.1f} GFLOP/s   numpy {r['numpy_gflops']:6.1f}",
              flush=True)
