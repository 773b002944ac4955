"""What the model probes share: a training configuration from the trainer's defaults, a Run
opened or trained in the probe's work folder (the base evaluation computed once per probe and
reused by every later run, under the trainer's own key check), and spectrum statistics."""
from __future__ import annotations

import shutil

import numpy as np

from ..config import TrainConfig
from ..progress import Reporter
from ..checkpoint import BASE_EVAL
from ..trainer import Run, run
from .base import ProbeError


# evidence no probe table shows (failures generated verbatim, the fp32-base decisions, merged
# logits): off unless the probe's --config asks for it
QUIET_EVIDENCE = {"format_examples": 0, "stability_rows": 0, "merge_check_rows": 0}


def config(ctx, tag: str, **over) -> TrainConfig:
    d = ctx.work / tag
    d.mkdir(parents=True, exist_ok=True)
    return TrainConfig(**{**QUIET_EVIDENCE, **ctx.train, "model": ctx.model, "verify": False,
                          "quiet": True, "out": str(d), **over}).validate()


def open_run(ctx, tag: str, **over) -> Run:
    """A Run (model loaded, adapters injected, data read), not trained; its log in WORK/tag."""
    cfg = config(ctx, tag, **over)
    return Run(cfg, cfg.out, Reporter(ctx.work / tag / "train.log", quiet=True), files=ctx.files())


def train_run(ctx, tag: str, at_step=None, reuse=None, final=True, **over) -> Run:
    """trainer.run in WORK/tag with the base evaluation shared across the probe's runs."""
    cfg = config(ctx, tag, **over)
    shared = ctx.work / BASE_EVAL
    if shared.is_file():
        shutil.copyfile(shared, ctx.work / tag / BASE_EVAL)
    ctx.say(f"  training {tag} ...")
    r = run(cfg, cfg.out, at_step=at_step, reuse=reuse, final=final, files=ctx.files())
    if (ctx.work / tag / BASE_EVAL).is_file():
        shutil.copyfile(ctx.work / tag / BASE_EVAL, shared)
    return r


def sample(rows: list, n: int) -> list:
    """A fixed random sample of n rows (the same every run, file order kept); all of them when n
    is 0 or >= len. Random, not every k-th: files often cycle through their categories."""
    if not 0 < n < len(rows):
        return rows
    return [rows[i] for i in sorted(np.random.default_rng(0).choice(len(rows), n, replace=False))]


def need_labels(r, probe: str):
    if not r.held.labels or not r.heldout:
        raise ProbeError(f"probe {probe} needs held-out rows whose completion is one of the labels "
                         f"({', '.join(r.cfg.labels)}); {r.cfg.heldout_file} has none")


def need_template(tok, probe: str, model: str):
    if not tok.chat_template:
        raise ProbeError(f"probe {probe} needs a model with a chat template (its rows are "
                         f"chat turns); {model or 'the default model'} has none")


def spectrum_stats(dw: np.ndarray, fractions=(0.5, 0.9, 0.95, 0.99)) -> dict:
    """Singular values of an update: directions holding each fraction of ||dW||_F^2, stable rank
    ||dW||_F^2 / sigma_1^2, the smallest singular value."""
    sv = np.linalg.svd(np.asarray(dw, np.float64), compute_uv=False)
    e = np.cumsum(sv ** 2) / max(float(np.sum(sv ** 2)), 1e-300)
    out = {"fro": float(np.sqrt(np.sum(sv ** 2))), "sv": sv,
           "stable_rank": float(np.sum(sv ** 2) / sv[0] ** 2) if sv[0] > 0 else 0.0,
           "smallest": float(sv[-1])}
    for f in fractions:
        out[f"n{int(round(100 * f))}"] = int(np.searchsorted(e, f - 1e-12) + 1)
    return out
