"""Golden cases of the quantized formats: int4 / NF4 round trips and the GGUF block decoders,
their inputs drawn as raw block bytes (random codes, finite f16 scales of either sign)."""
from __future__ import annotations

import numpy as np

from .cases import I32, SIGNED, Case, N, U, shp


# GGUF block layouts: (bytes per 32-weight block, byte builder)
def _f16_bytes(x):
    return np.asarray(x, dtype="<f2").view(np.uint8).reshape(-1, 2)


def _q8_0(r, nb):
    d = SIGNED(r, U(r, (nb,), 1e-4, 1e-2))
    return np.concatenate([_f16_bytes(d), r.integers(0, 256, (nb, 32)).astype(np.uint8)], 1)


def _f16_weights(r, nb):
    """nb ranges of 32 halves: log-uniform magnitudes over 1e-4..5e4, subnormals and zeros."""
    w = SIGNED(r, (10.0 ** U(r, (nb * 32,), -4.0, 4.7)).astype(np.float32))
    w[::7] = 3e-6                    # subnormal in f16
    w[1::11] = 0.0
    return _f16_bytes(w).reshape(nb, 64)


def _kquant(nbytes, f16_at):
    """K-quant super-blocks: random code, scale and high-bit bytes; finite f16 scales of either
    sign at the given byte offsets (d, and dmin right after it for Q4_K / Q5_K)."""
    def make(r, nb):
        b = r.integers(0, 256, (nb, nbytes)).astype(np.uint8)
        for at in f16_at:
            k = 2 if nbytes == 210 else 4
            b[:, at:at + k] = _f16_bytes(SIGNED(r, U(r, (nb * k // 2,), 1e-3, 2e-2))).reshape(nb, k)
        return b
    return make


def _q4_0(r, nb):
    d = SIGNED(r, U(r, (nb,), 1e-4, 1e-2))
    return np.concatenate([_f16_bytes(d), r.integers(0, 256, (nb, 16)).astype(np.uint8)], 1)


def _q4_1(r, nb):
    d, m = U(r, (nb,), 1e-4, 1e-2), U(r, (nb,), -0.1, 0.1)
    return np.concatenate([_f16_bytes(d), _f16_bytes(m),
                           r.integers(0, 256, (nb, 16)).astype(np.uint8)], 1)


def quant_cases():
    out = []
    for shape in [(7, 128), (3, 320)]:
        def mk(r, s=shape):
            x = N(r, s)
            if s == (3, 320):
                x[1, 64:128] = 0.0      # an all-zero group: scale 0, codes 0
                x[2, 5] = 40.0          # an outlier dominating its group
            return [x]
        out.append(Case(f"int4_roundtrip[{shp(shape)}]", "int4_roundtrip", {"group": 64}, mk))
    for shape in [(3, 128), (257, 64)]:  # 257 blocks -> 2 double-quant blocks, the last partial
        out.append(Case(f"nf4_roundtrip[{shp(shape)}]", "nf4_roundtrip",
                        {"block": 64, "scale_block": 256}, lambda r, s=shape: [N(r, s)]))
    for op, fn in [("dequant_q8_0", _q8_0), ("dequant_q4_0", _q4_0), ("dequant_q4_1", _q4_1),
                   ("dequant_f16", _f16_weights)]:
        for rows, cols in [(1, 32), (3, 64), (7, 576)]:
            out.append(Case(f"{op}[{rows}x{cols}]", op, {"shape": [rows, cols]},
                            lambda r, f=fn, n=rows * cols // 32: [f(r, n).ravel()]))
    for op, fn in [("dequant_q4_k", _kquant(144, (0,))), ("dequant_q5_k", _kquant(176, (0,))),
                   ("dequant_q6_k", _kquant(210, (208,)))]:
        for rows, cols in [(1, 256), (3, 512)]:
            out.append(Case(f"{op}[{rows}x{cols}]", op, {"shape": [rows, cols]},
                            lambda r, f=fn, n=rows * cols // 256: [f(r, n).ravel()]))
    # embedding lookups: 1..3 ids leave most of a 16-byte ids buffer unused, which a kernel that
    # sized its loop by the binding wrote rows for, past its output (SwiftShader's heap, 2026-12)
    for fmt, fn, (rows, cols), ids in [("q8_0", _q8_0, (7, 32), [5]),
                                       ("q8_0", _q8_0, (9, 576), [2, 8, 0]),
                                       ("q4_1", _q4_1, (5, 64), [4, 4]),
                                       ("q4_0", _q4_0, (11, 96), [0, 10, 3, 7, 7, 1])]:
        out.append(Case(f"qgather[{fmt},{rows}x{cols},n={len(ids)}]", "qgather",
                        {"fmt": fmt, "shape": [rows, cols]},
                        lambda r, f=fn, n=rows * cols // 32, i=ids: [f(r, n).ravel(), I32(i)]))
    # LoRA on a packed weight (the adapter's term fused into the product, forward and input
    # gradient): x (M, K), W's bytes (N, K), A (K, r), B (r, N); ragged tiles, ranks 4 to 12
    for fmt, fn, (m, n, k, rank), s in [("q8_0", _q8_0, (37, 96, 64, 8), 2.0),
                                        ("q4_0", _q4_0, (9, 44, 128, 4), 0.5),
                                        ("q4_1", _q4_1, (21, 40, 96, 8), 2.0),
                                        ("q4_k", _kquant(144, (0,)), (33, 64, 256, 12), 2.0)]:
        out.append(Case(f"qlora_linear[{fmt},{m}x{n}x{k},r={rank}]", "qlora_linear",
                        {"fmt": fmt, "shape": [n, k], "s": s},
                        lambda r, f=fn, m=m, n=n, k=k, q=rank,
                        nb=n * k // (256 if fmt == "q4_k" else 32): [
                            N(r, (m, k)), f(r, nb).ravel(), N(r, (k, q), 0.1),
                            N(r, (q, n), 0.1)], (m, n)))
    # every packed format a model file keeps, without an adapter: x W^T and its input gradient
    # g W, at one row (the matrix-vector kernel a decode step runs) and at 19 (the tiled one)
    for fmt, fn, block in [("f16", _f16_weights, 32), ("q8_0", _q8_0, 32), ("q4_0", _q4_0, 32),
                           ("q4_1", _q4_1, 32), ("q4_k", _kquant(144, (0,)), 256),
                           ("q5_k", _kquant(176, (0,)), 256), ("q6_k", _kquant(210, (208,)), 256)]:
        n, k = 36, 2 * block
        for m in (1, 19):
            out.append(Case(f"qlinear[{fmt},{m}x{n}x{k}]", "qlinear", {"fmt": fmt, "shape": [n, k]},
                            lambda r, f=fn, m=m, n=n, k=k, b=block: [N(r, (m, k)),
                                                                     f(r, n * k // b).ravel()],
                            (m, n)))
    # the formats vkdsl packs on load (--quant int4 / nf4), as the references lay them out: random
    # 4-bit codes two a byte; int4 scales per 64 weights; NF4's int8 block absmaxes (as int32),
    # one double-quantization scale for up to 256 blocks and the offset. Plain and with LoRA.
    n, k = 36, 128
    for fmt, arrays in [("int4", _int4_arrays), ("nf4", _nf4_arrays)]:
        for m in (1, 19):
            out.append(Case(f"qlinear[{fmt},{m}x{n}x{k}]", "qlinear", {"fmt": fmt, "shape": [n, k]},
                            lambda r, f=arrays, m=m, n=n, k=k: [N(r, (m, k)), *f(r, n, k)],
                            (m, n)))
    for fmt, arrays, (m, n, k, rank), s in [("int4", _int4_arrays, (19, 40, 128, 8), 2.0),
                                            ("nf4", _nf4_arrays, (25, 36, 192, 4), 0.5)]:
        out.append(Case(f"qlora_linear[{fmt},{m}x{n}x{k},r={rank}]", "qlora_linear",
                        {"fmt": fmt, "shape": [n, k], "s": s},
                        lambda r, f=arrays, m=m, n=n, k=k, q=rank: [
                            N(r, (m, k)), *f(r, n, k), N(r, (k, q), 0.1), N(r, (q, n), 0.1)],
                        (m, n)))
    return out


def _int4_arrays(r, n, k):
    return [r.integers(0, 256, (n, k // 2)).astype(np.uint8), U(r, (n, k // 64), 1e-3, 2e-2)]


def _nf4_arrays(r, n, k):
    return [r.integers(0, 256, (n, k // 2)).astype(np.uint8),
            r.integers(-127, 128, (n * k // 64,)).astype(np.int32), U(r, (1,), 1e-4, 1e-3),
            U(r, (1,), 0.2, 0.3)]
