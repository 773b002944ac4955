"""Benchmarks that run side by side with a reference in the same process and report ratios.
Not timed tests: nothing here asserts a speed."""
from __future__ import annotations

import time

import numpy as np

from .matmul import plan_matmul
from .precision import matmul_precision
from .realize import record_step, step_name
from .runtime import Recording
from .trace import trace


def best_of(fn, reps: int = 5, min_time: float = 0.2) -> float:
    """Best wall time of fn() over reps runs (after one warm-up), at least min_time in total."""
    fn()
    best, total, n = float("inf"), 0.0, 0
    while n < reps or total < min_time:
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, total, n = min(best, dt), total + dt, n + 1
        if n >= 50:
            break
    return best


def bench_matmul(sizes=(256, 512, 1024, 2048), precision="fp32"):
    """C = A @ B (n x n x n) on the device at a matmul precision vs numpy fp32 on the same cores."""
    rows = []
    rng = np.random.default_rng(0)
    for n in sizes:
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        with matmul_precision(precision):
            prog = trace(lambda x, y: x @ y).program(a, b)
        prog.run([a, b])
        # Time the recorded dispatch alone (inputs already on the device): that is the kernel.
        dev_t = best_of(prog.recording.submit_wait, reps=3 if n >= 2048 else 5)
        np_t = best_of(lambda: a @ b, reps=3 if n >= 2048 else 5)
        flops = 2.0 * n ** 3
        rows.append({"size": n, "precision": precision,
                     "kernel": plan_matmul(prog.recording.device, M=n, N=n, K=n,
                                           precision=precision).name,
                     "device_gflops": flops / dev_t / 1e9, "numpy_gflops": flops / np_t / 1e9,
                     "ratio": np_t / dev_t, "device_ms": dev_t * 1e3, "numpy_ms": np_t * 1e3})
        prog.release()
    return rows


def bench_replay(n_dispatches: int = 1000, size: int = 256):
    """A traced program of n small dispatches, replayed, vs the same dispatches recorded by
    hand into one command buffer and submitted directly."""
    x = np.linspace(0, 1, size, dtype=np.float32)

    def chain(t):
        for _ in range(n_dispatches):
            t = (t * 0.999 + 0.001).contiguous()
        return t
    traced = trace(chain)
    prog = traced.program(x)
    y = traced(x)
    ref = x.astype(np.float64)
    for _ in range(n_dispatches):
        ref = ref * 0.999 + 0.001
    err = float(np.abs(y - ref).max())
    # Hand-recorded: the same pipelines and buffers, one dispatch per step, barriers between.
    dev = prog.dev
    rec = Recording(dev, n_sets=n_dispatches + 1, label="raw")
    for s in prog.steps:
        record_step(rec, s, prog.buffer_of)
    rec.finish()
    replay_t = best_of(lambda: traced(x), reps=10)
    raw_t = best_of(rec.submit_wait, reps=10)
    rec.release()
    return {"dispatches": len(prog.steps), "replay_us": replay_t * 1e6, "raw_us": raw_t * 1e6,
            "ratio": replay_t / raw_t, "per_dispatch_us": raw_t / len(prog.steps) * 1e6,
            "max_abs_error": err}


def step_flops(step) -> int:
    """Arithmetic of a matmul-like step (2 per multiply-add); 0 for the rest."""
    t = step.node
    if step.kind == "matmul":
        ta, nb = t.arg.ta, t.arg.batch
        a = t.src[0]
        K = a.shape[-2] if ta else a.shape[-1]
        return 2 * nb * t.shape[-2] * t.shape[-1] * K
    if step.kind == "custom" and hasattr(t.arg, "flops"):
        return int(t.arg.flops(t))
    return 0


def time_steps(prog):
    """[(step, seconds)] with each step of a recorded program submitted on its own (after a warm-up
    submit): where the time goes. Assigns are skipped (they would change the program's state)."""
    out = []
    for s in prog.steps:
        if s.kind == "assign":
            continue
        rec = Recording(prog.dev, 8, label="profile")
        record_step(rec, s, prog.buffer_of)
        rec.finish()
        rec.submit_wait()
        t = time.perf_counter()
        rec.submit_wait()
        out.append((s, time.perf_counter() - t))
        rec.release()
    return out


def profile(prog, top: int = 15):
    """Time each step of a recorded program on its own: the `top` kernels by total time."""
    from collections import defaultdict
    totals, counts = defaultdict(float), defaultdict(int)
    for s, dt in time_steps(prog):
        key = step_name(s)
        totals[key] += dt
        counts[key] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1])
    return [(k, counts[k], v) for k, v in rows[:top]], sum(totals.values())
