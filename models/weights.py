"""Weights on the device. A linear weight W (out, in) computes x @ W^T; quantized formats
stay packed and are dequantized inside the matmul shader (see vkdsl.ops.quant)."""
from __future__ import annotations

import numpy as np

import vkdsl
from vkdsl import Tensor

from vkdsl.ops.quant import array_nbytes

from .quantized import PACKED_GGUF, Packed, wants_packed
from .tensors import TensorRecord


class Dense:
    """fp32 weight (out, in) on the device."""

    def __init__(self, w: np.ndarray, name: str = ""):
        self.W = vkdsl.tensor(np.ascontiguousarray(w, np.float32), name=name)
        self.shape = w.shape

    def __call__(self, x: Tensor) -> Tensor:
        return x @ self.W.T               # a transposed operand is a flag, not a copy

    def rows(self, ids: Tensor) -> Tensor:
        return self.W.gather(ids)

    def as_linear(self):
        return self

    @property
    def device_bytes(self):
        return self.W.buffer.nbytes

    @property
    def fp32_bytes(self):
        return int(np.prod(self.shape)) * 4


def planned_bytes(rec: TensorRecord, quant: str = "keep") -> int:
    """Device bytes device_weight(rec, quant) will allocate, known before allocating anything."""
    if wants_packed(rec, quant):
        fmt = PACKED_GGUF.get(rec.ggml_type, "q4_0") if quant == "keep" else quant
        return sum(array_nbytes(fmt, *rec.shape))
    return 4 * int(np.prod(rec.shape))


def device_weight(rec: TensorRecord, quant: str = "keep"):
    """A linear weight or embedding table on the device: packed where the mode asks, else fp32."""
    return Packed(rec, quant) if wants_packed(rec, quant) else Dense(rec.dequantize(), rec.name)
