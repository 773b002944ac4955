"""`vkdsl bench train --by-kernel`: where one training step's time goes, by kernel class, with
achieved GFLOP/s for the matmul-like kernels. Each recorded dispatch of the traced step is
submitted on its own (vkdsl.bench.time_steps). The rest of the step's wall time is split by what
the device counted while the step ran (Device.waited, per program): the step program's time in
sequence beyond its kernels alone (cold caches, barriers), the other programs the step ran (the
frozen prefix and the TMKL base logits of a batch's first visit), and the host (the rest)."""
from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from vkdsl.bench import step_flops, time_steps
from vkdsl.runtime import default_device

CLASSES = ("quantized matmul, forward (x·Wᵀ)", "quantized matmul, input gradient (dy·W)",
           "LM head + cross-entropy", "attention forward (fused kernel)", "LoRA (narrow matmuls)",
           "fp32 matmul (attention backward, other)",
           "elementwise and reductions (norms, RoPE, SwiGLU, softmax pieces)", "embedding gather",
           "attention backward (fused kernels)", "ordering copies (head + loss fusion)",
           "other hand-written kernels (dequantize, the delta rule's chunk solve)")


def kernel_class(step, vocab: int) -> str:
    t = step.node
    if step.kind == "custom":
        name = t.arg.name
        if name.startswith("qlinear"):
            if vocab in (t.shape[-1], getattr(t.arg, "shape", (0, 0))[0]):
                return CLASSES[2]
            return CLASSES[0] if "_nt_" in name else CLASSES[1]
        if name.startswith("attention_backward"):
            return CLASSES[8]
        if name.startswith("attention"):
            return CLASSES[3]
        if name == "after":
            return CLASSES[9]
        return CLASSES[7] if name.startswith("qgather") else CLASSES[10]
    if step.kind == "matmul":
        a, b = t.src
        if vocab in t.shape or vocab in a.shape or vocab in b.shape:
            return CLASSES[2]
        return CLASSES[4] if min(*t.shape[-2:], *a.shape[-2:]) <= 32 else CLASSES[5]  # rank <= 32
    if step.kind == "gather":
        return CLASSES[7]
    touches_vocab = vocab in t.shape or any(vocab in s.shape for s in step.inputs)
    return CLASSES[2] if touches_vocab else CLASSES[6]


# the other programs a step may run, by their traced functions' names
PROGRAMS = {"frozen_prefix": "frozen prefix forward (layers below the first adapter), first visit",
            "base_hidden": "TMKL base logits (adapters off), first visit of the batch",
            "base_head": "TMKL base logits (adapters off), first visit of the batch",
            "assign": "optimizer write-back (one copy per adapter tensor)"}


def timed(fn) -> tuple[float, dict]:
    """fn() -> (its wall seconds, {program label: seconds the device was waited on meanwhile})."""
    waited = default_device().waited
    before = dict(waited)
    t = time.perf_counter()
    fn()
    wall = time.perf_counter() - t
    return wall, {k: v - before.get(k, 0.0) for k, v in waited.items() if v > before.get(k, 0.0)}


def table(prog, vocab: int, wall_s: float, objective: str, waited: dict) -> list[dict]:
    """prog: the step program; wall_s and waited (timed()) of one step, per micro-batch."""
    secs, calls, flops = defaultdict(float), defaultdict(int), defaultdict(int)
    for s, dt in time_steps(prog):
        c = kernel_class(s, vocab)
        secs[c] += dt
        calls[c] += 1
        flops[c] += step_flops(s)
    label = prog.recording.label
    secs["the step program in sequence − its kernels alone (cold caches, barriers)"] = (
        waited.get(label, 0.0) - sum(secs.values()))
    for other, s in waited.items():
        if other != label:
            secs[PROGRAMS.get(other, f"program {other}")] += s
    secs["host: optimizer, batching, copies in and out (step wall − device waits)"] = (
        wall_s - sum(waited.values()))
    rows = [{"objective": objective, "class": c, "calls": calls[c], "seconds": secs[c],
             "share": secs[c] / wall_s, "gflops": flops[c] / secs[c] / 1e9 if flops[c] else None}
            for c in sorted(secs, key=lambda c: -secs[c])]
    rows.append({"objective": objective, "class": "step wall", "calls": prog.recording.n_dispatches,
                 "seconds": wall_s, "share": 1.0, "gflops": None})
    return rows


def profile_sft(path=None) -> list[dict]:
    """The trainer's own step on one default batch (the default config: its adapters, TMKL, the
    frozen prefix), through train.loop.one_step."""
    from . import loop
    from .bench import default_job_run
    from .step import select
    from .trainer import SftObjective
    r = default_job_run(path)
    obj = SftObjective(r)
    loop.one_step(obj, r.params, r.stepper.opt, 0)              # compiles
    wall, waited = timed(lambda: loop.one_step(obj, r.params, r.stepper.opt, 1))
    micro = r.micro_batches(r.sampler.next())
    ids, labels = micro[0][:2]
    pos, lab = select(labels)
    x = r.stepper.prefix.feed(ids, labels)  # the stream entering the first adapted layer
    args = [x, pos, lab, np.ones(1, np.float32)]
    if r.stepper.base_cache is not None:
        args += r.stepper._chunks(r.stepper.base_cache.logits(ids, labels, pos, x))
    n = len(micro)
    return table(r.stepper.fn.program(*args), r.model.cfg.vocab_size, wall / n, "sft",
                 {k: v / n for k, v in waited.items()})


def profile_dpo(path=None) -> list[dict]:
    from . import loop
    from .bench import default_llama, dpo_objective
    model = default_llama(path)
    obj, params, opt = dpo_objective(model)
    loop.one_step(obj, params, opt, 0)
    wall, waited = timed(lambda: loop.one_step(obj, params, opt, 1))
    return table(obj.fn.program(*obj.last_args), model.cfg.vocab_size, wall, "dpo", waited)


def bench_or_profile(objective="sft", path=None, profile=False, checkpoint="none", plan=False,
                     shape="4x256", targets="qv,all", steps=0, lr=1e-4,
                     activations="fp32") -> list[dict]:
    """`vkdsl bench train [--objective dpo] [--by-kernel] [--checkpoint C] [--plan]`: the step's
    speed and memory, its planned memory, or where its time goes."""
    from .bench import bench_train
    if not profile:
        return bench_train(objective, path, checkpoint, plan, shape, targets, steps, lr,
                           activations)
    return profile_dpo(path) if objective == "dpo" else profile_sft(path)


def profile_bench_sft(shape: str = "4x256", targets: str = "qv", path=None) -> list[dict]:
    """The bench rows' SFT step (random tokens, every position supervised, no frozen prefix) by
    class."""
    from . import loop
    from .bench import (ALL, StepperObjective, _select_args, default_llama, parse_shape,
                        random_batch, sft_stepper, time_stepper)
    model = default_llama(path)
    ids, labels = random_batch(model, *parse_shape(shape))
    st, params = sft_stepper(model, ("attn_q", "attn_v") if targets == "qv" else ALL)
    time_stepper(model, st, params, [(ids, labels)], reps=0)     # compiles
    obj = StepperObjective(st, [(ids, labels)])
    wall, waited = timed(lambda: loop.one_step(obj, params, st.opt, 1))
    return table(st.fn.program(ids, *_select_args(labels)), model.cfg.vocab_size, wall,
                 f"sft {shape} {targets}", waited)


if __name__ == "__main__":
    # python -m vkdsl.train.profile [4x256] [qv|all] [MODEL]: the bench SFT row by kernel class
    import sys
    for r in profile_bench_sft(*sys.argv[1:4]):
        print(f"{r['class']:70s} calls={r['calls']:5d} seconds={r['seconds']:7.3f} "
              f"share={r['share']:.3f} "
              f"gflops={r['gflops'] if r['gflops'] is None else round(r['gflops'], 1)}")
