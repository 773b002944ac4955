"""The quantization round trip on the device: fp32 -> packed (the device quantizer) -> fp32 (the
device dequantizer), in one recorded program; the packed arrays stay readable afterwards."""
from __future__ import annotations

from vkdsl import Tensor
from vkdsl.custom import CustomOp, custom
from vkdsl.runtime import Buffer

from . import kernels
from .formats import QuantizedWeight, array_nbytes, check_shape, get_format


class QuantRoundTrip(CustomOp):
    """x (N, K) fp32 -> packed arrays (device buffers owned by this op) -> fp32 (N, K).
    After a run, packed() reads back what the device quantizer wrote."""

    def __init__(self, fmt: str, N: int, K: int):
        self.fmt = get_format(fmt).name
        self.shape = (int(N), int(K))
        check_shape(get_format(self.fmt), *self.shape)
        self.name = f"roundtrip_{self.fmt}"
        self.qbuffers, self.scratch = None, None

    def record(self, rec, out, srcs):
        dev, (N, K) = rec.device, self.shape
        qp = kernels.plan_quantize(dev, self.fmt, N=N, K=K)
        if self.qbuffers is None:
            names = get_format(self.fmt).arrays
            self.qbuffers = [Buffer(dev, n, label=f"{self.name}.{a}")
                             for a, n in zip(names, array_nbytes(self.fmt, N, K))]
            self.scratch = (Buffer(dev, qp.scratch_bytes, label=f"{self.name}.scratch")
                            if qp.scratch_bytes else None)
        kernels.record_quantize(rec, qp, srcs[0], *self.qbuffers, scratch=self.scratch)
        kernels.record_dequant(rec, kernels.plan_dequant(dev, self.fmt, N=N, K=K), out,
                               *self.qbuffers)

    def packed(self) -> QuantizedWeight:
        if self.qbuffers is None:
            raise RuntimeError(f"{self.name}: not run yet, nothing was quantized")
        return QuantizedWeight.from_device(self.fmt, self.shape, self.qbuffers)


def roundtrip(x: Tensor, fmt: str) -> tuple[Tensor, QuantRoundTrip]:
    """(dequantize(quantize(x)) computed on the device, the op holding the packed arrays)."""
    f = get_format(fmt)
    if x.ndim != 2 or x.shape[1] % f.group:
        raise ValueError(f"{f.name} round trip of {x.name or 'a tensor'}: expected a 2-D weight "
                         f"(N, K) with K a multiple of the group size {f.group}, got shape "
                         f"{x.shape}")
    op = QuantRoundTrip(fmt, *x.shape)
    return custom(op, [x], x.shape, requires_grad=False), op
