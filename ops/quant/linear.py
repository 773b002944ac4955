"""Packed weights as graph nodes: a frozen weight W (N, K) bound as int32 arrays, dequantized
inside the matmul shader. Used by models/ (packed base weights), the verify rows and benchmarks."""
from __future__ import annotations

import numpy as np

import vkdsl
from vkdsl import Tensor
from vkdsl.custom import CustomOp, custom
from vkdsl.precision import current as precision_now
from vkdsl.runtime import Buffer

from ..lora import LoRA
from . import kernels
from .formats import QuantizedWeight, get_format


class QLinear(CustomOp):
    """y (M, N) = x (M, K) . W^T with W (N, K) packed, dequantized inside the matmul shader ('nt');
    its input gradient dx = g . W is the same kernel in form 'nn'. W is frozen: no gradient.
    The matmul precision is the one current when the node is made (vkdsl.precision).
    lora (rank r, scale s; qlora_linear): the sources end in U, V (and A) and the kernel adds
    s U V ('nt', V = B) or s U V^T ('nn', V = A) as it stores."""

    def __init__(self, fmt: str, shape, form: str = "nt", precision: str | None = None,
                 lora: tuple | None = None):
        self.fmt, self.shape, self.form = get_format(fmt).name, tuple(shape), form
        self.precision = precision or precision_now()
        self.lora = lora
        self.name = (f"qlinear_{form}_{self.fmt}" + ("_fp16" if self.precision == "fp16" else "")
                     + ("_lora" if lora else ""))

    def record(self, rec, out, srcs):
        N, K = self.shape
        n = len(get_format(self.fmt).arrays)
        x, arrays, low = srcs[0], srcs[1:1 + n], srcs[1 + n:1 + n + 2]
        M = x.nbytes // 4 // (K if self.form == "nt" else N)
        plan = kernels.plan_qmatmul(rec.device, self.fmt, M=M, N=N, K=K, form=self.form,
                                    precision=self.precision,
                                    lora_rank=self.lora[0] if self.lora else 0,
                                    lora_scale=self.lora[1] if self.lora else 0.0)
        kernels.record_qmatmul(rec, plan, out, x, *arrays, lora=tuple(low))

    def flops(self, node) -> int:
        N, K = self.shape
        rank = self.lora[0] if self.lora else 0
        return 2 * node.shape[0] * (N * K + node.shape[1] * rank)

    def backward(self, node, g, x, *rest):
        n = len(get_format(self.fmt).arrays)
        if not self.lora:
            return (qlinear(g, rest, self.fmt, self.shape, "nn" if self.form == "nt" else "nt",
                            self.precision),
                    *([None] * n))
        if self.form != "nt":
            raise NotImplementedError(f"{self.name}: an input gradient has no gradient")
        # y = x W^T + s U B with U = x A. The gradients through U (to x and to A) are given here,
        # not by U's own node (None below), so that x's whole gradient is one fused product:
        # dx = g W + s (g B^T) A^T, dA = s x^T (g B^T), dB = s U^T g.
        arrays, (U, B, A) = rest[:n], rest[n:]
        s = self.lora[1]
        P = g @ B.T
        dx = custom(QLinear(self.fmt, self.shape, "nn", self.precision, self.lora),
                    [g, *arrays, P, A], (g.shape[0], self.shape[1]), requires_grad=False)
        return (dx, *([None] * n), None, (U.T @ g) * s, (x.T @ P) * s)


def upload_weight(dev, qw: QuantizedWeight) -> list:
    """The weight's arrays as device buffers, in binding order."""
    bufs = []
    for name, a in zip(get_format(qw.fmt).arrays, qw.arrays):
        b = Buffer(dev, a.nbytes, label=f"{qw.fmt}.{name}")
        b.write(a)
        bufs.append(b)
    return bufs


def packed_arrays(qw: QuantizedWeight, name: str = "w") -> list[Tensor]:
    """The packed weight's device arrays as int32 leaf tensors (what the quantized kernels bind)."""
    return [vkdsl.tensor(a.view(np.int32), name=f"{name}.{n}")
            for a, n in zip(qw.arrays, get_format(qw.fmt).arrays)]


def qlinear(x: Tensor, arrays, fmt: str, shape, form: str = "nt",
            precision: str | None = None) -> Tensor:
    """x (M, K) . W^T ('nt') or x (M, N) . W ('nn') with W (N, K) given as packed int32 arrays."""
    N, K = shape
    kin, nout = (K, N) if form == "nt" else (N, K)
    if x.ndim != 2 or x.shape[1] != kin:
        raise ValueError(f"qlinear {fmt} {N}x{K} ({form}): input {x.name or ''} of shape "
                         f"{x.shape}, expected (M, {kin})")
    return custom(QLinear(fmt, shape, form, precision), [x, *arrays], (x.shape[0], nout),
                  requires_grad=x.requires_grad)


def qlora_linear(x: Tensor, arrays, fmt: str, shape, A: Tensor, B: Tensor, scale: float,
                 precision: str | None = None) -> Tensor:
    """x (M, K) . W^T + scale (x A) B, W (N, K) packed, A (K, r), B (r, N): a LoRA layer on a
    quantized weight. Where the kernel takes the shape (kernels.lora_fits, and more rows than the
    few-row kernel's: a token at a time keeps its matrix-vector kernel) the adapter's term rides in
    the product's epilogue, forward and input gradient alike; elsewhere it is ops.lora's."""
    N, K = shape
    if x.ndim != 2 or x.shape[1] != K or A.shape[0] != K or B.shape != (A.shape[1], N):
        raise ValueError(f"qlora_linear {fmt} {N}x{K}: x {x.shape}, A {A.shape}, B {B.shape}; "
                         f"expected x (M, {K}), A ({K}, r), B (r, {N})")
    if x.shape[0] <= kernels.MV_ROWS or not kernels.lora_fits("nt", A.shape[1], N):
        return qlinear(x, arrays, fmt, shape, "nt", precision) + LoRA(A, B, scale).delta(x)
    return custom(QLinear(fmt, shape, "nt", precision, (A.shape[1], float(scale))),
                  [x, *arrays, x @ A, B, A], (x.shape[0], N))


class Dequant(CustomOp):
    """The fp32 weight (N, K) from a packed weight's arrays (int32 leaf tensors)."""

    def __init__(self, fmt: str, N: int, K: int):
        self.fmt, self.shape, self.name = get_format(fmt).name, (int(N), int(K)), f"dequant_{fmt}"

    def record(self, rec, out, srcs):
        plan = kernels.plan_dequant(rec.device, self.fmt, N=self.shape[0], K=self.shape[1])
        kernels.record_dequant(rec, plan, out, *srcs)


def dequant(qw: QuantizedWeight) -> Tensor:
    return custom(Dequant(qw.fmt, *qw.shape), packed_arrays(qw, qw.fmt), qw.shape,
                  requires_grad=False)
