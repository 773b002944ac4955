"""Quantized weights, in one place: formats and numpy codecs (formats), device kernels (kernels),
the linear layer and dequantize op (linear), quantized row gathers (gather), the device round
trip (roundtrip), verify rows (checks) and the benchmark (bench)."""
from .formats import (FORMATS, NF4_CODEBOOK, NF4_GROUP, Format, QuantizedWeight,  # noqa: F401
                      array_nbytes, dequantize, format_bytes, from_gguf, get_format, quantize_int4,
                      quantize_nf4)
from .gather import qgather  # noqa: F401
from .kernels import (plan_dequant, plan_qmatmul, plan_quantize, record_dequant,  # noqa: F401
                      record_qmatmul, record_quantize)
from .linear import (QLinear, dequant, packed_arrays, qlinear, qlora_linear,  # noqa: F401
                     upload_weight)
from .roundtrip import QuantRoundTrip, roundtrip  # noqa: F401
