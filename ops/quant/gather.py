"""Rows of a packed (V, D) table (a quantized embedding): dequantized as they are gathered."""
from __future__ import annotations

from vkdsl import Tensor
from vkdsl.custom import CustomOp, custom
from vkdsl.handwritten import build_kernel, grid_for

from .formats import get_format
from .kernels import QUANT_PUSH


class QGather(CustomOp):
    """out (n, D) = dequantize(W)[ids] for W (V, D) packed; ids outside the table give NaN rows."""

    def __init__(self, fmt: str, shape):
        self.fmt, self.shape, self.name = get_format(fmt).name, tuple(shape), f"qgather_{fmt}"

    def record(self, rec, out, srcs):
        f = get_format(self.fmt)
        V, D = self.shape
        k = build_kernel(rec.device, "quant_gather.comp", self.name, f.defines, 2 + len(f.arrays), QUANT_PUSH,
                         (64, 1, 1))
        items = srcs[0].nbytes // 4 * (D // 32)          # one invocation per 32 weights of a row
        rec.dispatch(k, [out, *srcs], grid_for(rec.device, items), QUANT_PUSH.pack(V, D))


def qgather(ids: Tensor, arrays, fmt: str, shape) -> Tensor:
    """ids (...) int32 -> (..., D) rows of the packed table given as int32 arrays."""
    return custom(QGather(fmt, shape), [ids, *arrays], (*ids.shape, shape[1]), requires_grad=False)
