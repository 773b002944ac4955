"""Packed weights on the device: GGUF Q4_0/Q4_1/Q8_0 blocks as stored, or int4/NF4 made on
load. The fp32 weight never exists on the device: the matmul shader dequantizes as it reads.

Each packed weight is a set of int32 leaf tensors (the format's arrays) that custom ops bind
(ops.quant.qlinear; the input gradient through a frozen packed weight is the 'nn' form)."""
from __future__ import annotations

import math
import struct

import numpy as np

from vkdsl import Tensor, quant
from vkdsl.compiler import compile_glsl, kernel_source
from vkdsl.custom import CustomOp, custom
from vkdsl.ops.quant import packed_arrays, qlinear
from vkdsl.runtime import get_kernel

from .tensors import TensorRecord

PACKED_GGUF = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}


def wants_packed(rec: TensorRecord, quant_mode: str) -> bool:
    if quant_mode == "none" or len(rec.shape) != 2:
        return False
    if quant_mode == "keep":
        return rec.ggml_type in PACKED_GGUF
    if quant_mode in ("int4", "nf4"):
        return rec.shape[1] % 64 == 0
    raise ValueError(f"quant must be keep, none, int4 or nf4; got {quant_mode!r}")


def _pack(rec: TensorRecord, quant_mode: str) -> quant.QuantizedWeight:
    if quant_mode == "keep":
        return quant.from_gguf(rec.raw, rec.ggml_type, rec.shape)
    w = rec.dequantize().astype(np.float32)
    return quant.quantize_int4(w) if quant_mode == "int4" else quant.quantize_nf4(w)


class _QGather(CustomOp):
    def __init__(self, weight: "Packed"):
        self.w, self.name = weight, f"qgather_{weight.fmt}"

    def record(self, rec, out, srcs):
        f = quant.get_format(self.w.fmt)
        N, K = self.w.shape
        k = get_kernel(rec.device, self.name, compile_glsl(self.name, kernel_source("quant_gather.comp"), f.defines),
                       2 + len(f.arrays), 8, (64, 1, 1))
        items = srcs[0].nbytes // 4 * (K // 32)
        rec.dispatch(k, [out, *srcs], quant._grid(items), struct.pack(quant.QUANT_PUSH_FORMAT, N, K))


class Packed:
    """A frozen (out, in) weight kept in its packed format on the device."""

    def __init__(self, rec: TensorRecord, quant_mode: str = "keep"):
        try:
            qw = _pack(rec, quant_mode)
        except ValueError as e:
            raise ValueError(f"tensor {rec.name}: {e}") from None
        self.fmt, self.shape, self.name = qw.fmt, tuple(rec.shape), rec.name
        self.arrays = packed_arrays(qw, rec.name)

    def __call__(self, x: Tensor) -> Tensor:
        """x (..., K) @ W^T."""
        N, K = self.shape
        if x.shape[-1] != K:
            raise ValueError(f"{self.name}: input of width {x.shape[-1]}, expected {K}")
        lead = x.shape[:-1]
        return qlinear(x.reshape(math.prod(lead), K), self.arrays, self.fmt, self.shape).reshape(*lead, N)

    def rows(self, ids: Tensor) -> Tensor:
        return custom(_QGather(self), [ids, *self.arrays], (*ids.shape, self.shape[1]), requires_grad=False)

    def as_linear(self):
        return self

    @property
    def device_bytes(self) -> int:
        return sum(a.buffer.nbytes for a in self.arrays)

    @property
    def fp32_bytes(self) -> int:
        return self.shape[0] * self.shape[1] * 4


def make_linear(rec, quant_mode):
    return Packed(rec, quant_mode)


make_table = make_linear
