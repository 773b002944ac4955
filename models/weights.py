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

    def __call__(self, x: Tensor, lora=None) -> Tensor:
        y = x @ self.W.T                  # a transposed operand is a flag, not a copy
        return y if lora is None else y + lora.delta(x)

    def rows(self, ids: Tensor, base: int = 0, total: int | None = None) -> Tensor:
        return self.W.gather(ids, base, total)

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


class RowSplit:
    """A weight larger than one storage binding (the device's maxStorageBufferRange: 128 MiB on
    lavapipe and under the minimal profile; a 150k-vocabulary head, a 7B embedding) kept as blocks
    of rows, each in buffers of its own. x @ W^T is the blocks' outputs side by side (zero-padded
    into place and summed: one fused kernel, and the padding's gradient is the slice); a row
    gather asks every block, which gives its own rows and 0 for the others' (NaN outside W)."""

    def __init__(self, parts: list, starts: list[int], shape, name: str = ""):
        self.parts, self.starts, self.shape, self.name = parts, starts, tuple(shape), name

    def __call__(self, x: Tensor, lora=None) -> Tensor:
        N = self.shape[0]
        out = None
        for p, r0 in zip(self.parts, self.starts):
            y = p(x)
            y = y.pad(((0, 0),) * (y.ndim - 1) + ((r0, N - r0 - p.shape[0]),))
            out = y if out is None else out + y
        return out if lora is None else out + lora.delta(x)

    def rows(self, ids: Tensor) -> Tensor:
        out = None
        for p, r0 in zip(self.parts, self.starts):
            y = p.rows(ids, r0, self.shape[0])
            out = y if out is None else out + y
        return out

    def as_linear(self):
        return self

    @property
    def device_bytes(self):
        return sum(p.device_bytes for p in self.parts)

    @property
    def fp32_bytes(self):
        return int(np.prod(self.shape)) * 4


def binding_limit() -> int:
    from vkdsl.runtime import default_device
    return default_device().limits.max_storage_buffer_range


def device_weight(rec: TensorRecord, quant: str = "keep", limit: int | None = None):
    """A linear weight or embedding table on the device: packed where the mode asks, else fp32;
    split by rows when it would not fit one binding (limit: bytes, default the device's)."""
    limit = binding_limit() if limit is None else limit
    need = planned_bytes(rec, quant)
    if len(rec.shape) == 2 and need > limit:
        # rows per block, a margin for rounding
        rows = max(1, int(rec.shape[0] * (limit / need)) // 64 * 64)
        starts = list(range(0, rec.shape[0], rows))
        parts = [_one(TensorRecord(f"{rec.name}[{r0}:{min(r0 + rows, rec.shape[0])}]",
                                   rec.ggml_type, (min(rows, rec.shape[0] - r0), rec.shape[1]),
                                   rec.raw[r0:r0 + rows]), quant)
                 for r0 in starts]
        return RowSplit(parts, starts, rec.shape, rec.name)
    return _one(rec, quant)


def _one(rec: TensorRecord, quant: str):
    return Packed(rec, quant) if wants_packed(rec, quant) else Dense(rec.dequantize(), rec.name)
