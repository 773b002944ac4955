"""The device-memory plan of an SFT run, made once the weights are on the device and before any
program is built: the weights as stored, the adapters, and the programs the run holds while it
trains -- the step (saved activations, the recompute working set, the LM head's chunks, TMKL's base
logits), the frozen prefix and the evaluation -- each traced and scheduled at the largest batch the
settings allow (vkdsl.Traced.plan: the same buffer slots the program allocates). A run over its
budget is refused here with the plan and settings that fit (`vkdsl-train --plan` prints it).

The step is planned at the most supervised positions a micro-batch of the training rows can hold
(head_rows). With `window` every step has exactly that shape, one program; without it each other
bucketed length a run meets builds another program no larger than the planned one (the plan says
so)."""
from __future__ import annotations

import dataclasses

import numpy as np

from vkdsl.runtime import default_device
from vkdsl.runtime.context import parse_bytes

from .data import IGNORE, bucket_len
from .packing import Packing
from .step import select, split_rows

MiB = 2 ** 20


class MemoryPlanError(ValueError):
    pass


def _largest(cfg, rows):
    """(rows or windows per micro-batch, tokens per sequence) of the largest micro-batch of rows."""
    longest = max((len(r.ids) for r in rows), default=1)
    return cfg.batch_size, cfg.window or bucket_len(longest, cfg.bucket, cfg.max_len)


def head_rows(rows, cfg) -> int:
    """An upper bound on the supervised positions of one micro-batch of these rows, a multiple of
    16: the B most supervised rows, or with windows the fractional knapsack of B windows' tokens
    (rows by supervised share, the last one in part), which no packing can exceed."""
    B, T = _largest(cfg, rows)
    sup = sorted(((sum(x != IGNORE for x in r.labels), len(r.ids)) for r in rows),
                 key=lambda s: -s[0] / max(s[1], 1) if cfg.window else -s[0])
    room, n = B * T if cfg.window else B, 0
    for s, length in sup:
        take = min(length, room) if cfg.window else 1
        n += s * take / length if cfg.window else s
        room -= take
        if room <= 0:
            break
    return min(B * T, 16 * -(-int(np.ceil(n)) // 16))


def _supervised(B, T, n) -> np.ndarray:
    """(B, T) labels with n positions supervised: a batch whose head takes n rows."""
    lab = np.full(B * T, IGNORE, np.int32)
    lab[:n] = 0
    return lab.reshape(B, T)


def step_bytes(r, cfg) -> int:
    """Device bytes of the SFT step's program at the largest micro-batch (nothing built)."""
    from .step import Stepper
    m, rows = r.model, r.train
    stepper = r.stepper if cfg is r.cfg else Stepper(m, r.params, cfg, r.prefix)
    B, T = _largest(cfg, rows)
    n = head_rows(rows, cfg)
    pos, lab = select(_supervised(B, T, n), size=n)
    inv = np.ones(1, np.float32)
    feed = (np.zeros((B, T), np.int32) if not stepper.prefix.start
            else np.zeros((B, T, m.cfg.dim), np.float32))
    base = () if stepper.base_cache is None else tuple(
        split_rows(np.zeros((len(pos), m.cfg.vocab_size), np.float32), m.logit_rows))
    if cfg.window:
        pk = Packing.plan([T] * B, T, min_seq=B)
        return stepper.fn_packed.plan(feed, pos, lab, inv, pk.positions(), pk.spans(),
                                      *base)["total"]
    return stepper.fn.plan(feed, pos, lab, inv, *base)["total"]


def plan(r, cfg=None) -> dict:
    """The run's planned device bytes by part, their total and the budget (under other settings
    cfg: the same model, adapters and rows)."""
    cfg = cfg or r.cfg
    m = r.model
    parts = {"weights": m.device_bytes()["device_bytes"],
             "adapters": sum(p.size * 4 for p in r.params)}
    if cfg.objective != "dpo":                     # a DPO-only run builds no SFT step
        parts["sft step"] = step_bytes(r, cfg)
    B, T = _largest(cfg, r.train)
    if r.prefix.start:
        parts["frozen prefix"] = r.prefix.fn.plan(np.zeros((B, T), np.int32))["total"]
    scored = r.heldout + r.passages
    if scored:
        E, T = _largest(dataclasses.replace(cfg, batch_size=cfg.eval_batch, window=0), scored)
        n = head_rows(scored, dataclasses.replace(cfg, batch_size=E, window=0))
        pos, lab = select(_supervised(E, T, n), size=n)
        feed = (np.zeros((E, T, m.cfg.dim), np.float32) if r.prefix.start
                else np.zeros((E, T), np.int32))
        # adapters on, and off
        parts["evaluation"] = 2 * r.scorer.fns[True].plan(feed, pos, lab)["total"]
    return {"parts": parts, "total": sum(parts.values()), "budget": budget(cfg),
            "shape": _largest(cfg, r.train)}


def budget(cfg) -> int:
    """--device-memory, or what this device lets vkdsl allocate (its heap,
    $VKDSL_DEVICE_MEMORY_LIMIT)."""
    return parse_bytes(cfg.device_memory) if cfg.device_memory else default_device().memory_budget


def lines(p, cfg) -> list[str]:
    B, T = p["shape"]
    what = f"{B} window(s) of {T} tokens" if cfg.window else f"{B} rows of {T} tokens"
    out = [f"device memory plan ({what} a micro-batch, checkpoint {cfg.checkpoint}, "
           f"activations {cfg.activations}):"]
    out += [f"  {k:<14} {v / MiB:9.1f} MiB" for k, v in p["parts"].items()]
    out.append(f"  {'total':<14} {p['total'] / MiB:9.1f} MiB of a {p['budget'] / MiB:.0f} "
               f"MiB budget"
               + ("" if cfg.window
                  else "; each other row length met adds a step program no larger"))
    return out


def alternatives(cfg):
    """Settings that need less memory, most faithful first: checkpointing at the same batch, then
    fewer rows (windows) per micro-batch with more accumulation (the same optimizer step); each
    with the evaluation batch as it is, then halved; last, the same with fp16 saved activations
    (gradients no longer exact) where the device has 16-bit storage."""
    def halvings(n):
        while True:
            yield n
            if n == 1 or n % 2:
                return
            n //= 2
    acts = ([cfg.activations]
            + (["fp16"] if cfg.activations != "fp16" and default_device().limits.storage16 else []))
    return [dataclasses.replace(cfg, checkpoint=ck, batch_size=b, eval_batch=e, activations=a,
                                grad_accum=cfg.grad_accum * (cfg.batch_size // b))
            for a in acts for b in halvings(cfg.batch_size) for e in halvings(cfg.eval_batch)
            for ck in dict.fromkeys([cfg.checkpoint, "layers"])
            if (ck, b, e, a) != (cfg.checkpoint, cfg.batch_size, cfg.eval_batch, cfg.activations)]


def peak_line(p) -> str:
    """The device's peak allocation so far against the plan (said after the SFT stage)."""
    peak = default_device().peak_bytes
    return (f"device memory: peak {peak / MiB:.1f} MiB, planned {p['total'] / MiB:.1f} MiB "
            f"({peak / p['total']:.2f}x the plan)")


def check(r, say) -> dict:
    """Plan the run; refuse it in one line when it exceeds the budget, naming settings that fit."""
    p = plan(r)
    for line in lines(p, r.cfg):
        say(line)
    if p["total"] <= p["budget"]:
        return p
    hint = next((c for c in alternatives(r.cfg) if plan(r, c)["total"] <= p["budget"]), None)
    if hint is None:
        fix = ("no checkpointing, batch split or fp16 activations fits: shorten max_len/window or "
               "quantize the base")
    else:
        fp16 = (f", activations = {hint.activations}"
                if hint.activations != r.cfg.activations else "")
        fix = (f"checkpoint = {hint.checkpoint}, batch_size = {hint.batch_size}, grad_accum = "
               f"{hint.grad_accum}, eval_batch = {hint.eval_batch}{fp16} fits")
    big = ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in p["parts"].items() if v >= MiB)
    raise MemoryPlanError(f"the run needs {p['total'] / MiB:.0f} MiB of device memory ({big}) and "
                          f"the budget is {p['budget'] / MiB:.0f} MiB: {fix}")
