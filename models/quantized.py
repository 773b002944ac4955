"""Packed weights on the device: GGUF Q4_0/Q4_1/Q8_0 blocks as stored, or int4/NF4 made on
load. The fp32 weight never exists on the device: the matmul shader dequantizes as it reads.

Each packed weight is a set of int32 leaf tensors (the format's arrays) that the op library's
custom ops bind (ops.quant.qlinear, whose input gradient is the 'nn' form; ops.quant.qgather)."""
from __future__ import annotations

import math

import numpy as np

from vkdsl import Tensor
from vkdsl.ops import quant

from .tensors import TensorRecord

# stored types kept as they are on the device (F16: half the bytes of fp32, read by unpackHalf2x16)
PACKED_GGUF = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "F16": "f16",
               "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}


def wants_packed(rec: TensorRecord, quant_mode: str) -> bool:
    if quant_mode == "none" or len(rec.shape) != 2:
        return False
    if quant_mode == "keep":         # an F16 row that is not whole 32-element ranges stays fp32
        return rec.ggml_type in PACKED_GGUF and (rec.ggml_type != "F16" or rec.shape[1] % 32 == 0)
    if quant_mode in ("int4", "nf4"):
        return rec.shape[1] % 64 == 0
    raise ValueError(f"quant must be keep, none, int4 or nf4; got {quant_mode!r}")


def packed_formats(ckpt, quant_mode: str) -> set[str]:
    """The packed formats (ops.quant names) a model built from ckpt with quant_mode keeps."""
    return {PACKED_GGUF[r.ggml_type] if quant_mode == "keep" else quant_mode
            for r in ckpt.tensors.values() if wants_packed(r, quant_mode)}


def _pack(rec: TensorRecord, quant_mode: str) -> quant.QuantizedWeight:
    if quant_mode == "keep":
        return quant.from_gguf(np.ascontiguousarray(rec.raw).view(np.uint8), rec.ggml_type,
                               rec.shape)
    w = rec.dequantize().astype(np.float32)
    return quant.quantize_int4(w) if quant_mode == "int4" else quant.quantize_nf4(w)


class Packed:
    """A frozen (out, in) weight kept in its packed format on the device."""

    def __init__(self, rec: TensorRecord, quant_mode: str = "keep"):
        try:
            qw = _pack(rec, quant_mode)
        except ValueError as e:
            raise ValueError(f"tensor {rec.name}: {e}") from None
        self.fmt, self.shape, self.name = qw.fmt, tuple(rec.shape), rec.name
        self.arrays = quant.packed_arrays(qw, rec.name)

    def __call__(self, x: Tensor, lora=None) -> Tensor:
        """x (..., K) @ W^T, plus a LoRA adapter's term (ops.lora.LoRA) fused into the product."""
        N, K = self.shape
        if x.shape[-1] != K:
            raise ValueError(f"{self.name}: input of width {x.shape[-1]}, expected {K}")
        lead = x.shape[:-1]
        x = x.reshape(math.prod(lead), K)
        y = (quant.qlinear(x, self.arrays, self.fmt, self.shape) if lora is None else
             quant.qlora_linear(x, self.arrays, self.fmt, self.shape, lora.A, lora.B, lora.scale))
        return y.reshape(*lead, N)

    def rows(self, ids: Tensor, base: int = 0, total: int | None = None) -> Tensor:
        return quant.qgather(ids, self.arrays, self.fmt, self.shape, base, total)

    def as_linear(self):
        return self

    @property
    def device_bytes(self) -> int:
        return sum(a.buffer.nbytes for a in self.arrays)

    @property
    def fp32_bytes(self) -> int:
        return self.shape[0] * self.shape[1] * 4
