"""Check kernels on this device against float64 references: the registry of vkdsl's own ops
(each op's device builder, limit and reason; vkdsl.ops.builtin_cases makes them cases), the
error measures and the result row (vkdsl.cases runs cases; pytest runs each built-in golden case
through it too).

Default measure: NMSE = sum((y - ref)^2) / sum(ref^2) over the finite reference entries
(ggml's test-backend-ops measure), with a per-op limit and the reason for it. Non-finite
reference entries must be matched exactly (same NaN / same signed infinity); a NaN or Inf
where the reference is finite fails the row whatever the NMSE. A case may measure max_abs
(largest absolute difference) or ulp (float32 units in the last place) instead."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .handwritten import GPU_BLOCKS, default_variant, gpu_block, gpu_configs
from .matmul import fp16_variants
from .precision import matmul_precision
from .tensor import Tensor

EPS32 = 2.0 ** -23


@dataclass
class OpCheck:
    build: Callable            # (inputs: list[Tensor], params: dict) -> Tensor | dict[str, Tensor]
    limit: float
    reason: str
    # (device) -> why this device can not run the op ('' when it can): such rows are reported
    # as not applicable, never run and never counted as passed work
    unsupported: Callable | None = None


REGISTRY: dict[str, OpCheck] = {}


def register(op: str, build, limit: float, reason: str, unsupported=None):
    REGISTRY[op] = OpCheck(build, limit, reason, unsupported)


# ---- the core's rows -----------------------------------------------------------------------
_EXACT = (1e-12, "IEEE fp32 basic arithmetic is correctly rounded: NMSE ~ eps32^2 = 1.4e-14")
_TRANSC = (1e-9, "Vulkan allows exp/log 3+2|x| ulp and inherited-precision tanh/rsqrt: "
                 "~1e2 ulp at |x|=40 -> NMSE ~ (1e2*6e-8)^2 = 4e-11, with margin")
_ACCUM = (1e-8, "fp32 accumulation over n terms: relative error ~ sqrt(n)*eps32 on "
                "well-conditioned data; n <= 4097 -> NMSE ~ n*eps^2 = 6e-11, margin for "
                "cancellation")
for _op in ("neg",):
    register(_op, lambda i, p: -i[0], 0.0, "negation is exact")
for _op, _fn in (("exp", Tensor.exp), ("log", Tensor.log), ("sqrt", Tensor.sqrt),
                 ("rsqrt", Tensor.rsqrt), ("tanh", Tensor.tanh)):
    register(_op, (lambda f: lambda i, p: f(i[0]))(_fn), *_TRANSC)
for _op, _fn in (("add", Tensor.__add__), ("sub", Tensor.__sub__), ("mul", Tensor.__mul__),
                 ("div", Tensor.__truediv__), ("maximum", Tensor.maximum),
                 ("cmplt", Tensor.__lt__)):
    register(_op, (lambda f: lambda i, p: f(i[0], i[1]))(_fn), *_EXACT)
register("where", lambda i, p: i[0].where(i[1], i[2]), 0.0, "selection copies values exactly")
register("sum", lambda i, p: i[0].sum(axis=p["axis"]), *_ACCUM)
register("mean", lambda i, p: i[0].mean(axis=p["axis"]), *_ACCUM)
register("max", lambda i, p: i[0].max(axis=p["axis"]), 0.0, "max selects an input value exactly")
register("permute", lambda i, p: i[0].permute(p["axes"]), 0.0,
         "a permutation copies values exactly")
register("gather", lambda i, p: i[0].gather(i[1]), 0.0, "a row gather copies values exactly")
register("fused_chain", lambda i, p: (i[0] * i[1] + i[2]).tanh() - (-i[0]).exp(), *_TRANSC)


def _matmul(i, p):
    a = i[0].transpose(-1, -2) if p.get("ta") else i[0]
    b = i[1].transpose(-1, -2) if p.get("tb") else i[1]
    return a @ b


register("matmul", _matmul, *_ACCUM)


def _matmul_block(i, p):
    # realized inside the block: a lazy product would be planned after the with has ended
    with gpu_block(p["block"]):
        return _matmul(i, p).numpy()


def blocks_unsupported(dev) -> str:
    """Why this device runs no forced-block rows ('' when it runs them): the lvp family has no
    shared-memory blocks; a GPU must fit every block the shape rule can pick."""
    if default_variant(dev) != "gpu":
        return "the lvp family runs no shared-memory blocks"
    fits = [c["BM"] for c in gpu_configs(dev)]
    return "" if len(fits) == len(GPU_BLOCKS) else f"only blocks {fits} fit this device"


register("matmul_block", _matmul_block, *_ACCUM, blocks_unsupported)


def _matmul_fp16(i, p):
    with matmul_precision("fp16"):
        return _matmul(i, p)


def fp16_unsupported(dev) -> str:
    """Why this device runs no precision-fp16 matmul ('' when it does): the fp16 rows'
    applicability."""
    return "" if fp16_variants(dev) else "no shaderFloat16 or cooperative matrices"


def storage16_unsupported(dev) -> str:
    return "" if dev.limits.storage16 else "no 16-bit storage"


register("half", lambda i, p: i[0].half(), 0.0,
         "fp32 -> fp16 is correctly rounded (to nearest even, overflow to inf, NaN kept): exact",
         storage16_unsupported)
register("matmul_f16in", _matmul_fp16, 1e-8,
         "precision fp16 against the golden of the inputs rounded to fp16 (round to nearest "
         "even, as Vulkan converts): products of two fp16 values are exact in fp32, sums are fp32 "
         "as in matmul: NMSE ~ n*eps32^2; a kernel that kept fp32 inputs is off by ~u^2/3 per "
         "operand (u = 2^-11): 4.8e-8 to 1.25e-7 on these rows; one that summed in fp16 "
         "by far more", fp16_unsupported)


# ---- running ---------------------------------------------------------------------------------
def compare(y: np.ndarray, ref: np.ndarray) -> tuple[float, str]:
    """(NMSE over finite reference entries, problem description or ''). The one comparison of
    vkdsl: verify rows, op tests and benchmark sanity checks all use it."""
    if y.shape != ref.shape:
        return float("inf"), f"shape {y.shape}, expected {ref.shape}"
    ref = ref.astype(np.float64)          # integer goldens (codes) must not wrap when squared
    y64, fin = y.astype(np.float64), np.isfinite(ref)
    if not np.isfinite(y64[fin]).all():
        return (float("inf"),
                f"{int((~np.isfinite(y64[fin])).sum())} NaN/Inf where the reference is finite")
    nf = ~fin
    if nf.any():
        same = (np.isnan(ref[nf]) & np.isnan(y64[nf])) | (ref[nf] == y64[nf])
        if not same.all():
            return float("inf"), f"{int((~same).sum())} non-finite reference entries not reproduced"
    den = float(np.sum(ref[fin] ** 2))
    num = float(np.sum((y64[fin] - ref[fin]) ** 2))
    return (num / den if den > 0 else num), ""


def nmse(y, ref) -> float:
    """compare()'s error, inf when the non-finite entries do not match the reference's."""
    err, note = compare(np.asarray(y), np.asarray(ref))
    return float("inf") if note else err


def max_abs(y: np.ndarray, ref: np.ndarray) -> tuple[float, str]:
    """(largest |y - ref| over finite reference entries, problem or ''): compare()'s checks."""
    err, note = compare(y, ref)
    if note:
        return err, note
    fin = np.isfinite(ref)
    d = np.abs(y.astype(np.float64)[fin] - ref.astype(np.float64)[fin])
    return (float(d.max()) if d.size else 0.0), ""


def ulp(y: np.ndarray, ref: np.ndarray) -> tuple[float, str]:
    """(largest distance in float32 units in the last place between y and the reference rounded to
    float32, over finite entries; problem or '')."""
    err, note = compare(y, ref)
    if note:
        return err, note
    fin = np.isfinite(ref)

    def ordered(a):                   # float32 bit patterns as integers in the floats' order
        i = np.asarray(a, np.float32)[fin].view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    d = np.abs(ordered(y) - ordered(ref.astype(np.float64)))
    return (float(d.max()) if d.size else 0.0), ""


MEASURES = {"nmse": compare, "max_abs": max_abs, "ulp": ulp}


def measure(kind: str, y, ref) -> tuple[float, str]:
    """The error of y against ref in one of MEASURES, and a problem description ('' when none)."""
    return MEASURES[kind](np.asarray(y), np.asarray(ref))


@dataclass
class Row:
    op: str
    name: str
    shape: str
    error: float
    limit: float
    passed: bool
    reason: str
    note: str = ""
    applicable: bool = True     # False: the device can not run this op (note says why); not run
    measure: str = "nmse"
    seconds: float = 0.0        # the row's share of its case's time on the device

    def as_dict(self):
        """The row as strict JSON takes it: an error that is not a number (a row not run, a failed
        kernel) is null, never NaN or Infinity, which JSON has no literal for."""
        d = dataclasses.asdict(self)
        d["error"] = d["error"] if math.isfinite(d["error"]) else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Row":
        """as_dict's inverse: a null error is +inf on a row that ran and failed, NaN on one not
        run."""
        err = (d["error"] if d["error"] is not None
               else (math.inf if d.get("applicable", True) else math.nan))
        return cls(**{**d, "error": err})
