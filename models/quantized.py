"""Packed weights on the device: GGUF Q4_0/Q4_1/Q8_0 blocks as stored, or int4/NF4 made on
load. The fp32 weight never exists on the device: the matmul shader dequantizes as it reads.

Each packed weight is a set of int32 leaf tensors (the format's arrays) that custom ops bind;
the input gradient through a frozen packed weight is the 'nn' form (dx = g . W)."""
from __future__ import annotations

import math
import struct

import numpy as np

import vkdsl
from vkdsl import Tensor, quant
from vkdsl.compiler import compile_glsl, kernel_source
from vkdsl.custom import CustomOp, custom
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


class _QMatmul(CustomOp):
    def __init__(self, weight: "Packed", form: str):
        self.w, self.form, self.name = weight, form, f"qmatmul_{form}_{weight.fmt}"

    def record(self, rec, out, srcs):
        x = srcs[0]
        N, K = self.w.shape
        M = x.nbytes // 4 // (K if self.form == "nt" else N)
        plan = quant.plan_qmatmul(rec.device, self.w.fmt, M=M, N=N, K=K, form=self.form)
        quant.record_qmatmul(rec, plan, out, x, *srcs[1:])

    def backward(self, node, g, x, *arrays):
        other = "nn" if self.form == "nt" else "nt"
        return (self.w._apply(g, other), *([None] * len(arrays)))


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
        qw = _pack(rec, quant_mode)
        self.fmt, self.shape, self.name = qw.fmt, tuple(rec.shape), rec.name
        self.arrays = [vkdsl.tensor(a.view(np.int32), name=f"{rec.name}.{n}")
                       for a, n in zip(qw.arrays, quant.get_format(qw.fmt).arrays)]

    def _apply(self, x: Tensor, form: str) -> Tensor:
        N, K = self.shape
        kin, nout = (K, N) if form == "nt" else (N, K)
        if x.shape[-1] != kin:
            raise ValueError(f"{self.name}: input of width {x.shape[-1]}, expected {kin}")
        lead = x.shape[:-1]
        x2 = x.reshape(math.prod(lead), kin)
        y = custom(_QMatmul(self, form), [x2, *self.arrays], (x2.shape[0], nout),
                   requires_grad=x.requires_grad)
        return y.reshape(*lead, nout)

    def __call__(self, x: Tensor) -> Tensor:
        return self._apply(x, "nt")          # x @ W^T

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
