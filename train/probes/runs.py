"""Probes made of whole training runs (the trainer's own, in the probe's work folder): seeds of the
bundled support-ticket task, the prompt-mask negative control, rehearsal weights over
checkpoints, and seeds of DPO with the reference-free control. Runs of one probe share the loaded
base, the frozen-prefix rows, the cached base logits and the base evaluation (Run(reuse=...))."""
from __future__ import annotations

import shutil

import numpy as np

from ..config import DATA
from ..data import IGNORE
from ..evidence import mean_loss, wilson
from ..stages import dpo_stage
from .base import Expectation, ProbeError, Result, probe
from .common import need_labels, need_template, sample, train_run


def _train_accuracy(r, n_rows):
    rows = sample(r.train, n_rows)
    idx, lp = r.held.label_logprobs(rows, True)
    truth = [r.cfg.labels.index(rows[i].completion.strip()) for i in idx]
    return (float(np.mean(lp.argmax(1) == np.array(truth))) if idx else None), len(idx)


def _ci(f):
    lo, hi = f.heldout_acc_ci
    return f"{f.heldout_acc:.3f} [{lo:.3f}, {hi:.3f}]"


@probe("tickets",
       "the bundled support-ticket task over seeds: train and held-out accuracy (Wilson 95%), "
       "target probability within the labels, preservation change, per seed", needs_model=True,
       minutes="4.5 min", seeds=3, steps=12, train_rows=32)
def tickets(ctx) -> Result:
    """The trainer's default SFT (+ TMKL) on the bundled task (12 steps here, the default run's 16
    with --set steps=16), once per adapter seed over the same rows in the same order: the seed
    measures optimization instability on a fixed sample, so the seeds are reported side by side
    and never pooled into one count (the rows are shared)."""
    need_template(ctx.files()[1], "tickets", ctx.model)
    rows, prev = [], None
    for s in range(ctx.seeds):
        r = train_run(ctx, f"seed{s}", reuse=prev, seed=s, objective="sft",
                      steps=ctx.params["steps"])
        need_labels(r, "tickets")
        prev, f = r, r.final
        acc, n_acc = _train_accuracy(r, ctx.params["train_rows"])
        if s == 0:
            k, n = r.base.heldout_correct, r.base.heldout_n
            lo, hi = wilson(k, n)
            rows.append({"seed": "base (adapter off)", "train loss": None, "train accuracy": None,
                         "held-out accuracy, Wilson 95%": f"{k / n:.3f} [{lo:.3f}, {hi:.3f}]",
                         "target probability": None, "preservation change": 0.0})
        rows.append({"seed": s, "train loss": f.train_loss, "train accuracy": acc,
                     "held-out accuracy, Wilson 95%": _ci(f),
                     "target probability": f.heldout_target_prob,
                     "preservation change": f.preservation_delta, "_lo": f.heldout_acc_ci[0],
                     "_base": f.heldout_acc_base, "_first": r.first_loss, "_n": f.heldout_n})
    seeds = [x for x in rows if isinstance(x["seed"], int)]
    ex = [Expectation("every seed's training loss falls",
                      ", ".join(f"{x['_first']:.2f} -> {x['train loss']:.3f}"
                                                                  for x in seeds),
                      all(x["train loss"] < x["_first"] for x in seeds)),
          Expectation("every seed beats the base beyond sampling noise (Wilson lower bound > base "
                      "accuracy)",
                      ", ".join(f"seed {x['seed']}: {x['_lo']:.3f} vs {x['_base']:.3f}"
                                for x in seeds), all(x["_lo"] > x["_base"] for x in seeds),
                      structural=False)]
    for x in seeds:
        for k in ("_lo", "_base", "_first", "_n"):
            x.pop(k)
    return Result(f"tickets: {ctx.seeds} seeds of the bundled task ({len(prev.train)} "
                  f"training rows, {seeds and prev.final.heldout_n} held-out)", list(rows[1]), rows,
                  ex, notes=[f"train accuracy over {n_acc} of the {len(prev.train)} training rows, "
                             f"a fixed random sample (--set train_rows=0: every row)",
                             "target probability: the true label's probability renormalized within "
                             "the label set (softmax over the labels' log-probs), not the model's "
                             "probability of emitting it",
                             "the Wilson intervals assume independent rows; the seeds share rows, "
                             "so they are not independent trials and are not pooled"])


@probe("prompt-mask",
       "the negative control: loss on every token vs on the response only, same rows: held-out "
       "accuracy and preservation damage of each, and their ratio", needs_model=True,
       minutes="4.1 min", steps=16)
def prompt_mask(ctx) -> Result:
    """Two runs that differ in one setting, loss_on: completion (the prompt and template masked,
    the default) or all (every token of the row scored). Same seed, rows, rank, steps and learning
    rate; evaluation scores the completions in both."""
    need_template(ctx.files()[1], "prompt-mask", ctx.model)
    rows, prev = [], None
    for arm in ("completion", "all"):
        r = train_run(ctx, f"loss-on-{arm}", reuse=prev, loss_on=arm, objective="sft", tmkl=0.0,
                      steps=ctx.params["steps"])
        need_labels(r, "prompt-mask")
        prev, f = r, r.final
        sup = sum(sum(1 for t in x.labels if t != IGNORE) for x in r.train)
        rows.append({"loss on": "response only" if arm == "completion" else "every token",
                     "supervised tokens": sup, "held-out loss": f.heldout_loss,
                     "held-out accuracy, Wilson 95%": _ci(f),
                     "preservation change": f.preservation_delta, "_first": r.first_loss,
                     "_last": f.train_loss})
    a, b = rows
    ratio = (b["preservation change"] / a["preservation change"] if a["preservation change"] > 0
             else None)
    ex = [Expectation("both runs lower their own training loss",
                      f"{a['_first']:.2f} -> {a['_last']:.3f}; "
                      f"{b['_first']:.2f} -> {b['_last']:.3f}",
                      a["_last"] < a["_first"] and b["_last"] < b["_first"]),
          Expectation("the all-token run scores more tokens (the prompt's)",
                      f"{b['supervised tokens']} vs {a['supervised tokens']}",
                      b["supervised tokens"] > a["supervised tokens"]),
          Expectation("scoring the prompt damages preservation more than masking it",
                      f"{b['preservation change']:+.4f} vs {a['preservation change']:+.4f} "
                      f"nats/token"
                      + (f" (ratio {ratio:.2f})" if ratio else ""),
                      b["preservation change"] > a["preservation change"], structural=False)]
    for x in rows:
        x.pop("_first"), x.pop("_last")
    return Result("prompt-mask: response-only vs all-token loss, seed 0, same rows and settings",
                  list(rows[0]), rows, ex,
                  notes=[f"damage ratio (all-token / response-only preservation change): "
                         f"{ratio:.2f}" if ratio
                         else "the response-only run did not damage preservation"])


@probe("rehearsal",
       "general-text rehearsal weights 0 / 0.1 / 1 against a disjoint preservation set, at "
       "checkpoints: task loss, held-out accuracy, preservation change", needs_model=True,
       minutes="4.7 min", weights=[0.0, 0.1, 1.0], checkpoints=[1, 10, 20, 40], layers="last:4",
       targets=["attn_q", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"], batch_size=1,
       rehearsal_batch=1, task_rows=8, rehearsal_rows=8, bounds={"weights": (0.0, None)})
def rehearsal(ctx) -> Result:
    """objective = task mean + w * general-text mean; the rehearsal text (bundled rehearsal.jsonl)
    makes gradients, the preservation text (preservation.jsonl, no sentence shared) only measures.
    Plain SFT (no TMKL) with adapters on the top layers only, so that rehearsal is the only force
    toward general text. The task loss is the mean over a fixed random sample of task_rows training
    rows, the rehearsal text's over rehearsal_rows of its passages (0: every row of each)."""
    p = ctx.params
    cps = sorted(set(p["checkpoints"]))
    reh = ctx.train.get("rehearsal_file") or str(DATA / "rehearsal.jsonl")
    rows, prev = [], None
    for w in p["weights"]:
        marks = []

        def at(r, w=w, marks=marks):
            if r.step in cps:
                task = sample(r.train, p["task_rows"])
                sc = r.held.scores(True, with_format=False)
                marks.append({"weight": w, "step": r.step,
                              "task loss": mean_loss(r.scorer.row_logprobs(task, True)),
                              "held-out accuracy": sc.acc,
                              "preservation change": sc.pres - r.base.preservation_loss,
                              "rehearsal text loss": mean_loss(r.scorer.row_logprobs(
                                  sample(r.rehearsal, p["rehearsal_rows"]), True))})
        r = train_run(ctx, f"weight-{w:g}", at_step=at, reuse=prev, final=False, objective="sft",
                      tmkl=0.0, steps=cps[-1], targets=p["targets"], layers=p["layers"],
                      batch_size=p["batch_size"], rehearsal_file=reh,
                      rehearsal_batch=p["rehearsal_batch"], rehearsal_weight=w, eval_every=0,
                      checkpoint_every=0)
        need_labels(r, "rehearsal")
        prev = r
        rows += marks
    if set(str(x) for x in _texts(reh)) & set(str(x) for x in _texts(prev.cfg.preservation_file)):
        raise ProbeError(f"rehearsal: {reh} shares sentences with the preservation set "
                         f"{prev.cfg.preservation_file}; they must be disjoint")
    ex = [Expectation("every weight's task loss falls from its first checkpoint to its last",
                      "; ".join(f"w={w:g}: {_at(rows, w, cps[0])['task loss']:.3f} -> "
                                f"{_at(rows, w, cps[-1])['task loss']:.3f}" for w in p["weights"]),
                      all(_at(rows, w, cps[-1])["task loss"] < _at(rows, w, cps[0])["task loss"]
                          for w in p["weights"])),
          Expectation("the rehearsal text's own loss is lower the larger its weight (last "
                      "checkpoint)",
                      ", ".join(f"w={w:g}: {_at(rows, w, cps[-1])['rehearsal text loss']:.3f}"
                                for w in p["weights"]),
                      _monotone([_at(rows, w, cps[-1])["rehearsal text loss"]
                                 for w in sorted(p["weights"])]), structural=False)]
    return Result(f"rehearsal: weights {', '.join(f'{w:g}' for w in p['weights'])} at steps "
                  f"{', '.join(map(str, cps))} ({', '.join(p['targets'])} on {p['layers']}, batch "
                  f"{p['batch_size']} + {p['rehearsal_batch']} rehearsal rows, plain SFT)",
                  list(rows[0]), rows, ex,
                  notes=["preservation change is against the untouched base on passages disjoint "
                         "from the rehearsal text; choosing a checkpoint by it would make it "
                         "validation data",
                         f"task loss over a fixed random sample of {p['task_rows']} training rows, "
                         f"rehearsal text loss over {p['rehearsal_rows']} of its passages (--set "
                         f"task_rows=0 / rehearsal_rows=0: all)"])


def _texts(path):
    from ..data import text_lines
    return [line.strip() for _, line in text_lines(path) if line.strip()]


def _at(rows, w, step):
    return next(x for x in rows if x["weight"] == w and x["step"] == step)


def _monotone(xs):
    return all(b <= a for a, b in zip(xs, xs[1:]))


@probe("dpo-drift",
       "seeds of DPO from the base: loss, margin improvement, chosen and rejected drift (the "
       "share of the margin from lowering rejected), preservation; and the reference-free control",
       needs_model=True, minutes="4.1 min", seeds=2, dpo_steps=6)
def dpo_drift(ctx) -> Result:
    """DPO alone (no SFT) on the bundled preference pairs, reference = the base, once per seed;
    then one run with no reference (the control: the loss sees only the policy's own margin).
    Drifts are mean log-prob changes of the held-out responses against the base."""
    need_template(ctx.files()[1], "dpo-drift", ctx.model)
    rows, prev = [], None
    arms = [(s, "base") for s in range(ctx.seeds)] + [(0, "none")]
    for s, ref in arms:
        tag = f"seed{s}" if ref == "base" else "reference-free"
        cfg_over = dict(objective="dpo", reference=ref, seed=s, data_seed=s,
                        dpo_steps=ctx.params["dpo_steps"])
        r = train_run(ctx, tag, reuse=prev, **cfg_over)
        if not r.cfg.dpo_train_file:
            raise ProbeError("dpo-drift needs preference pairs (dpo_train_file)")
        if prev is not None and (prev.dir / "dpo_reference.json").is_file() and ref == "base":
            shutil.copyfile(prev.dir / "dpo_reference.json", r.dir / "dpo_reference.json")
        prev = r
        ev = dpo_stage(r)
        h = ev.heldout or ev.train
        if ref == "none":  # drifts against the base need the base's log-probs: score them here
            h = _against_base(r, ev)
        margin = h.chosen_drift - h.rejected_drift
        share = -h.rejected_drift / margin if margin > 0 and h.rejected_drift < 0 else None
        losses = [x["dpo_loss"] - x["nll"] for x in r.dpo_history]  # the preference term (no NLL)
        rows.append({"run": f"seed {s}" if ref == "base" else "reference-free (control)",
                     "loss first": losses[0], "loss last": losses[-1],
                     "pair accuracy": h.pair_accuracy, "margin improvement": h.margin_improvement,
                     "chosen drift": h.chosen_drift, "rejected drift": h.rejected_drift,
                     "share from lowering rejected": share,
                     "preservation change": ev.preservation_delta})
    seeded = rows[:-1]
    ex = [Expectation("with the base as reference, the first DPO preference loss is ln 2 (policy "
                      "== reference)", ", ".join(f"{x['loss first']:.6f}" for x in seeded),
                      all(abs(x["loss first"] - np.log(2)) < 1e-4 for x in seeded)),
          Expectation("DPO widens the held-out margin in every seed", ", ".join(
              f"{x['margin improvement']:+.3f}" for x in seeded),
                      all(x["margin improvement"] > 0 for x in seeded),
              structural=False)]
    return Result(f"dpo-drift: {ctx.seeds} seeds of DPO from the base + the reference-free "
                  f"control, {ctx.params['dpo_steps']} steps each", list(rows[0]), rows, ex,
                  notes=["drift = mean change of a response's summed log-prob vs the base (nats "
                         "per pair); a margin can grow while both responses fall"])


def _against_base(r, ev):
    """Held-out pair evidence of a reference-free run measured against the base (adapter off)."""
    from ..dpo import dpo_evidence, load_pairs, reference_logps
    cfg = r.cfg
    path = cfg.dpo_heldout_file or cfg.dpo_train_file
    pairs, _ = load_pairs(path, r.tok, cfg.chat_template, cfg.max_len, cfg.truncation_side)
    bc, br = reference_logps(r.scorer, pairs, False)
    return dpo_evidence(r.scorer, pairs, bc, br)

