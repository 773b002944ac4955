"""Kernel cases as code: what `vkdsl verify --cases FILE` checks and `vkdsl golden make` stores.

A case names the function under test (a traced function, a composition of vkdsl ops or a
CustomOp, run on the device), a float64 numpy reference, a seeded input generator, the error
measure with its limit and the reason for it, and optionally the inputs whose gradients are
checked. vkdsl's own rows are cases too (vkdsl.ops.builtin_cases): one way to declare a case.

Arrays of a case, in the order a golden file stores them: in0, in1, ... (the generator's, as the
device takes them: float32, int32 or uint8), gout (the upstream gradient, standard normal of
out's shape, drawn after the inputs, only with gradient checks), then the reference's outputs
("out" first) and grad_in<i> (the gradient of sum(out * gout) with respect to input i: the
case's grad_reference, else central differences of its reference)."""
from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

MEASURES = ("nmse", "max_abs", "ulp")
INPUT_DTYPES = (np.float32, np.int32, np.uint8)
FD_MAX_ELEMENTS = 1 << 14       # central differences cost two reference calls per element


class CaseError(ValueError):
    """A case file or case that cannot be run as declared (one line naming the file and case)."""


@dataclass
class Case:
    name: str
    # (*Tensor, **params) -> Tensor | {output name: Tensor}, on the device
    fn: Callable
    reference: Callable              # (*float64 arrays, **params) -> array | {output name: array}
    inputs: Callable                 # numpy Generator -> [arrays as the device takes them]
    limit: float                     # the measure's largest passing value (0: exact)
    reason: str                      # why that limit: what error the kernel may have, and why
    measure: str = "nmse"            # nmse, max_abs or ulp (float32 units in the last place)
    params: dict = field(default_factory=dict)
    grads: tuple = ()                # inputs whose gradient of sum(out * gout) is checked
    # (*inputs, gout=, **params) -> one gradient per grads entry
    grad_reference: Callable | None = None
    grad_limit: float | None = None  # the gradients' limit (None: limit)
    # None: crc32 of the name, so no case's inputs depend on another's
    seed: int | None = None
    op: str = ""                     # the row group ("": the name up to its first '[')
    # device -> why it cannot run this case ('' when it can)
    unsupported: Callable | None = None
    where: str = ""                  # the file that declared it (set by load)

    def __post_init__(self):
        self.op = self.op or self.name.split("[", 1)[0]
        self.grads = tuple(self.grads)

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(zlib.crc32(self.name.encode()) if self.seed is None
                                     else self.seed)

    def problem(self) -> str:
        """What is wrong with the declaration ('' when nothing is)."""
        def bad_limit(v):
            return (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or v < 0)
        if not isinstance(self.name, str) or not self.name.strip():
            return "a case without a name"
        for what in ("fn", "reference", "inputs"):
            if not callable(getattr(self, what)):
                return f"{what} is {'missing' if getattr(self, what) is None else 'not callable'}"
        if bad_limit(self.limit) or (self.grad_limit is not None and bad_limit(self.grad_limit)):
            return (f"limit {self.limit!r} (grad_limit {self.grad_limit!r}): expected a finite "
                    f"number >= 0 (0: exact)")
        if not isinstance(self.reason, str) or not self.reason.strip():
            return "no reason for its limit: say what error the kernel may have and why"
        if self.measure not in MEASURES:
            return f"measure {self.measure!r}: expected one of {', '.join(MEASURES)}"
        if (not isinstance(self.params, dict)
            or not all(isinstance(i, int) and i >= 0 for i in self.grads)):
            return "params must be a dict and grads input indices"
        return ""


# ---- loading a case file --------------------------------------------------------------------
BUILTIN = "builtin"                 # --cases builtin: vkdsl's own rows (vkdsl.ops.builtin_cases)


def load(spec: str) -> list[Case]:
    """The cases of a Python file (or an importable module, or `builtin`): its CASES list, else
    every module-level Case. Each is checked; a file that does not import is one CaseError line."""
    if spec == BUILTIN:
        spec = "vkdsl.ops.builtin_cases"
    path = Path(spec)
    where = str(spec)
    try:
        if path.suffix == ".py" or path.exists() or "/" in spec:
            if not path.is_file():
                raise CaseError(f"{spec}: no such case file")
            if path.suffix != ".py":
                raise CaseError(f"{spec}: a case file is Python (.py) with a CASES list or "
                                f"module-level vkdsl.cases.Case values")
            name = f"vkdsl_user_cases_{zlib.crc32(str(path.resolve()).encode()):08x}"
            mod_spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = mod
            mod_spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(spec)
    except CaseError:
        raise
    except Exception as e:          # the user's file: whatever it raises is one line naming it
        if isinstance(e, ModuleNotFoundError) and (spec + ".").startswith(f"{e.name}."):
            raise CaseError(f"{spec}: no such case file (.py) or importable module") from None
        line = _user_line(e, path)
        raise CaseError(f"{where}{line}: the case file does not import: "
                        f"{type(e).__name__}: {e}") from None
    found = getattr(mod, "CASES", None)
    if found is None:
        found = [v for v in vars(mod).values() if isinstance(v, Case)]
    cases = list(found() if callable(found) else found)
    if not cases:
        raise CaseError(f"{where}: no cases (expected a CASES list of vkdsl.cases.Case)")
    seen = set()
    for i, c in enumerate(cases):
        if not isinstance(c, Case):
            raise CaseError(f"{where}: CASES[{i}] is a {type(c).__name__}, expected "
                            f"vkdsl.cases.Case")
        why = c.problem()
        if why:
            raise CaseError(f"{where}: case {c.name!r}: {why}")
        if c.name in seen:
            raise CaseError(f"{where}: case {c.name!r} is declared twice")
        seen.add(c.name)
        c.where = c.where or where
    return cases


def _user_line(e: BaseException, path: Path) -> str:
    """':N' of the deepest traceback frame inside the user's file (SyntaxError: its own line)."""
    if isinstance(e, SyntaxError) and e.lineno:
        return f":{e.lineno}"
    tb, line = e.__traceback__, ""
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).resolve() == path.resolve():
            line = f":{tb.tb_lineno}"
        tb = tb.tb_next
    return line


# ---- the float64 side: inputs, reference outputs, gradients ------------------------------------
def draw_inputs(case: Case) -> tuple[list[np.ndarray], np.random.Generator]:
    rng = case.rng()
    try:
        ins = [np.asarray(a) for a in case.inputs(rng)]
        # (ascontiguousarray makes 0-d 1-d)
        ins = [a if a.flags.c_contiguous else a.copy() for a in ins]
    except Exception as e:
        raise CaseError(f"{case.where}: case {case.name!r}: the input generator raised "
                        f"{type(e).__name__}: {e}") \
            from None
    for i, a in enumerate(ins):
        if a.dtype not in INPUT_DTYPES:
            raise CaseError(f"{case.where}: case {case.name!r}: input {i} is {a.dtype}; expected "
                            f"float32, int32 or uint8 (what the device takes)")
    for i in case.grads:
        if i >= len(ins) or ins[i].dtype != np.float32:
            raise CaseError(f"{case.where}: case {case.name!r}: grads names input {i}, which is "
                            f"not a float32 input")
    return ins, rng


def _f64(ins):
    return [a.astype(np.float64) if a.dtype == np.float32 else a for a in ins]


def _outputs(case: Case, res) -> dict[str, np.ndarray]:
    outs = dict(res) if isinstance(res, dict) else {"out": res}
    if "out" not in outs:
        raise CaseError(f"{case.where}: case {case.name!r}: the reference returned no 'out'")
    for k, v in outs.items():
        a = np.asarray(v)
        if not (np.issubdtype(a.dtype, np.number) or a.dtype == bool):
            raise CaseError(f"{case.where}: case {case.name!r}: reference output {k!r} is not "
                            f"numeric ({a.dtype})")
        outs[k] = a
    return outs


def references(case: Case) -> dict[str, np.ndarray]:
    """Every array of the case (module docstring order): what a golden file of it holds."""
    ins, rng = draw_inputs(case)
    x = _f64(ins)
    try:
        outs = _outputs(case, case.reference(*x, **case.params))
    except CaseError:
        raise
    except Exception as e:
        raise CaseError(f"{case.where}: case {case.name!r}: the reference raised "
                        f"{type(e).__name__}: {e}") from None
    arrays = {f"in{i}": a for i, a in enumerate(ins)}
    if case.grads:
        gout = np.asarray(rng.standard_normal(outs["out"].shape), np.float32)
        arrays["gout"] = gout
        if case.grad_reference is not None:
            gs = list(case.grad_reference(*x, gout=gout.astype(np.float64), **case.params))
        else:
            gs = [central_differences(case, x, i, gout.astype(np.float64)) for i in case.grads]
        if len(gs) != len(case.grads):
            raise CaseError(f"{case.where}: case {case.name!r}: grad_reference returned {len(gs)} "
                            f"gradients for grads {case.grads}")
        for i, g in zip(case.grads, gs):
            g = np.asarray(g, np.float64)
            if g.shape != ins[i].shape:
                raise CaseError(f"{case.where}: case {case.name!r}: the gradient of input {i} has "
                                f"shape {g.shape}, the input's is {ins[i].shape}")
            outs[f"grad_in{i}"] = g
    arrays.update(outs)
    return arrays


def central_differences(case: Case, x: list, i: int, gout: np.ndarray) -> np.ndarray:
    """d sum(reference(x)["out"] * gout) / d x[i], by central differences in float64 (step 1e-6
    relative: truncation ~1e-12, rounding ~1e-10 of the gradient's scale)."""
    if x[i].size > FD_MAX_ELEMENTS:
        raise CaseError(f"{case.where}: case {case.name!r}: input {i} has {x[i].size} "
                        f"elements; finite differences stop at {FD_MAX_ELEMENTS}: give the case a "
                        f"grad_reference")
    xi = x[i].copy()
    args = list(x)
    args[i] = xi
    g = np.zeros_like(xi)

    def f():
        return float(np.sum(_outputs(case, case.reference(*args, **case.params))["out"] * gout))
    for j in range(xi.size):
        v = xi.flat[j]
        h = 1e-6 * max(1.0, abs(v))
        xi.flat[j] = v + h
        up = f()
        xi.flat[j] = v - h
        down = f()
        xi.flat[j] = v
        g.flat[j] = (up - down) / (2 * h)
    return g


# ---- the device side -----------------------------------------------------------------------------
def run(case: Case, arrays: dict, note: str = "", device=None):
    """The case on the device against arrays (references() or a stored golden): one verify.Row per
    output. A case that raises is one failed row with its error (the other cases still run); note:
    why the arrays cannot be trusted (a stale golden): one failed row, nothing run."""
    from .autograd import grad
    from .realize import guarded
    from .runtime import default_device
    from .tensor import Tensor
    from .verify import Row, measure
    dev = device or default_device()
    why = case.unsupported(dev) if case.unsupported else ""
    lim_g = case.limit if case.grad_limit is None else case.grad_limit
    if why:
        return [Row(case.op, case.name, "", float("nan"), case.limit, True, case.reason, why,
                    applicable=False, measure=case.measure)]
    if note:
        return [Row(case.op, case.name, "", float("inf"), case.limit, False, case.reason, note,
                    measure=case.measure)]
    t0 = time.perf_counter()
    n_in = sum(1 for k in arrays if k.startswith("in") and k[2:].isdigit())
    try:            # guarded: a kernel writing past its output fails the row (OverrunError)
        with guarded():
            ins = [Tensor.from_numpy(arrays[f"in{i}"], name=f"in{i}",
                                     requires_grad=i in case.grads) for i in range(n_in)]
            res = _call(case, ins)
            outs = dict(res) if isinstance(res, dict) else {"out": res}
            if case.grads:
                gs = grad(outs["out"], [ins[i] for i in case.grads],
                          upstream=Tensor.from_numpy(arrays["gout"]))
                outs.update({f"grad_in{i}": g for i, g in zip(case.grads, gs)})
            got = {k: np.asarray(v.numpy() if hasattr(v, "numpy") else v)
                   for k, v in outs.items()}
    except Exception as e:           # a failing kernel is a failed row, not a crashed verify
        return [Row(case.op, case.name, "", float("inf"), case.limit, False, case.reason,
                    f"{type(e).__name__}: {e}", measure=case.measure,
                    seconds=time.perf_counter() - t0)]
    seconds = time.perf_counter() - t0
    # rows: "out", the checked gradients and every other output the function returns (a reference
    # may store more, e.g. intermediates, which are checked where the function returns them too)
    names = list(dict.fromkeys(["out", *got, *(f"grad_in{i}" for i in case.grads)]))
    rows = []
    for k in names:
        ref, limit = arrays.get(k), (lim_g if k.startswith("grad_in") else case.limit)
        shape = "x".join(map(str, np.shape(ref))) or "scalar"
        label = case.name + ("" if k == "out" else f":{k}")
        if k not in got or ref is None:
            rows.append(Row(case.op, label, shape, float("inf"), limit, False, case.reason,
                            f"the function returned no {k!r}" if ref is not None else
                            f"the function returned {k!r}, which the reference does not",
                            measure=case.measure))
            continue
        if np.shape(got[k]) != np.shape(ref):
            rows.append(Row(case.op, label, shape, float("inf"), limit, False, case.reason,
                            f"the function's {k} has shape {np.shape(got[k])}, the reference's "
                            f"{np.shape(ref)} ({case.where})", measure=case.measure))
            continue
        err, note = measure(case.measure, got[k], ref)
        rows.append(Row(case.op, label, shape, err, limit, err <= limit and not note, case.reason,
                        note, measure=case.measure))
    for r in rows:
        r.seconds = seconds / len(rows)
    return rows


def verify(pairs, repeat_warm: bool = True):
    """pairs: (case, its arrays: a stored golden or references(), why they are stale or ''). Returns
    (rows, timings); the warm pass runs every case again (pipelines built, programs cached)."""
    t0 = time.perf_counter()
    rows = [r for case, arrays, note in pairs for r in run(case, arrays, note)]
    cold = time.perf_counter() - t0
    warm = None
    if repeat_warm:
        t0 = time.perf_counter()
        for case, arrays, note in pairs:
            run(case, arrays, note)
        warm = time.perf_counter() - t0
    return rows, {"cold_s": cold, "warm_s": warm, "cases": len(pairs)}


def _call(case: Case, ins):
    """fn on the case's inputs: Tensors, or for a vkdsl.trace'd function its arrays (the traced
    program is what runs). Gradients need the graph and a traced call takes arrays only, so with
    grads or params a traced function's own body is called."""
    from .trace import Traced
    fn = case.fn
    if isinstance(fn, Traced):
        if not case.grads and not case.params:
            res = fn(*[t.numpy() for t in ins], **case.params)
            return dict(res) if isinstance(res, dict) else res
        fn = fn.fn
    return fn(*ins, **case.params)
