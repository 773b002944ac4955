"""The one training loop. Every stage is an objective (train.trainer.SftObjective,
train.dpo.DpoObjective) that supplies its data order, learning rate, and the step's gradient and
statistics summed over all ranks; this loop does the rest of a step, the same way for every stage:
non-finite stop (before the update), global-norm clip, AdamW, assign, replica check, record,
checkpoint, hooks.

An objective has: stage (its name in records), steps, order (next() / state() / set_state()),
lr(step), gradient(idx, step) -> (grads, record with "loss"), finite (the record keys that must be
finite), record(step, rec) (its log line and metrics row), clip."""
from __future__ import annotations

import math
import time

from . import evidence
from .distributed import check_replicas
from .step import apply

REPLICA_CHECK_EVERY = 5         # steps between the all-gathered adapter checksums of a parallel run


class TrainingStopped(RuntimeError):
    pass


class Interrupted(RuntimeError):
    """A stage ended at its stop_after step: what a kill there leaves (tests, probes)."""


def one_step(obj, params, opt, step, kept=lambda: "none") -> dict:
    """Optimizer step step + 1 of obj: batch, gradient, non-finite stop, update. -> its record
    (what `vkdsl bench train` times: the step vkdsl-train runs)."""
    t0 = time.perf_counter()
    idx = obj.order.next()
    lr = obj.lr(step + 1)
    gs, rec = obj.gradient(idx, step + 1)
    bad = [k for k in obj.finite if not math.isfinite(rec[k])]
    if bad:
        raise TrainingStopped(f"{obj.stage} step {step + 1}: non-finite "
                              f"{', '.join(f'{k} ({rec[k]})' for k in bad)}; stopped before "
                              f"applying it, the last good checkpoint (step {kept()}) is kept")
    rec["grad_norm"] = apply(params, opt, gs, lr, obj.clip)
    rec.update(lr=lr, time=time.perf_counter() - t0)
    return rec


def train(obj, params, opt, group, step=0, save=None, every=0, hooks=(), stop_after=None,
          kept=lambda: "none"):
    """Steps obj from `step` to obj.steps. save(step): the stage's checkpoint, every `every` steps.
    hooks: f(step, rec) after each step. stop_after: return early at that step (a simulated kill).
    kept(): the step of the last good checkpoint, for the non-finite message.
    -> (step reached, finished)."""
    while step < obj.steps:
        rec = one_step(obj, params, opt, step, kept)
        step += 1
        if group.size > 1 and (step % REPLICA_CHECK_EVERY == 0 or step == obj.steps):
            check_replicas(group, evidence.checksum([p.numpy() for p in params]), step)
        obj.record(step, rec)
        if save is not None and every and step % every == 0:
            save(step)
        for h in hooks:
            h(step, rec)
        if stop_after is not None and step >= stop_after:
            return step, False
    return step, True
