"""Learning rate: linear warmup to the peak, then cosine decay to peak * min_lr_ratio at the last
step."""
from __future__ import annotations

import math


def lr_at(step: int, peak: float, steps: int, warmup: int, floor: float) -> float:
    """The one schedule of every stage (SFT: sft_lr; DPO: dpo_lr, no warm-up). step counts from 1;
    floor is min_lr_ratio."""
    if warmup and step <= warmup:
        return peak * step / warmup
    span = max(steps - warmup, 1)
    frac = min(max(step - warmup, 0) / span, 1.0)
    lo = peak * floor
    return lo + (peak - lo) * 0.5 * (1 + math.cos(math.pi * frac))


def sft_lr(step: int, cfg) -> float:
    return lr_at(step, cfg.lr, cfg.steps, cfg.warmup, cfg.min_lr_ratio)


def checkpoints(cfg) -> list[tuple[str, int, float]]:
    """(label, step, lr) at warmup end and 25/50/75/100% of the run."""
    pts = [("warmup end", max(cfg.warmup, 1))] + [(f"{p}%", max(1, round(cfg.steps * p / 100)))
                                                  for p in (25, 50, 75, 100)]
    return [(n, s, sft_lr(s, cfg)) for n, s in pts]
