"""Learning rate: linear warmup to lr, then cosine decay to lr * min_lr_ratio at the last step."""
from __future__ import annotations

import math


def lr_at(step: int, cfg) -> float:
    """step counts from 1."""
    if cfg.warmup and step <= cfg.warmup:
        return cfg.lr * step / cfg.warmup
    span = max(cfg.steps - cfg.warmup, 1)
    frac = min(max(step - cfg.warmup, 0) / span, 1.0)
    lo = cfg.lr * cfg.min_lr_ratio
    return lo + (cfg.lr - lo) * 0.5 * (1 + math.cos(math.pi * frac))


def checkpoints(cfg) -> list[tuple[str, int, float]]:
    """(label, step, lr) at warmup end and 25/50/75/100% of the run."""
    pts = [("warmup end", max(cfg.warmup, 1))] + [(f"{p}%", max(1, round(cfg.steps * p / 100)))
                                                  for p in (25, 50, 75, 100)]
    return [(n, s, lr_at(s, cfg)) for n, s in pts]
