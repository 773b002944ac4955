"""Golden cases of fp16: float16 storage (Tensor.half: reference.half) and matmul precision fp16
(inputs rounded to fp16, fp32 sums). The references round with numpy (round to nearest even) and
then sum exactly (reference.matmul_f16in, reference_quant.qmatmul_f16in)."""
from __future__ import annotations

import numpy as np

from .cases import LOGU, SIGNED, Case, N, _mm_inputs
from .cases_quant import _kquant, _q4_0, _q4_1, _q8_0


def _half_inputs(r, shape):
    """Values across fp16's range: subnormals (< 6.1e-5), ties, overflow (> 65504), inf, NaN."""
    x = SIGNED(r, LOGU(r, shape, -9, 5)).reshape(-1)
    x[:8] = [65504.0, 65520.0, 1e6, -np.inf, np.nan, 2.0 ** -24, 2.0 ** -25,
             1.0 + 2.0 ** -11][:x.size]
    return [x.reshape(shape)]


def cases() -> list[Case]:
    out = [Case(f"half[{'x'.join(map(str, s))}]", "half", {}, lambda r, s=s: _half_inputs(r, s))
           for s in [(7, 33), (33, 1024), (1023,)]]
    # ragged tiles, a long reduction (fp16 sums would show), a batch, and values near the top of
    # fp16's range (65504) whose products only fp32 holds
    for form, ta, tb in [("nn", False, False), ("nt", False, True), ("tn", True, False)]:
        for m, k, n in [(3, 7, 33), (129, 257, 95), (33, 1023, 7)]:
            out.append(Case(f"matmul_f16in[{form},{m}x{k}x{n}]", "matmul_f16in",
                            {"ta": ta, "tb": tb},
                            lambda r, m=m, k=k, n=n, ta=ta, tb=tb: _mm_inputs(r, m, k, n, ta, tb)))
    out.append(Case("matmul_f16in[nn,batch=3,33x7x5]", "matmul_f16in",
                    {"ta": False, "tb": False, "batch": True},
                    lambda r: _mm_inputs(r, 33, 7, 5, False, False, (3,))))
    out.append(Case("matmul_f16in[nn,17x64x9,mag=3e4]", "matmul_f16in", {"ta": False, "tb": False},
                    lambda r: [x * np.float32(3e4)
                               for x in _mm_inputs(r, 17, 64, 9, False, False)]))
    # a quantized weight (N, K): X and the dequantized weight rounded to fp16
    for fmt, fn, form, (m, n, k) in [("q8_0", _q8_0, "nt", (17, 96, 64)),
                                     ("q4_1", _q4_1, "nt", (33, 40, 320)),
                                     ("q4_1", _q4_1, "nn", (9, 96, 64)),
                                     ("q4_0", _q4_0, "nt", (3, 7, 32)),
                                     ("q6_k", _kquant(210, (208,)), "nt", (5, 9, 256))]:
        xin = (m, k) if form == "nt" else (m, n)
        out.append(Case(f"qmatmul_f16in[{fmt},{form},{m}x{n}x{k}]", "qmatmul_f16in",
                        {"fmt": fmt, "shape": [n, k], "form": form},
                        lambda r, f=fn, xs=xin, nb=n
                        * k // (256 if fmt == "q6_k" else 32): [N(r, xs), f(r, nb).ravel()]))
    return out
