"""The device-memory plan of a run, made before its weights reach the device (the model is built
with them on the host: vkdsl.realize.deferred_uploads) and before any program is built: the weights
as stored, the adapters, and the programs the run holds -- the SFT step (saved activations, the
recompute working set, the LM head's chunks, TMKL's base logits), the DPO step (built after the SFT
step is released, so the larger of the two counts), the frozen prefix and the evaluation, which
scores the DPO pairs too -- each traced and scheduled at the largest batch the settings and rows
allow (vkdsl.Traced.plan: the same buffer slots the program allocates). A run over its budget is
refused here with the plan and settings that fit (`vkdsl-train --plan` prints it); one that fits
then uploads its weights (upload_weights).

A step is planned at the most supervised positions a micro-batch of its rows can hold
(head_rows). With `window` every SFT step has exactly that shape, one program; without it each
other bucketed length a run meets builds another program no larger than the planned one, kept
while the device has room and released, least recently used first, when a program needs it
(vkdsl.trace): the plan is what must fit, the peak may pass it where memory was free."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from vkdsl.realize import upload_all
from vkdsl.runtime import default_device
from vkdsl.runtime.context import parse_bytes

from . import dpo
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


def _batch(r, B, T, n) -> tuple:
    """(feed, pos, labels) of a B x T batch whose head takes n rows: what a traced step or scoring
    function is planned at (the feed is the frozen prefix's stream when there is one)."""
    lab = np.full(B * T, IGNORE, np.int32)
    lab[:n] = 0
    pos, lab = select(lab.reshape(B, T), size=n)
    feed = (np.zeros((B, T, r.model.cfg.dim), np.float32) if r.prefix.start
            else np.zeros((B, T), np.int32))
    return feed, pos, lab


def step_bytes(r, cfg) -> int:
    """Device bytes of the SFT step's program at the largest micro-batch (nothing built)."""
    from .step import Stepper
    m, rows = r.model, r.train
    stepper = r.stepper if cfg is r.cfg else Stepper(m, r.params, cfg, r.prefix)
    B, T = _largest(cfg, rows)
    feed, pos, lab = _batch(r, B, T, head_rows(rows, cfg))
    inv = np.ones(1, np.float32)
    base = () if stepper.base_cache is None else tuple(
        split_rows(np.zeros((len(pos), m.cfg.vocab_size), np.float32), m.logit_rows))
    if cfg.window:
        pk = Packing.plan([T] * B, T, min_seq=B)
        return stepper.fn_packed.plan(feed, pos, lab, inv, pk.positions(), pk.spans(),
                                      *base)["total"]
    return stepper.fn.plan(feed, pos, lab, inv, *base)["total"]


def dpo_step_bytes(r, cfg) -> int:
    """Device bytes of the DPO step's program at its largest pair batch (nothing built): chosen and
    rejected sides each at their longest bucketed length and most supervised positions."""
    pairs = r.pairs[0]
    B = min(cfg.dpo_batch, len(pairs))
    args = []
    for side in ("chosen", "rejected"):
        rows = [getattr(p, side) for p in pairs]
        T = bucket_len(max(len(x.ids) for x in rows), cfg.bucket, cfg.max_len)
        feed, pos, lab = _batch(r, B, T,
                                head_rows(rows, dataclasses.replace(cfg, batch_size=B, window=0)))
        args += [feed, pos, lab, dpo.segments(pos, lab, T, B)]
    fn = dpo.build_dpo_step(r.model, r.params, cfg.dpo_beta, cfg.dpo_nll_weight, r.prefix.start,
                            cfg.checkpoint_layers, cfg.activations)
    return fn.plan(*args, np.zeros(B, np.float32), np.ones(1, np.float32))["total"]


def score_bytes(r, cfg, rows) -> int:
    """Device bytes of one scoring program (train.scoring) at the largest evaluation batch of these
    rows."""
    E, T = _largest(dataclasses.replace(cfg, batch_size=cfg.eval_batch, window=0), rows)
    n = head_rows(rows, dataclasses.replace(cfg, batch_size=E, window=0))
    return r.scorer.fns[True].plan(*_batch(r, E, T, n))["total"]


# never alive together (the SFT step is released when its loop ends, the final evaluation's fp32
# base when its decisions are taken): the largest of them counts
STAGES = ("sft step", "dpo step", "fp32 base check")


def plan(r, cfg=None) -> dict:
    """The run's planned device bytes by part, their total and the budget (under other settings
    cfg: the same model, adapters and rows)."""
    cfg = cfg or r.cfg
    m = r.model
    parts = {"weights": m.device_bytes()["device_bytes"] + m.table_bytes,     # RoPE tables too
             "adapters": sum(p.size * 4 for p in r.params)}
    if cfg.objective != "dpo":                     # a DPO-only run builds no SFT step
        parts["sft step"] = step_bytes(r, cfg)
    if "dpo" in cfg.objective:
        parts["dpo step"] = dpo_step_bytes(r, cfg)
    B, T = _largest(cfg, r.train)
    if r.prefix.start:
        parts["frozen prefix"] = r.prefix.fn.plan(np.zeros((B, T), np.int32))["total"]
    scored = r.heldout + r.passages + [x for p in (r.pairs[0] + r.pairs[1] if r.pairs else [])
                                       for x in (p.chosen, p.rejected)]
    if scored:                                     # adapters on, and off
        parts["evaluation"] = 2 * score_bytes(r, cfg, scored)
    n = min(cfg.stability_rows, len(r.heldout)) if r.held.labels else 0
    if n and cfg.quant != "none" and cfg.objective != "dpo":
        parts["fp32 base check"] = (m.device_bytes()["fp32_bytes"] + m.table_bytes
                                    + score_bytes(r, cfg, r.heldout[:n]))
    total = sum(v for k, v in parts.items() if k not in STAGES)
    total += max((parts[k] for k in STAGES if k in parts), default=0)
    return {"parts": parts, "total": total, "budget": budget(cfg),
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
    if sum(k in p["parts"] for k in STAGES) > 1:
        out.append(f"  ({', '.join(k for k in STAGES if k in p['parts'])}: one at a time, the "
                   f"largest counts)")
    out.append(f"  {'total':<14} {p['total'] / MiB:9.1f} MiB of a {p['budget'] / MiB:.0f} "
               f"MiB budget"
               + ("" if cfg.window else "; programs of other row lengths are kept while "
                  "there is room"))
    return out


def alternatives(cfg):
    """Settings that need less memory, most faithful first: checkpointing at the same batch, then
    fewer rows (windows) per micro-batch with more accumulation (the same optimizer step); each
    with the evaluation batch as it is, then halved; then all that without the fp32 base check of
    the final evaluation (stability_rows = 0: one evidence line less); last, the same with fp16
    saved activations (gradients no longer exact) where the device has 16-bit storage."""
    def halvings(n):
        while True:
            yield n
            if n == 1 or n % 2:
                return
            n //= 2
    acts = ([cfg.activations]
            + (["fp16"] if cfg.activations != "fp16" and default_device().limits.storage16 else []))
    now = (cfg.checkpoint, cfg.batch_size, cfg.eval_batch, cfg.stability_rows, cfg.activations)
    return [dataclasses.replace(cfg, checkpoint=ck, batch_size=b, eval_batch=e, stability_rows=st,
                                activations=a, grad_accum=cfg.grad_accum * (cfg.batch_size // b))
            for a in acts for st in dict.fromkeys([cfg.stability_rows, 0])
            for b in halvings(cfg.batch_size) for e in halvings(cfg.eval_batch)
            for ck in dict.fromkeys([cfg.checkpoint, "layers"]) if (ck, b, e, st, a) != now]


def peak_line(p) -> str:
    """The device's peak allocation so far against the plan (said after each stage)."""
    peak = default_device().peak_bytes
    return (f"device memory: peak {peak / MiB:.1f} MiB, planned {p['total'] / MiB:.1f} MiB "
            f"({peak / p['total']:.2f}x the plan"
            + ("; programs of other row lengths kept while there was room)" if peak > p["total"]
               else ")"))


def upload_weights(r):
    """The run's weights onto the device once its plan has passed (a weight some program used
    already is there)."""
    t0 = time.perf_counter()
    n = upload_all(r.pending)
    r.pending = []
    if n:
        r.r.say(f"weights: {n / MiB:.1f} MiB onto the device in {time.perf_counter() - t0:.1f}s")


def check(r, say) -> dict:
    """Plan the run; refuse it in one line when it exceeds the budget, naming settings that fit."""
    p = plan(r)
    for line in lines(p, r.cfg):
        say(line)
    if p["total"] <= p["budget"]:
        return p
    hint = next((c for c in alternatives(r.cfg) if plan(r, c)["total"] <= p["budget"]), None)
    if hint is None:
        fix = ("no checkpointing, batch split, stability_rows = 0 or fp16 activations fits: "
               "shorten max_len/window or quantize the base")
    else:
        more = [f"{k} = {getattr(hint, k)}" for k in ("stability_rows", "activations")
                if getattr(hint, k) != getattr(r.cfg, k)]
        fix = (", ".join([f"checkpoint = {hint.checkpoint}, batch_size = {hint.batch_size}, "
                          f"grad_accum = {hint.grad_accum}, eval_batch = {hint.eval_batch}"] + more)
               + " fits")
    big = ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in p["parts"].items() if v >= MiB)
    raise MemoryPlanError(f"the run needs {p['total'] / MiB:.0f} MiB of device memory ({big}) and "
                          f"the budget is {p['budget'] / MiB:.0f} MiB: {fix}")
