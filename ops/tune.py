"""`vkdsl tune`: time every tile of the CPU matmul kernels (vkdsl.tuning.TILES that the kernel
takes) on each shape class a job plans, and keep the fastest in this device's tuning file.

A candidate is kept only when its output equals the default tile's bit for bit (a tile moves work
between invocations, never the order of a sum; a kernel that disagrees is broken on this driver
and is never chosen) and it beats the default by more than the noise margin. Timing: best of
`rounds` rounds, each submitting every candidate in turn, so all of them see the same load."""
from __future__ import annotations

import time

import numpy as np

from vkdsl import tuning
from vkdsl.handwritten import default_variant
from vkdsl.matmul import FORMS, plan_matmul, record_matmul
from vkdsl.runtime import Buffer, Recording

from .quant.formats import get_format
from .quant.kernels import plan_qmatmul, record_qmatmul

MARGIN = 0.03           # a candidate must be this much faster than the default to replace it


def _weight(fmt: str, n: int, k: int, rng):
    """A packed example weight, or None where no host quantizer exists (gguf-py lacks the
    K-quants')."""
    from .quant.bench import example_weight
    try:
        return example_weight(fmt, rng.standard_normal((n, k)).astype(np.float32))
    except (NotImplementedError, AttributeError, ValueError):
        return None


def _case(dev, op: str, form: str, M: int, N: int, K: int, rng):
    """(plan for a tile, record into rec, output buffer, output count) of one shape, or None; the
    plan raises ValueError for a tile its kernel cannot take."""
    if op == "matmul":
        ta, tb = {v: k for k, v in FORMS.items()}[form]
        a = rng.standard_normal(M * K).astype(np.float32)
        b = rng.standard_normal(K * N).astype(np.float32)
        A, B, C = Buffer(dev, a.nbytes), Buffer(dev, b.nbytes), Buffer(dev, 4 * M * N)
        A.write(a)
        B.write(b)

        def plan(tile):
            return plan_matmul(dev, M=M, N=N, K=K, ta=ta, tb=tb, tile=tile, variant="lvp")
        return plan, lambda rec, p: record_matmul(rec, p, C, A, B), C, M * N
    fmt = op.split(":", 1)[1]
    from .quant.linear import upload_weight
    qw = _weight(fmt, N, K, rng)
    if qw is None:
        return None
    qbufs = upload_weight(dev, qw)
    rows, cols, red = (M, N, K) if form == "nt" else (M, K, N)
    x = rng.standard_normal(rows * red).astype(np.float32)
    X, C = Buffer(dev, x.nbytes), Buffer(dev, 4 * rows * cols)
    X.write(x)

    def plan(tile):
        return plan_qmatmul(dev, fmt, M=M, N=N, K=K, form=form, tile=tile, variant="lvp")
    return plan, lambda rec, p: record_qmatmul(rec, p, C, X, *qbufs), C, rows * cols


def tune_shape(dev, op: str, form: str, M: int, N: int, K: int, rounds: int = 3,
               say=print) -> dict | None:
    """Measure the tiles on one shape -> its tuning entry (tile, ms per candidate), or None."""
    rng = np.random.default_rng(0)
    case = _case(dev, op, form, M, N, K, rng)
    if case is None:
        say(f"  {op} {form} {M}x{N}x{K}: no host quantizer for this format; left at the default")
        return None
    plan, record, C, count = case
    recs = {}
    for tile in tuning.TILES:                          # the default first: TILES[0]
        try:
            p = plan(tile)
        except ValueError:                             # a tile this kernel and shape cannot take
            continue
        rec = Recording(dev, 1)
        record(rec, p)
        C.write(np.full(C.nbytes // 4, np.nan, np.float32))  # nothing left over from another tile
        rec.submit_wait()
        recs[tile] = (rec, C.read(np.float32, count).copy())
    want = recs[tuning.DEFAULT_TILE][1]
    ms = {t: float("inf") for t in recs}
    for _ in range(rounds):
        for t, (rec, _) in recs.items():
            s = time.perf_counter()
            rec.submit_wait()
            ms[t] = min(ms[t], (time.perf_counter() - s) * 1e3)
    same = {t for t, (_, out) in recs.items() if np.array_equal(out, want, equal_nan=True)}
    for rec, _ in recs.values():
        rec.release()
    best = min(same, key=lambda t: ms[t])
    if ms[best] > ms[tuning.DEFAULT_TILE] * (1 - MARGIN):
        best = tuning.DEFAULT_TILE
    differ = sorted(set(recs) - same)
    say(f"  {op} {form} {M}x{N}x{K}: {best[0]}x{best[1]} {ms[best]:.2f} ms (default "
        f"{ms[tuning.DEFAULT_TILE]:.2f} ms)"
        + (f"; results differ, never chosen: {differ}" if differ else ""))
    return {"tile": list(best), "shape": [M, N, K],
            "ms": {f"{t[0]}x{t[1]}": round(v, 3) for t, v in ms.items()},
            "differ": [f"{t[0]}x{t[1]}" for t in differ]}


def tune(dev, shapes, rounds: int = 3, say=print) -> tuple[str, dict]:
    """Tune each shape class once (its first shape stands for it) -> (tuning file, new entries)."""
    if default_variant(dev) != "lvp":
        raise ValueError(f"{dev.info.describe()} runs the shared-memory GPU kernels, whose tiles "
                         f"follow its limits; only the CPU-driver (lvp) kernels are tuned so far")
    seen, new = set(), {}
    for op, form, M, N, K in shapes:
        key = tuning.shape_class(op, form, M, N, K)
        if key in seen or min(M, N, K) <= 0:
            continue
        seen.add(key)
        if op != "matmul":
            get_format(op.split(":", 1)[1])            # an unknown format is an error, not a skip
        entry = tune_shape(dev, op, form, M, N, K, rounds, say)
        if entry is not None:
            new[key] = entry
    return tuning.save(dev, new), new
