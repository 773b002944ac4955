"""Packed weights as graph nodes: a frozen weight W (N, K) bound as int32 arrays, dequantized
inside the matmul shader. Used by models/ (packed base weights), the verify rows and benchmarks."""
from __future__ import annotations

import numpy as np

import vkdsl
from vkdsl import Tensor
from vkdsl.custom import CustomOp, custom
from vkdsl.precision import current as precision_now
from vkdsl.runtime import Buffer

from . import kernels
from .formats import QuantizedWeight, get_format


class QLinear(CustomOp):
    """y (M, N) = x (M, K) . W^T with W (N, K) packed, dequantized inside the matmul shader ('nt');
    its input gradient dx = g . W is the same kernel in form 'nn'. W is frozen: no gradient.
    The matmul precision is the one current when the node is made (vkdsl.precision)."""

    def __init__(self, fmt: str, shape, form: str = "nt", precision: str | None = None):
        self.fmt, self.shape, self.form = get_format(fmt).name, tuple(shape), form
        self.precision = precision or precision_now()
        self.name = f"qlinear_{form}_{self.fmt}" + ("_fp16" if self.precision == "fp16" else "")

    def record(self, rec, out, srcs):
        N, K = self.shape
        M = srcs[0].nbytes // 4 // (K if self.form == "nt" else N)
        plan = kernels.plan_qmatmul(rec.device, self.fmt, M=M, N=N, K=K, form=self.form,
                                    precision=self.precision)
        kernels.record_qmatmul(rec, plan, out, srcs[0], *srcs[1:])

    def flops(self, node) -> int:
        N, K = self.shape
        return 2 * node.shape[0] * N * K

    def backward(self, node, g, x, *arrays):
        return (qlinear(g, arrays, self.fmt, self.shape, "nn" if self.form == "nt" else "nt",
                        self.precision),
                *([None] * len(arrays)))


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
