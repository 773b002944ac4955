"""Op benchmarks: each op traced into one program and timed on the device beside a numpy
implementation of the same computation in the same process. Not timed tests: nothing asserts a
speed. ratio = device_ms / numpy_ms (> 1: the device is slower than numpy on these cores).

bench_ops():   LoRA linear, softmax + masked CE, Q4_1 matmul (and the device's fp32 matmul of the
               same shape), GQA attention; forward, and forward + backward.
bench_quant(): int4 / int4_f16 / NF4 on Gaussian matrices: stored bytes vs fp32, and the relative
               Frobenius error of the device round trip (device quantize, device dequantize).
"""
from __future__ import annotations

import math
import time

import numpy as np

import vkdsl
from . import quant
from vkdsl.autograd import grad
from vkdsl.verify import nmse

from . import attention, losses
from .lora import LoRA, lora_linear
from .quant import packed_arrays, qlinear, roundtrip


def _program(fn, arrays):
    """fn traced for these inputs and run once: (program, its outputs)."""
    prog = vkdsl.trace(fn).program(*arrays)
    return prog, prog.run(list(arrays))


def _interleaved(fns, rounds=4, reps=2):
    """Best wall time of each callable, measured in alternating rounds so that each sees the same
    machine load (the cores are shared between the device driver, numpy and anything else)."""
    best = dict.fromkeys(fns, float("inf"))
    for f in fns.values():
        f()                                                  # warm-up
    for _ in range(rounds):
        for k, f in fns.items():
            for _ in range(reps):
                t = time.perf_counter()
                f()
                best[k] = min(best[k], time.perf_counter() - t)
    return best


def _nmse(outs, refs):
    """NMSE of the device outputs against the numpy ones, all outputs together: a benchmark of a
    wrong result is no benchmark."""
    refs = refs if isinstance(refs, (tuple, list)) else [refs]
    flat = lambda xs: np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in xs])
    return nmse(flat(outs), flat(refs))


def _row(name, fn, arrays, np_fn, fp32=None):
    """The traced fn replayed (inputs already uploaded: the kernels alone) against np_fn. fp32: an
    optional (fn, arrays) timed alongside, reported as fp32_device_ms and quant_over_fp32."""
    progs = {"device": _program(fn, arrays)}
    if fp32 is not None:
        progs["fp32"] = _program(*fp32)
    best = _interleaved({**{k: p.recording.submit_wait for k, (p, _) in progs.items()},
                         "numpy": np_fn})
    row = {"name": name, "device_ms": best["device"] * 1e3, "numpy_ms": best["numpy"] * 1e3,
           "ratio": best["device"] / best["numpy"],
           "nmse_vs_numpy": _nmse(progs["device"][1], np_fn())}
    if fp32 is not None:
        row.update(fp32_device_ms=best["fp32"] * 1e3, quant_over_fp32=best["device"] / best["fp32"])
    for p, _ in progs.values():
        p.release()
    return row


# ---- numpy references (float32, as a numpy training step would run) ---------------------------

def _np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_ce(z, labels, backward):
    sup = labels != losses.IGNORE
    m = z.max(-1, keepdims=True)
    lse = np.log(np.exp(z - m).sum(-1, keepdims=True)) + m
    picked = np.take_along_axis(z, np.where(sup, labels, 0)[:, None], -1)
    loss = float(((lse - picked)[:, 0] * sup).sum() / sup.sum())
    if not backward:
        return loss
    dz = np.exp(z - lse)
    dz[np.arange(len(labels))[sup], labels[sup]] -= 1.0
    return loss, dz * (sup / sup.sum())[:, None].astype(np.float32)


def _np_attention(q, k, v, g=None):
    """Causal GQA, q (T, Hq, D), k, v (T, Hkv, D); with g = dO also (dq, dk, dv)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    rep = Hq // Hkv
    qh, kh, vh = (q.transpose(1, 0, 2), np.repeat(k.transpose(1, 0, 2), rep, 0),
                  np.repeat(v.transpose(1, 0, 2), rep, 0))
    s = qh @ kh.transpose(0, 2, 1) / np.float32(math.sqrt(D))
    s += np.triu(np.full((T, T), -np.inf, np.float32), 1)
    p = _np_softmax(s)
    o = (p @ vh).transpose(1, 0, 2)
    if g is None:
        return o
    gh = g.transpose(1, 0, 2)
    dv = p.transpose(0, 2, 1) @ gh
    dp = gh @ vh.transpose(0, 2, 1)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.float32(math.sqrt(D))
    dq, dk = ds @ kh, ds.transpose(0, 2, 1) @ qh
    fold = lambda a: a.reshape(Hkv, rep, T, D).sum(1).transpose(1, 0, 2)
    return o, dq.transpose(1, 0, 2), fold(dk), fold(dv)


# ---- the benchmarks ----------------------------------------------------------------------------

def bench_lora(n=4096, d=576, r=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d), dtype=np.float32)
    W = (rng.standard_normal((d, d), dtype=np.float32) / np.float32(math.sqrt(d)))
    g = rng.standard_normal((n, d), dtype=np.float32)
    lora = LoRA.init(d, d, r, alpha=2.0 * r, seed=seed)
    lora.B.assign(vkdsl.tensor(rng.standard_normal((r, d), dtype=np.float32) * np.float32(0.01)))
    A, B, s = lora.A.numpy(), lora.B.numpy(), np.float32(lora.scale)
    Wt = vkdsl.tensor(W)
    xt = vkdsl.tensor(x, requires_grad=True)

    def fwd(xi):
        return lora_linear(xi, Wt, lora)

    def fwd_bwd(gi):
        y = lora_linear(xt, Wt, lora)
        return [y, *grad(y, [xt, lora.A, lora.B], upstream=gi)]

    def np_fwd():
        return x @ W + s * ((x @ A) @ B)

    def np_fwd_bwd():
        xa = x @ A
        y = x @ W + s * (xa @ B)
        gb = g @ B.T                                          # (n, r)
        return y, g @ W.T + s * (gb @ A.T), s * (x.T @ gb), s * (xa.T @ g)
    name = f"lora_linear {n}x{d}->{d} r={r}"
    return [_row(name + " fwd", fwd, (x,), np_fwd),
            _row(name + " fwd+bwd (dx, dA, dB)", fwd_bwd, (g,), np_fwd_bwd)]


def bench_ce(rows=256, vocab=49152, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((rows, vocab), dtype=np.float32) * np.float32(3)
    labels = rng.integers(0, vocab, rows).astype(np.int32)
    labels[::4] = losses.IGNORE  # a quarter unsupervised (prompt tokens)

    def fwd(zi, li):
        return losses.cross_entropy(zi, li)[0]

    def fwd_bwd(zi, li):
        zi.requires_grad = True  # the traced input placeholder: differentiate w.r.t. it
        loss = losses.cross_entropy(zi, li)[0]
        return [loss, grad(loss, [zi])[0]]
    name = f"softmax+masked CE {rows}x{vocab}"
    return [_row(name + " fwd", fwd, (z, labels), lambda: _np_ce(z, labels, False)),
            _row(name + " fwd+bwd (dlogits)", fwd_bwd, (z, labels),
                 lambda: _np_ce(z, labels, True))]


def bench_qmatmul(M=256, K=576, N=1536, fmt="q4_1", seed=0):
    """x (M, K) . W^T with W (N, K) in a GGUF block format, dequantized inside the shader, beside
    the device's fp32 matmul of the same shape (W fp32 on the device) and numpy on the dequantized
    weight. Backward: dx = g . W (W frozen)."""
    import gguf
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K), dtype=np.float32)
    raw = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, fmt.upper()))
    qw = quant.from_gguf(raw, fmt)
    wd = qw.dequantize()  # (N, K) fp32, what the shader computes with
    x = rng.standard_normal((M, K), dtype=np.float32)
    g = rng.standard_normal((M, N), dtype=np.float32)
    arrays = packed_arrays(qw, fmt)
    Wt = vkdsl.tensor(wd)
    xt = vkdsl.tensor(x, requires_grad=True)

    def q_fwd_bwd(gi):
        y = qlinear(xt, arrays, fmt, (N, K))
        return [y, grad(y, [xt], upstream=gi)[0]]

    def f_fwd_bwd(gi):
        y = xt @ Wt.T
        return [y, grad(y, [xt], upstream=gi)[0]]
    rows = []
    for label, q_fn, f_fn, np_fn, arr in (
            ("fwd", lambda xi: qlinear(xi, arrays, fmt, (N, K)), lambda xi: xi @ Wt.T,
             lambda: x @ wd.T, x),
            ("fwd+bwd (dx)", q_fwd_bwd, f_fwd_bwd, lambda: (x @ wd.T, g @ wd), g)):
        rows.append(_row(f"{fmt} matmul {M}x{K} . ({N}x{K})^T {label}", q_fn, (arr,), np_fn,
                         fp32=(f_fn, (arr,))))
    return rows


def bench_attention(T=256, Hq=9, Hkv=3, D=64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, Hq, D), dtype=np.float32)
    k = rng.standard_normal((T, Hkv, D), dtype=np.float32)
    v = rng.standard_normal((T, Hkv, D), dtype=np.float32)
    g = rng.standard_normal((T, Hq, D), dtype=np.float32)
    qt, kt, vt = (vkdsl.tensor(a, requires_grad=True) for a in (q, k, v))

    def fwd(qi, ki, vi):
        return attention.attention(qi.reshape(1, T, Hq, D), ki.reshape(1, T, Hkv, D),
                                   vi.reshape(1, T, Hkv, D))

    def fwd_bwd(gi):
        o = attention.attention(qt.reshape(1, T, Hq, D), kt.reshape(1, T, Hkv, D),
                                vt.reshape(1, T, Hkv, D))
        return [o, *grad(o, [qt, kt, vt], upstream=gi.reshape(1, T, Hq, D))]
    name = f"attention causal T={T} Hq={Hq} Hkv={Hkv} D={D}"
    return [_row(name + " fwd", fwd, (q, k, v), lambda: _np_attention(q, k, v)),
            _row(name + " fwd+bwd (dq, dk, dv)", fwd_bwd, (g,), lambda: _np_attention(q, k, v, g))]


def bench_ops():
    return bench_lora() + bench_ce() + bench_qmatmul() + bench_attention()


def bench_quant(shapes=((1024, 1024), (576, 1536)), fmts=("int4", "int4_f16", "nf4"), seed=0):
    """Stored bytes (the device arrays, padding included) vs fp32 bytes, and the relative Frobenius
    error ||dequant(quant(W)) - W|| / ||W|| of the device round trip, W ~ N(0, 1)."""
    rows = []
    rng = np.random.default_rng(seed)
    for shape in shapes:
        w = rng.standard_normal(shape, dtype=np.float32)
        for fmt in fmts:
            out, op = roundtrip(vkdsl.tensor(w), fmt)
            deq = out.numpy()
            qw = op.packed()
            stored, fp32 = qw.device_bytes, w.nbytes
            rel = float(np.linalg.norm((deq.astype(np.float64) - w))
                        / np.linalg.norm(w.astype(np.float64)))
            rows.append({"fmt": fmt, "shape": "x".join(map(str, shape)), "stored_bytes": stored,
                         "format_bytes": qw.format_bytes, "fp32_bytes": fp32,
                         "ratio": stored / fp32, "bits_per_weight": 8 * stored / w.size,
                         "rel_frobenius_error": rel})
    return rows


if __name__ == "__main__":
    # python -m vkdsl.ops.bench [ops|quant]
    import json
    import sys
    what = sys.argv[1] if len(sys.argv) > 1 else "ops"
    for row in (bench_ops() if what == "ops" else bench_quant()):
        print(json.dumps(row), flush=True)
