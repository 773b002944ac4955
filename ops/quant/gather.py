"""Rows of a packed (V, D) table (a quantized embedding): dequantized as they are gathered."""
from __future__ import annotations

from vkdsl import Tensor
from vkdsl.custom import CustomOp, custom
from vkdsl.handwritten import PushLayout, grid_for

from .formats import get_format
from .kernels import gather_variant

GATHER_PUSH = PushLayout("<5I", "quant_gather.comp")      # N, K, BASE, TOTAL, IDS


class QGather(CustomOp):
    """out (n, D) = dequantize(W)[ids] for W (V, D) packed; ids outside the table give NaN rows.
    base, total: W is rows [base, base + V) of a table of total rows; the other rows give 0."""

    def __init__(self, fmt: str, shape, base: int = 0, total: int | None = None):
        self.fmt, self.shape, self.name = get_format(fmt).name, tuple(shape), f"qgather_{fmt}"
        self.base, self.total = int(base), int(shape[0] if total is None else total)

    def record(self, rec, out, srcs):
        f = get_format(self.fmt)
        V, D = self.shape
        k = gather_variant(f).build(rec.device, 2 + len(f.arrays), GATHER_PUSH)
        n = srcs[0].nbytes // 4
        items = n * (D // 32)                            # one invocation per 32 weights of a row
        rec.dispatch(k, [out, *srcs], grid_for(rec.device, items),
                     GATHER_PUSH.pack(V, D, self.base, self.total, n))


def qgather(ids: Tensor, arrays, fmt: str, shape, base: int = 0,
            total: int | None = None) -> Tensor:
    """ids (...) int32 -> (..., D) rows of the packed table given as int32 arrays (see QGather)."""
    return custom(QGather(fmt, shape, base, total), [ids, *arrays], (*ids.shape, shape[1]),
                  requires_grad=False)
