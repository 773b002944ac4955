"""What was learned, typed: the evidence of a stage (held-out loss and label accuracy with its
Wilson 95% interval, preservation change vs the base, the failure surfaces, adapter checksum,
spectrum of s*A*B, merged-vs-separate check), DPO's pair evidence, and the gates; the statistics
they are computed with. Scoring (the forward over scored positions) is train.scoring's."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

import vkdsl
from vkdsl.fileio import atomic_write


_JSON_KINDS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,),
               "list": (list,), "dict": (dict,)}


def _typed(cls, name: str, annotation: str, v):
    """v when it has the JSON type a field of cls declares (`float | None`: a number or null);
    a field typed by another record class is that class's to check."""
    kinds = [k.strip() for k in annotation.split("|")]
    if v is None and "None" in kinds:
        return v
    known = [k for k in kinds if k in _JSON_KINDS]
    if not known or any(isinstance(v, _JSON_KINDS[k]) and (k == "bool") == isinstance(v, bool)
                        for k in known):
        return v
    raise ValueError(f"{cls.__name__}.{name} is {json.dumps(v)[:40]}, expected {annotation}")


def _known(cls, d: dict | None):
    """A record type from its JSON object, each field of the type it declares (keys it does not
    have are a newer writer's: ignored)."""
    if d is not None and not isinstance(d, dict):
        raise ValueError(f"expected a JSON object for {cls.__name__}, found a {type(d).__name__}")
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    return cls(**{k: _typed(cls, k, fields[k], v) for k, v in (d or {}).items() if k in fields})


@dataclass
class Gate:
    gate: str
    passed: bool
    detail: str

    def record(self) -> dict:
        """The one schema of a gate wherever it is written (gates.json, summary.json, --jsonl)."""
        return {"gate": self.gate, "pass": bool(self.passed), "detail": self.detail}

    @classmethod
    def from_record(cls, d: dict) -> "Gate":
        if not isinstance(d, dict) or not isinstance(d.get("gate"), str):
            raise ValueError(f"a gate record is {json.dumps(d)[:60]}, expected an object with "
                             f"\"gate\" (a name), \"pass\" (true or false) and \"detail\"")
        return _known(cls, {"gate": d["gate"], "passed": d.get("pass"),
                            "detail": d.get("detail", "")})


@dataclass
class Scores:
    """One scoring pass over the held-out rows and the preservation passages (train.heldout)."""
    held: list                   # per row: (sum of its supervised tokens' log-probs, their count)
    heldout_loss: float
    correct: int                 # labelled rows decided right, of n
    n: int
    label_lp: np.ndarray         # (n, labels): each label's log-prob as the row's completion
    truth: list                  # each labelled row's label index
    # per row: its greedy output is one label + end-of-turn ([]: not measured)
    format: list
    pres: float                  # preservation loss, nats/token (0 without passages)

    @property
    def acc(self) -> float | None:
        return self.correct / self.n if self.n else None


@dataclass
class Surfaces:
    """The failure surfaces of one scoring pass: calibration, slices, the decisions, format."""
    calibration: dict | None
    slices: dict
    decisions: list
    format_valid: float | None = None
    format_n: int | None = None
    format_failures: list = field(default_factory=list)


@dataclass
class Evidence:
    """What one evaluation found: of the base, at a step, after SFT or after DPO (None where that
    evaluation does not measure it). Its JSON object is the eval record, summary.json's final."""
    step: int | str | None = None           # the SFT step it was taken at, or "base"
    train_loss: float | None = None
    heldout_loss: float | None = None
    heldout_loss_base: float | None = None
    heldout_acc: float | None = None
    heldout_correct: int | None = None
    heldout_n: int | None = None
    heldout_acc_ci: list | None = None
    heldout_acc_base: float | None = None
    heldout_target_prob: float | None = None
    preservation_loss: float | None = None
    preservation_loss_base: float | None = None
    preservation_delta: float | None = None
    category_loss: dict | None = None
    calibration: dict | None = None
    slices: dict | None = None
    decisions: list = field(default_factory=list)
    format_valid: float | None = None
    format_n: int | None = None
    format_failures: list = field(default_factory=list)
    stability_checkpoint: dict | None = None
    stability_fp32: dict | None = None
    decision_agreement_with_sft: float | None = None
    checksum: str | None = None
    checksum_changed: bool | None = None
    spectrum: dict = field(default_factory=dict)
    merge_max_diff: float | None = None
    merge_argmax: float | None = None
    merge_module: str | None = None
    eval_seconds: float | None = None

    @classmethod
    def of(cls, sc: Scores, sf: Surfaces | None = None, **more) -> "Evidence":
        """The held-out side of a scoring pass (and its surfaces) as evidence."""
        return cls(heldout_loss=sc.heldout_loss, heldout_acc=sc.acc, heldout_correct=sc.correct,
                   heldout_n=sc.n, heldout_acc_ci=list(wilson(sc.correct, sc.n)) if sc.n else None,
                   heldout_target_prob=target_prob(sc.label_lp, sc.truth),
                   preservation_loss=sc.pres, **(dataclasses.asdict(sf) if sf else {}), **more)

    def json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict | None) -> "Evidence":
        return _known(cls, d)


@dataclass
class PairEvidence:
    """DPO on one split of pairs: how often chosen beats rejected, and how each side moved."""
    pair_accuracy: float
    improvement_accuracy: float
    margin_improvement: float
    chosen_drift: float
    rejected_drift: float
    pairs: int


@dataclass
class DpoEvidence:
    train: PairEvidence | None = None           # only without held-out pairs
    heldout: PairEvidence | None = None
    after: Evidence | None = None               # every held-out surface again, after DPO
    # held-out accuracy after SFT, for the task-cost gate
    sft_acc: float | None = None
    preservation_delta: float | None = None

    def json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict | None) -> "DpoEvidence":
        own = _known(cls, d)            # the scalars checked; the nested records are their types'
        pair = {k: _known(PairEvidence, v) if (v := getattr(own, k)) else None
                for k in ("train", "heldout")}
        return dataclasses.replace(own, **pair, after=Evidence.from_json(own.after)
                                   if own.after else None)


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def mean_loss(scored):
    tot, n = sum(-s for s, _ in scored), sum(k for _, k in scored)
    return tot / max(n, 1)


def label_probs(lp: np.ndarray) -> np.ndarray:
    """(n, L) label log-probs -> each row's probabilities renormalized within the label set."""
    z = lp - lp.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def target_prob(lp: np.ndarray, truth) -> float | None:
    """Mean probability of the true label within the label set (None without labelled rows)."""
    return float(np.mean(label_probs(lp)[np.arange(len(truth)), truth])) if len(truth) else None


def per_category(rows, scored):
    acc = defaultdict(lambda: [0.0, 0])
    for ex, (s, n) in zip(rows, scored):
        acc[ex.category or "-"][0] -= s
        acc[ex.category or "-"][1] += n
    return {c: v[0] / max(v[1], 1) for c, v in sorted(acc.items())}


def calibration(lp: np.ndarray, truth, bins: int = 10) -> dict | None:
    """Expected calibration error of the label decision: rows binned by the winning label's
    probability within the label set (10 equal bins over [0, 1]); ECE = sum over bins of
    (rows in bin / rows) * |accuracy in bin - mean confidence in bin|."""
    if not len(truth):
        return None
    P = label_probs(lp)
    conf, ok = P.max(1), P.argmax(1) == np.asarray(truth)
    which = np.minimum((conf * bins).astype(int), bins - 1)
    out, ece = [], 0.0
    for b in range(bins):
        m = which == b
        n = int(m.sum())
        c, a = (float(conf[m].mean()), float(ok[m].mean())) if n else (None, None)
        if n:
            ece += n / len(conf) * abs(a - c)
        out.append({"lo": b / bins, "hi": (b + 1) / bins, "n": n, "confidence": c, "accuracy": a})
    return {"ece": float(ece), "bins": out, "n": int(len(conf))}


def slices(rows, scored, idx, lp, truth) -> dict:
    """Per category: held-out loss (every row) and label accuracy (labelled rows); the worst slice
    is the lowest accuracy (ties: the higher loss), or the highest loss where no row is labelled."""
    loss = per_category(rows, scored)
    acc = defaultdict(lambda: [0, 0])
    for j, i in enumerate(idx):
        c = rows[i].category or "-"
        acc[c][0] += int(np.argmax(lp[j]) == truth[j])
        acc[c][1] += 1
    out = {c: {"loss": v, "accuracy": acc[c][0] / acc[c][1] if acc[c][1] else None, "n": acc[c][1]}
           for c, v in loss.items()}
    ranked = sorted(out, key=lambda c: ((out[c]["accuracy"] if out[c]["accuracy"] is not None
                                         else 2.0), -out[c]["loss"]))
    return {"categories": out, "worst": ranked[0] if ranked else None}


def agreement(a, b) -> float | None:
    """Share of rows on which two lists of decisions agree."""
    return float(np.mean(np.asarray(a) == np.asarray(b))) if len(a) and len(a) == len(b) else None


def checksum(params) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p, np.float32).tobytes())
    return h.hexdigest()[:16]


def spectrum(model, names, top=4):
    """Per module: singular values of the learned update s*A*B (in, out) and its stable rank. A B
    has rank <= r: with A = Qa Ra and B^T = Qb Rb (thin QR), A B = Qa (Ra Rb^T) Qb^T, so its
    singular values are those of the r x r matrix Ra Rb^T (exact, without the dense in x out
    SVD)."""
    out = {}
    for n in names:
        lo = model.lora[n]
        A, B = lo.A.numpy().astype(np.float64), lo.B.numpy().astype(np.float64)
        ra, rb = np.linalg.qr(A, mode="r"), np.linalg.qr(B.T, mode="r")
        sv = abs(lo.scale) * np.linalg.svd(ra @ rb.T, compute_uv=False)
        # past rank r a dense SVD lists zeros: keep them, so top > r reads the same
        sv = np.concatenate([sv, np.zeros(max(0, min(top, A.shape[0], B.shape[1]) - len(sv)))])
        sr = float((sv ** 2).sum() / sv[0] ** 2) if sv[0] > 0 else 0.0
        out[n] = {"sv": [float(x) for x in sv[:top]], "stable_rank": sr,
                  "fro": float(np.sqrt((sv ** 2).sum()))}
    return out


def merged_check(model, ckpt, name, ids: np.ndarray, prefix=None):
    """Whole-model logits on a small held-out batch: the adapted module `name` replaced by a
    dense numpy-dequantized copy of W + (s A B)^T with its adapter removed, vs the separate
    path (packed W, adapter beside it). -> (max abs logit diff, argmax agreement).
    prefix: the frozen prefix (train.prefix) the adapted layers start from."""
    from vkdsl.models.weights import Dense
    lo = model.lora[name]
    W = ckpt[name + ".weight"].dequantize().astype(np.float64)                 # (out, in)
    merged = W + lo.scale * (lo.A.numpy().astype(np.float64) @ lo.B.numpy().astype(np.float64)).T
    start = prefix.start if prefix is not None else 0
    # every position scored
    feed = prefix.feed(ids, np.zeros_like(ids)) if start else ids.astype(np.int32)
    x = vkdsl.tensor(feed)
    sep = model.forward(x, start=start).numpy()
    orig = model.linear[name]
    model.linear[name], model.lora[name] = Dense(merged.astype(np.float32), name + ".merged"), None
    try:
        mer = model.forward(x, start=start).numpy()
    finally:
        model.linear[name], model.lora[name] = orig, lo
    return float(np.abs(mer - sep).max()), float((mer.argmax(-1) == sep.argmax(-1)).mean())


def surface_gates(ev: Evidence, cfg, base_acc, stage="") -> list[Gate]:
    """The gates of the held-out surfaces (task, calibration, format, worst slice) of one stage."""
    g = []
    if ev.heldout_acc is not None:
        # better than the base beyond sampling noise: the Wilson 95% lower bound clears the base's
        # accuracy
        lo = ev.heldout_acc_ci[0]
        ok = ev.heldout_acc > cfg.gate_heldout_acc and (base_acc is None or lo > base_acc)
        g.append(Gate(stage + "held-out accuracy", ok,
                      f"{ev.heldout_acc:.3f} > {cfg.gate_heldout_acc}"
                      + ("" if base_acc is None
                         else f", Wilson 95% lower bound {lo:.3f} > base {base_acc:.3f}")))
    if ev.calibration:
        g.append(Gate(stage + "calibration", ev.calibration["ece"] <= cfg.gate_calibration,
                      f"ECE {ev.calibration['ece']:.3f} <= {cfg.gate_calibration}"))
    if ev.format_valid is not None:
        g.append(Gate(stage + "format", ev.format_valid >= cfg.gate_format,
                      f"{ev.format_valid:.3f} of {ev.format_n} greedy outputs are one label + "
                      f"end-of-turn >= {cfg.gate_format}"))
    sl = ev.slices
    if sl and sl["worst"] is not None and sl["categories"][sl["worst"]]["accuracy"] is not None:
        w = sl["categories"][sl["worst"]]
        g.append(Gate(stage + "worst slice", w["accuracy"] >= cfg.gate_slice,
                      f"{sl['worst']}: accuracy {w['accuracy']:.3f} over {w['n']} rows >= "
                      f"{cfg.gate_slice}"))
    return g


def gates(ev: Evidence, first_loss, cfg) -> list[Gate]:
    g = surface_gates(ev, cfg, ev.heldout_acc_base)
    g.append(Gate("preservation damage", ev.preservation_delta <= cfg.gate_preservation,
                  f"{ev.preservation_delta:+.4f} <= {cfg.gate_preservation} nats/token"))
    if first_loss is not None:                  # no SFT step (objective dpo): no SFT gates
        g.append(Gate("train loss fell", first_loss - ev.train_loss > cfg.gate_train_drop,
                      f"{first_loss:.4f} -> {ev.train_loss:.4f}"))
        g.append(Gate("adapter changed", ev.checksum_changed, f"checksum {ev.checksum}"))
    if ev.merge_max_diff is not None:
        g.append(Gate("merged == separate", ev.merge_max_diff <= cfg.gate_merge,
                      f"max diff {ev.merge_max_diff:.2e} <= {cfg.gate_merge}"))
    fp = ev.stability_fp32
    if fp and fp["agreement"] is not None:
        g.append(Gate("stability (fp32 base)", fp["agreement"] >= cfg.gate_stability,
                      f"{fp['agreement']:.3f} of {fp['rows']} decisions unchanged >= "
                      f"{cfg.gate_stability}"))
    return g


def publish_gates(rep, run_dir, gates: list[Gate], new: list[Gate]):
    """Print the new gates' lines, then emit and write every gate so far (gates.json, atomic)."""
    for g in new:
        rep.outcome(f"  {'PASS' if g.passed else 'FAIL'}  {g.gate}: {g.detail}")
    rep.event("gates", gates=[g.record() for g in gates])
    atomic_write(run_dir / "gates.json", json.dumps([g.record() for g in gates], indent=1).encode())


def dpo_gates(ev: DpoEvidence, cfg, base_acc=None) -> list[Gate]:
    g = []
    held = ev.heldout
    if held:
        g.append(Gate("DPO held-out pairs", held.pair_accuracy > cfg.gate_dpo_pair_acc,
                      f"pair accuracy {held.pair_accuracy:.3f} > {cfg.gate_dpo_pair_acc} over "
                      f"{held.pairs} pairs"))
    if ev.preservation_delta is not None:
        g.append(Gate("preservation after DPO", ev.preservation_delta <= cfg.gate_preservation,
                      f"{ev.preservation_delta:+.4f} <= {cfg.gate_preservation} nats/token"))
    if ev.after:
        g += surface_gates(ev.after, cfg, base_acc, "after DPO: ")
        if ev.sft_acc is not None and ev.after.heldout_acc is not None:
            g.append(task_cost_gate(ev.sft_acc, ev.after.heldout_acc, cfg))
    return g


def task_cost_gate(before, after, cfg) -> Gate:
    """DPO must not cost the task: accuracy after DPO within gate_dpo_task_drop of SFT's."""
    return Gate("DPO did not cost the task", after >= before - cfg.gate_dpo_task_drop,
                f"held-out accuracy {before:.3f} after SFT -> {after:.3f} after DPO, >= "
                f"{before:.3f} - {cfg.gate_dpo_task_drop}")
