"""Check every registered kernel on this device against the float64 goldens: one registry of
builders, one comparison, one run_case (pytest runs each golden case through it too).

Error measure: NMSE = sum((y - ref)^2) / sum(ref^2) over the finite reference entries
(ggml's test-backend-ops measure), with a per-op limit and the reason for it. Non-finite
reference entries must be matched exactly (same NaN / same signed infinity); a NaN or Inf
where the reference is finite fails the row whatever the NMSE."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

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
_ACCUM = (1e-8, "fp32 accumulation over n terms: relative error ~ sqrt(n)*eps32 on well-conditioned "
                "data; n <= 4097 -> NMSE ~ n*eps^2 = 6e-11, margin for cancellation")
for _op in ("neg",):
    register(_op, lambda i, p: -i[0], 0.0, "negation is exact")
for _op, _fn in (("exp", Tensor.exp), ("log", Tensor.log), ("sqrt", Tensor.sqrt), ("rsqrt", Tensor.rsqrt),
                 ("tanh", Tensor.tanh)):
    register(_op, (lambda f: lambda i, p: f(i[0]))(_fn), *_TRANSC)
for _op, _fn in (("add", Tensor.__add__), ("sub", Tensor.__sub__), ("mul", Tensor.__mul__),
                 ("div", Tensor.__truediv__), ("maximum", Tensor.maximum), ("cmplt", Tensor.__lt__)):
    register(_op, (lambda f: lambda i, p: f(i[0], i[1]))(_fn), *_EXACT)
register("where", lambda i, p: i[0].where(i[1], i[2]), 0.0, "selection copies values exactly")
register("sum", lambda i, p: i[0].sum(axis=p["axis"]), *_ACCUM)
register("mean", lambda i, p: i[0].mean(axis=p["axis"]), *_ACCUM)
register("max", lambda i, p: i[0].max(axis=p["axis"]), 0.0, "max selects an input value exactly")
register("permute", lambda i, p: i[0].permute(p["axes"]), 0.0, "a permutation copies values exactly")
register("gather", lambda i, p: i[0].gather(i[1]), 0.0, "a row gather copies values exactly")
register("fused_chain", lambda i, p: (i[0] * i[1] + i[2]).tanh() - (-i[0]).exp(), *_TRANSC)


def _matmul(i, p):
    a = i[0].transpose(-1, -2) if p.get("ta") else i[0]
    b = i[1].transpose(-1, -2) if p.get("tb") else i[1]
    return a @ b


register("matmul", _matmul, *_ACCUM)


def _matmul_fp16(i, p):
    with matmul_precision("fp16"):
        return _matmul(i, p)


def fp16_unsupported(dev) -> str:
    """Why this device runs no precision-fp16 matmul ('' when it does): the fp16 rows' applicability."""
    return "" if fp16_variants(dev) else "no shaderFloat16 or cooperative matrices"


def storage16_unsupported(dev) -> str:
    return "" if dev.limits.storage16 else "no 16-bit storage"


register("half", lambda i, p: i[0].half(), 0.0,
         "fp32 -> fp16 is correctly rounded (to nearest even, overflow to inf, NaN kept): exact", storage16_unsupported)
register("matmul_f16in", _matmul_fp16, 1e-8,
         "precision fp16 against the golden of the inputs rounded to fp16 (round to nearest even, as "
         "Vulkan converts): products of two fp16 values are exact in fp32, sums are fp32 as in matmul: "
         "NMSE ~ n*eps32^2; a kernel that kept fp32 inputs is off by ~u^2/3 per operand (u = 2^-11): "
         "4.8e-8 to 1.25e-7 on these rows; one that summed in fp16 by far more", fp16_unsupported)


# ---- running ---------------------------------------------------------------------------------
def compare(y: np.ndarray, ref: np.ndarray) -> tuple[float, str]:
    """(NMSE over finite reference entries, problem description or ''). The one comparison of
    vkdsl: verify rows, op tests and benchmark sanity checks all use it."""
    if y.shape != ref.shape:
        return float("inf"), f"shape {y.shape}, expected {ref.shape}"
    ref = ref.astype(np.float64)          # integer goldens (codes) must not wrap when squared
    y64, fin = y.astype(np.float64), np.isfinite(ref)
    if not np.isfinite(y64[fin]).all():
        return float("inf"), f"{int((~np.isfinite(y64[fin])).sum())} NaN/Inf where the reference is finite"
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

    def as_dict(self):
        return {"op": self.op, "name": self.name, "shape": self.shape, "error": self.error,
                "limit": self.limit, "passed": self.passed, "reason": self.reason, "note": self.note,
                "applicable": self.applicable}


def run_case(case, arrays) -> list[Row]:
    from .autograd import grad
    from .runtime import default_device
    chk = REGISTRY[case["op"]]
    why = chk.unsupported(default_device()) if chk.unsupported else ""
    if why:
        return [Row(case["op"], case["name"], "", float("nan"), chk.limit, True, chk.reason, why, applicable=False)]
    wants_grad = {int(k[len("grad_in"):]) for k in case["outputs"] if k.startswith("grad_in")}
    ins = [Tensor.from_numpy(arrays[n], name=n, requires_grad=i in wants_grad)
           for i, n in enumerate(case["inputs"])]
    try:
        res = chk.build(ins, case["params"])
        outs = res if isinstance(res, dict) else {"out": res}
        if wants_grad:     # gradients of sum(out * gout) w.r.t. each differentiable input
            order = sorted(wants_grad)
            gs = grad(outs["out"], [ins[i] for i in order], upstream=Tensor.from_numpy(arrays[case["upstream"]]))
            outs.update({f"grad_in{i}": g for i, g in zip(order, gs)})
        got = {k: v.numpy() for k, v in outs.items()}
    except Exception as e:   # a failing kernel is a failed row, not a crashed verify
        return [Row(case["op"], case["name"], "", float("inf"), chk.limit, False, chk.reason,
                    f"{type(e).__name__}: {e}")]
    rows = []
    for k, y in got.items():
        ref = arrays[k]
        err, note = compare(np.asarray(y), ref)
        shape = "x".join(map(str, ref.shape)) or "scalar"
        rows.append(Row(case["op"], case["name"] + ("" if k == "out" else f":{k}"), shape, err, chk.limit,
                        err <= chk.limit and not note, chk.reason, note))
    return rows


def verify(cases, repeat_warm: bool = True):
    """cases: (manifest entry, arrays) pairs, as vkdsl_golden.store loads them. Returns (rows,
    timings). A case whose op has no registered builder is a failure: a golden nobody checks is a
    gap, not a pass."""
    t0 = time.perf_counter()
    rows = []
    for case, arrays in cases:
        if case["op"] not in REGISTRY:
            rows.append(Row(case["op"], case["name"], "", float("inf"), 0.0, False, "",
                            "no device implementation registered for this op"))
            continue
        rows.extend(run_case(case, arrays))
    cold = time.perf_counter() - t0
    warm = None
    if repeat_warm:
        t0 = time.perf_counter()
        for case, arrays in cases:
            if case["op"] in REGISTRY:
                run_case(case, arrays)
        warm = time.perf_counter() - t0
    return rows, {"cold_s": cold, "warm_s": warm, "cases": len(cases)}
