"""The probe registry and what a probe returns: expectations beside measurements, rows, charts."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable


class ProbeError(ValueError):
    pass


@dataclass
class Expectation:
    claim: str          # what must hold, in words
    measured: str       # what was measured, in words and numbers
    ok: bool
    structural: bool = True    # False: reported, but a miss does not fail the probe

    @property
    def tag(self) -> str:
        return (("PASS" if self.ok else "FAIL") if self.structural
                else ("holds" if self.ok else "not seen"))


@dataclass
class Result:
    title: str
    columns: list[str]
    rows: list[dict]
    expectations: list[Expectation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    charts: list[str] = field(default_factory=list)     # inline SVG for the report
    params: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(e.ok for e in self.expectations if e.structural)

    def table(self) -> str:
        cells = [[fmt(r.get(c)) for c in self.columns] for r in self.rows]
        width = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(self.columns)]
        out = ["  ".join(c.rjust(w) for c, w in zip(self.columns, width))]
        out += ["  ".join(v.rjust(w) for v, w in zip(row, width)) for row in cells]
        return "\n".join(out)

    def text(self) -> str:
        lines = [self.title, "", self.table(), ""]
        for e in self.expectations:
            lines.append(f"  {e.tag:8s} {e.claim}: {e.measured}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def json_lines(self) -> list[str]:
        out = [json.dumps({"row": r}, default=float) for r in self.rows]
        out += [json.dumps({"expectation": e.claim, "measured": e.measured, "pass": e.ok,
                            "structural": e.structural}) for e in self.expectations]
        return out


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:.4g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


@dataclass
class Probe:
    name: str
    summary: str                  # one line
    needs_model: bool
    defaults: dict                # parameter -> default value (its type is the parameter's type)
    run: Callable                 # run(ctx) -> Result
    minutes: str = ""             # measured default time on lavapipe, 2 cores (for --help)
    seeds: int = 1                # default --seeds
    # parameter -> (lowest, highest) allowed, where it differs from the rule for numbers (an int at
    # least 1, a float above 0, no upper bound); a bound may name another parameter
    bounds: dict = field(default_factory=dict)


@dataclass
class Context:
    """What a probe is given: the model path ('' = the default), seeds, an output folder for
    the runs it trains (kept for inspection), its parameters, a line printer, and trainer settings
    that replace the defaults the probe starts from (its own choices still apply on top)."""
    model: str
    seeds: int
    work: object                  # pathlib.Path
    params: dict
    say: Callable = print
    # trainer settings from --config (data, labels, max_len, ...)
    train: dict = field(default_factory=dict)
    _files: tuple | None = field(default=None, init=False, repr=False)

    def files(self):
        """(checkpoint, tokenizer) of the probe's model, read once (a GGUF's header takes
        seconds)."""
        if self._files is None:
            from vkdsl.models import load_model_files
            from vkdsl.models.default import default_model_path
            self._files = load_model_files(self.model or default_model_path())
        return self._files


REGISTRY: dict[str, Probe] = {}


def probe(name, summary, needs_model, minutes="", seeds=1, bounds=None, **defaults):
    def wrap(fn):
        REGISTRY[name] = Probe(name, summary, needs_model, defaults, fn, minutes, seeds,
                               bounds or {})
        return fn
    return wrap


def parse_sets(p: Probe, items) -> dict:
    """`--set k=v` items -> the probe's parameters, typed like their defaults."""
    out = dict(p.defaults)
    for it in items:
        k, eq, v = it.partition("=")
        if not eq:
            raise ProbeError(f"--set {it!r}: write key=value")
        if k not in p.defaults:
            known = ", ".join(f"{a}={b}" for a, b in p.defaults.items()) or "none"
            raise ProbeError(f"probe {p.name} has no parameter {k!r}; its parameters: {known}")
        d = p.defaults[k]
        try:
            if isinstance(d, bool):
                if v.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(v)
                out[k] = v.lower() in ("1", "true", "yes")
            elif isinstance(d, int):
                out[k] = int(v)
            elif isinstance(d, float):
                out[k] = float(v)
            elif isinstance(d, (list, tuple)):
                out[k] = [type(d[0])(x) for x in v.split(",")] if d else v.split(",")
            else:
                out[k] = v
        except ValueError:
            raise ProbeError(f"--set {k}={v!r}: expected {type(d).__name__} like {d!r}") from None
    for k, v in out.items():
        _check_bounds(p, k, v, out)
    return out


def _check_bounds(p: Probe, k, v, values):
    """A parameter's values within its bounds: one line naming the parameter, never a failure deep
    inside the probe (an IndexError, numpy's shape wording)."""
    d = p.defaults[k]
    items = v if isinstance(v, list) else [v]
    if (isinstance(d, bool)
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items)):
        return
    if isinstance(v, list) and not v:
        raise ProbeError(f"probe {p.name}: {k} must list at least one value")
    lo, hi = p.bounds.get(k, (1 if isinstance(items[0], int) else None, None))
    lo, hi = (values[b] if isinstance(b, str) else b for b in (lo, hi))
    for x in items:
        if (lo is None and not x > 0) or (lo is not None and x < lo) or (hi is not None and x > hi):
            want = (f"in [{lo}, {hi}]" if hi is not None
                    else (f">= {lo}" if lo is not None else "> 0"))
            raise ProbeError(f"probe {p.name}: {k}={x} is out of bounds: expected {want}")
