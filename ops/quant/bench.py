"""qmatmul against the fp32 matmul of the same shape, interleaved so both see the same load.

    python -m vkdsl.ops.quant.bench [M,K,N] [formats] [forms]   e.g. 256,576,1536 q4_1,nf4 nt
"""
from __future__ import annotations

import time

import numpy as np

from vkdsl.matmul import plan_matmul, record_matmul
from vkdsl.runtime import Buffer, Recording, default_device

from .formats import from_gguf, get_format, quantize_int4, quantize_nf4
from .kernels import plan_qmatmul, record_qmatmul
from .linear import upload_weight


def example_weight(fmt, w):
    """A packed example of weight w in format fmt (gguf-py quantizes the GGUF formats it can)."""
    if get_format(fmt).gguf:
        import gguf
        return from_gguf(gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, fmt.upper())),
                         fmt)
    return (quantize_nf4(w) if fmt == "nf4"
            else quantize_int4(w, np.float16 if fmt == "int4_f16" else np.float32))


def bench(M=256, K=576, N=1536, fmts=("q4_1",), forms=("nt", "nn"), rounds=5, dev=None):
    """Time of qmatmul against the fp32 matmul of the same shape (nt: x . W^T with W fp32 N x K;
    nn: g . W), interleaved so both see the same machine load; best of rounds x 5 submits."""
    dev = dev or default_device()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((M, max(N, K))).astype(np.float32)
    X, W, C = Buffer(dev, x.nbytes), Buffer(dev, w.nbytes), Buffer(dev, 4 * M * max(N, K))
    X.write(x)
    W.write(w)
    rows = []
    for form in forms:
        pf = plan_matmul(dev, M=M, N=N if form == "nt" else K, K=K if form == "nt" else N,
                         tb=form == "nt")
        rf = Recording(dev, 1)
        record_matmul(rf, pf, C, X, W)
        for fmt in fmts:
            qbufs = upload_weight(dev, example_weight(fmt, w))
            pq = plan_qmatmul(dev, fmt, M=M, N=N, K=K, form=form)
            rq = Recording(dev, 1)
            record_qmatmul(rq, pq, C, X, *qbufs)
            best = {}
            for _ in range(rounds):
                for tag, rec in (("fp32", rf), ("quant", rq)):
                    rec.submit_wait()
                    for _ in range(5):
                        t = time.perf_counter()
                        rec.submit_wait()
                        best[tag] = min(best.get(tag, float("inf")), time.perf_counter() - t)
            rq.release()
            rows.append({"form": form, "fmt": fmt, "kernel": pq.name, "fp32_kernel": pf.name,
                         "quant_ms": best["quant"] * 1e3, "fp32_ms": best["fp32"] * 1e3,
                         "ratio": best["quant"] / best["fp32"],
                         "quant_gflops": pq.flops / best["quant"] / 1e9})
        rf.release()
    return rows


if __name__ == "__main__":
    import sys
    args = sys.argv[1:]
    M, K, N = (int(v) for v in args[0].split(",")) if args else (256, 576, 1536)
    fmts = tuple(args[1].split(",")) if len(args) > 1 else ("q4_1",)
    forms = tuple(args[2].split(",")) if len(args) > 2 else ("nt", "nn")
    for r in bench(M, K, N, fmts, forms):
        print(f"{r['form']} {r['fmt']:8s} M={M} K={K} N={N}: {r['kernel']} {r['quant_ms']:.2f} ms "
              f"({r['quant_gflops']:.1f} GFLOP/s), {r['fp32_kernel']} {r['fp32_ms']:.2f} ms, ratio "
              f"{r['ratio']:.2f}", flush=True)
