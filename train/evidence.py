"""What was learned: held-out loss and label accuracy (Wilson 95%), preservation change vs
the base, per-category loss, adapter checksum, spectrum of s*A*B, merged-vs-separate check,
and the end-of-run gates."""
from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

import vkdsl
from vkdsl.ops import losses

from .data import IGNORE, Example, collate
from .prefix import FrozenPrefix
from .step import head_rows, selected_hidden


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


@dataclass
class RowScores:
    """Per row: (sum of supervised log-probs, count); the extra positions' log-probs; whether every
    supervised token is the greedy one (teacher-forced: the greedy continuation reproduces them);
    per extra position whether its token is greedy there."""
    sums: list
    extra: list
    greedy: list
    extra_greedy: list


class Scorer:
    """Per-row sum of next-token log-probs over supervised positions, adapters on or off."""

    def __init__(self, model, pad_id, bucket, max_len, batch, prefix=None, group=None, keep=0):
        """prefix: train.prefix.FrozenPrefix, shared with training (its rows are reused); None: off.
        group: train.distributed's process group: the batches are shared out over the ranks and
        the scores gathered, in row order, on every rank (None: this process scores them all).
        keep: programs each scoring function holds (vkdsl.trace; 0: one per batch shape)."""
        self.model, self.pad, self.bucket, self.max_len, self.batch = model, pad_id, bucket, max_len, batch
        self.keep = keep
        self.group = group
        self.prefix = prefix or FrozenPrefix(model, 0, 0)
        self.fns = {on: self._build(on) for on in (True, False)}

    def _build(self, on):
        @vkdsl.trace(keep=self.keep)
        def score(ids, pos, labels):
            h = selected_hidden(self.model, ids, pos, on, self.prefix.start)
            return head_rows(self.model, h, lambda lg, lab: (losses.token_logprobs(lg, lab)[0],
                                                             losses.greedy_gap(lg, lab)), labels, differentiable=False)
        return score

    def row_logprobs(self, rows: list[Example], adapters_on=True, extra=None):
        """-> [(sum log p over the row's supervised tokens, count)], and when extra (per row a list
        of (position, token)) is given, also the log-probs of those tokens at those positions."""
        sc = self.scores(rows, adapters_on, extra)
        return (sc.sums, sc.extra) if extra else sc.sums

    def scores(self, rows: list[Example], adapters_on=True, extra=None) -> RowScores:
        starts = list(range(0, len(rows), self.batch))
        g = self.group
        if g is None or g.size == 1:
            return self._scores(rows, starts, adapters_on, extra)
        mine = starts[g.rank::g.size]                       # this rank's batches, then everyone's
        local = self._split(self._scores(rows, mine, adapters_on, extra), [len(rows[s:s + self.batch]) for s in mine])
        done = {}
        for part in g.allgather(list(zip(mine, local))):
            done.update(part)
        out = RowScores([], [], [], [])
        for s in starts:
            for field, vals in zip(("sums", "greedy", "extra", "extra_greedy"), done[s]):
                getattr(out, field).extend(vals)
        return out

    @staticmethod
    def _split(sc: RowScores, sizes):
        parts, k = [], 0
        for n in sizes:
            parts.append((sc.sums[k:k + n], sc.greedy[k:k + n], sc.extra[k:k + n], sc.extra_greedy[k:k + n]))
            k += n
        return parts

    def _scores(self, rows, starts, adapters_on, extra) -> RowScores:
        out = RowScores([], [], [], [])
        for s in starts:
            chunk = rows[s:s + self.batch]
            fill = [Example(chunk[0].ids, [IGNORE] * len(chunk[0].ids), "", "")] * (self.batch - len(chunk))
            ids, lab = collate(chunk + fill, self.pad, self.bucket, self.max_len)   # one batch shape: fewer programs
            T = ids.shape[1]
            pos, sl, owner = [], [], []
            scored = np.zeros(ids.shape, bool)
            for i in range(len(chunk)):
                for t in np.flatnonzero(lab[i] != IGNORE):
                    pos.append(i * T + t), sl.append(lab[i, t]), owner.append((i, -1))
                for j, (t, tokid) in enumerate((extra[s + i] if extra else [])):
                    pos.append(i * T + t), sl.append(tokid), owner.append((i, j))
                    scored[i, t] = True
            g = 16 if len(pos) <= 64 else 64            # few scored positions (labels): a 16-row LM head
            S = -(-len(pos) // g) * g
            p = np.zeros(S, np.int32)
            lb = np.full(S, IGNORE, np.int32)
            p[:len(pos)], lb[:len(pos)] = pos, sl
            lp, gap = (np.asarray(a, np.float64) for a in self.fns[adapters_on](self.prefix.feed(ids, lab, scored), p, lb))
            for i in range(len(chunk)):
                mine = [k for k, o in enumerate(owner) if o == (i, -1)]
                ext = [k for k, o in enumerate(owner) if o[0] == i and o[1] >= 0]
                out.sums.append((float(lp[mine].sum()), len(mine)))
                out.greedy.append(bool(np.all(gap[mine] == 0)))
                out.extra.append([float(lp[k]) for k in ext])
                out.extra_greedy.append([bool(gap[k] == 0) for k in ext])
        return out


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
    ranked = sorted(out, key=lambda c: ((out[c]["accuracy"] if out[c]["accuracy"] is not None else 2.0), -out[c]["loss"]))
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
    """Per module: singular values of the learned update s*A*B (in, out) and its stable rank.
    A B has rank <= r: with A = Qa Ra and B^T = Qb Rb (thin QR), A B = Qa (Ra Rb^T) Qb^T, so its
    singular values are those of the r x r matrix Ra Rb^T (exact, without the dense in x out SVD)."""
    out = {}
    for n in names:
        lo = model.lora[n]
        A, B = lo.A.numpy().astype(np.float64), lo.B.numpy().astype(np.float64)
        ra, rb = np.linalg.qr(A, mode="r"), np.linalg.qr(B.T, mode="r")
        sv = abs(lo.scale) * np.linalg.svd(ra @ rb.T, compute_uv=False)
        # past rank r a dense SVD lists zeros: keep them, so top > r reads the same
        sv = np.concatenate([sv, np.zeros(max(0, min(top, A.shape[0], B.shape[1]) - len(sv)))])
        sr = float((sv ** 2).sum() / sv[0] ** 2) if sv[0] > 0 else 0.0
        out[n] = {"sv": [float(x) for x in sv[:top]], "stable_rank": sr, "fro": float(np.sqrt((sv ** 2).sum()))}
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
    feed = prefix.feed(ids, np.zeros_like(ids)) if start else ids.astype(np.int32)   # every position scored
    x = vkdsl.tensor(feed)
    sep = model.forward(x, start=start).numpy()
    orig = model.linear[name]
    model.linear[name], model.lora[name] = Dense(merged.astype(np.float32), name + ".merged"), None
    try:
        mer = model.forward(x, start=start).numpy()
    finally:
        model.linear[name], model.lora[name] = orig, lo
    return float(np.abs(mer - sep).max()), float((mer.argmax(-1) == sep.argmax(-1)).mean())


def surface_gates(ev, cfg, base_acc, stage=""):
    """The gates of the held-out surfaces (task, calibration, format, worst slice) of one stage."""
    g = []
    if ev.get("heldout_acc") is not None:
        # better than the base beyond sampling noise: the Wilson 95% lower bound clears the base's accuracy
        lo = ev["heldout_acc_ci"][0]
        ok = ev["heldout_acc"] > cfg.gate_heldout_acc and (base_acc is None or lo > base_acc)
        g.append((stage + "held-out accuracy", ok, f"{ev['heldout_acc']:.3f} > {cfg.gate_heldout_acc}"
                  + ("" if base_acc is None else f", Wilson 95% lower bound {lo:.3f} > base {base_acc:.3f}")))
    if ev.get("calibration"):
        g.append((stage + "calibration", ev["calibration"]["ece"] <= cfg.gate_calibration,
                  f"ECE {ev['calibration']['ece']:.3f} <= {cfg.gate_calibration}"))
    if ev.get("format_valid") is not None:
        g.append((stage + "format", ev["format_valid"] >= cfg.gate_format,
                  f"{ev['format_valid']:.3f} of {ev['format_n']} greedy outputs are one label + end-of-turn "
                  f">= {cfg.gate_format}"))
    sl = ev.get("slices")
    if sl and sl["worst"] is not None and sl["categories"][sl["worst"]]["accuracy"] is not None:
        w = sl["categories"][sl["worst"]]
        g.append((stage + "worst slice", w["accuracy"] >= cfg.gate_slice,
                  f"{sl['worst']}: accuracy {w['accuracy']:.3f} over {w['n']} rows >= {cfg.gate_slice}"))
    return g


def gates(ev, first_loss, cfg):
    g = surface_gates(ev, cfg, ev.get("heldout_acc_base"))
    g.append(("preservation damage", ev["preservation_delta"] <= cfg.gate_preservation,
              f"{ev['preservation_delta']:+.4f} <= {cfg.gate_preservation} nats/token"))
    if first_loss is not None:                  # no SFT step (objective dpo): no SFT gates
        g.append(("train loss fell", first_loss - ev["train_loss"] > cfg.gate_train_drop,
                  f"{first_loss:.4f} -> {ev['train_loss']:.4f}"))
        g.append(("adapter changed", ev["checksum_changed"], f"checksum {ev['checksum']}"))
    if ev.get("merge_max_diff") is not None:
        g.append(("merged == separate", ev["merge_max_diff"] <= cfg.gate_merge,
                  f"max diff {ev['merge_max_diff']:.2e} <= {cfg.gate_merge}"))
    fp = ev.get("stability_fp32")
    if fp and fp["agreement"] is not None:
        g.append(("stability (fp32 base)", fp["agreement"] >= cfg.gate_stability,
                  f"{fp['agreement']:.3f} of {fp['rows']} decisions unchanged >= {cfg.gate_stability}"))
    return g


def gate_records(gates) -> list[dict]:
    """The one schema of gates everywhere they are written (gates.json, summary.json, --jsonl)."""
    return [{"gate": n, "pass": ok, "detail": w} for n, ok, w in gates]


def publish_gates(rep, run_dir, gates, new):
    """Print the new gates' lines, then emit and write every gate so far (gates.json, atomic)."""
    from .checkpoint import atomic_write
    for name, ok, why in new:
        rep.outcome(f"  {'PASS' if ok else 'FAIL'}  {name}: {why}")
    rep.event("gates", gates=gate_records(gates))
    atomic_write(run_dir / "gates.json", json.dumps(gate_records(gates), indent=1).encode())


def dpo_gates(ev, cfg, base_acc=None):
    g = []
    held = ev.get("heldout")
    if held:
        g.append(("DPO held-out pairs", held["pair_accuracy"] > cfg.gate_dpo_pair_acc,
                  f"pair accuracy {held['pair_accuracy']:.3f} > {cfg.gate_dpo_pair_acc} over {held['pairs']} pairs"))
    if "preservation_delta" in ev:
        g.append(("preservation after DPO", ev["preservation_delta"] <= cfg.gate_preservation,
                  f"{ev['preservation_delta']:+.4f} <= {cfg.gate_preservation} nats/token"))
    if ev.get("after"):
        g += surface_gates(ev["after"], cfg, base_acc, "after DPO: ")
        before, after = ev.get("sft_acc"), ev["after"].get("heldout_acc")
        if before is not None and after is not None:
            g.append(task_cost_gate(before, after, cfg))
    return g


def task_cost_gate(before, after, cfg):
    """DPO must not cost the task: held-out accuracy after DPO within gate_dpo_task_drop of SFT's."""
    return ("DPO did not cost the task", after >= before - cfg.gate_dpo_task_drop,
            f"held-out accuracy {before:.3f} after SFT -> {after:.3f} after DPO, >= {before:.3f} - "
            f"{cfg.gate_dpo_task_drop}")


def table(ev) -> str:
    L = [f"evidence at step {ev['step']}:",
         "  train loss (last step)       " + ("-" if ev["train_loss"] is None else f"{ev['train_loss']:.4f}"),
         f"  held-out loss                {ev['heldout_loss']:.4f}  (base {ev['heldout_loss_base']:.4f})"]
    if ev.get("heldout_acc") is not None:
        lo, hi = ev["heldout_acc_ci"]
        L.append(f"  held-out accuracy            {ev['heldout_acc']:.3f}  Wilson 95% [{lo:.3f}, {hi:.3f}]  "
                 f"({ev['heldout_correct']}/{ev['heldout_n']}; base {ev['heldout_acc_base']:.3f})")
    L.append(f"  preservation delta           {ev['preservation_delta']:+.4f} nats/token vs base "
             f"({ev['preservation_loss']:.4f} vs {ev['preservation_loss_base']:.4f})")
    cal = ev.get("calibration")
    if cal:
        L.append(f"  calibration (ECE, 10 bins)   {cal['ece']:.3f} over {cal['n']} rows; bins (n: accuracy/confidence) "
                 + " ".join(f"{b['n']}:{b['accuracy']:.2f}/{b['confidence']:.2f}" for b in cal["bins"] if b["n"]))
    if ev.get("format_valid") is not None:
        L.append(f"  format (greedy = one label + end-of-turn) {ev['format_valid']:.3f} of {ev['format_n']} prompts")
        for f in ev.get("format_failures", []):
            L.append(f"    e.g. {f['row']}: expected {f['expected']!r}, generated {f['generated']!r}")
    sl = ev.get("slices")
    if sl:
        for c, v in sl["categories"].items():
            acc = "" if v["accuracy"] is None else f"  accuracy {v['accuracy']:.3f} ({v['n']} rows)"
            L.append(f"  held-out [{c}]{' ' * max(1, 18 - len(c))}loss {v['loss']:.4f}{acc}"
                     + ("  <- worst slice" if c == sl["worst"] else ""))
    else:
        for c, v in ev["category_loss"].items():
            L.append(f"  held-out loss [{c}]{' ' * max(1, 13 - len(c))}{v:.4f}")
    st = ev.get("stability_checkpoint")
    if st and st["agreement"] is not None:
        L.append(f"  stability: decisions agree with {'the base' if st['step'] == 'base' else 'step ' + str(st['step'])}"
                 f" on {st['agreement']:.3f} of rows")
    fp = ev.get("stability_fp32")
    if fp and fp["agreement"] is not None:
        L.append(f"  stability: packed base vs fp32-dequantized base, same adapter: {fp['agreement']:.3f} of "
                 f"{fp['rows']} decisions agree")
    L.append(f"  adapter checksum             {ev['checksum']} ({'changed' if ev['checksum_changed'] else 'UNCHANGED'} since init)")
    if ev.get("merge_max_diff") is not None:
        L.append(f"  merged vs separate           max diff {ev['merge_max_diff']:.2e}, argmax agreement "
                 f"{ev['merge_argmax']:.3f} ({ev['merge_module']})")
    for n, s in list(ev["spectrum"].items())[:4]:
        L.append(f"  {n:<20} sv {', '.join(f'{x:.3g}' for x in s['sv'])}  stable rank {s['stable_rank']:.2f}")
    if len(ev["spectrum"]) > 4:
        srs = [s["stable_rank"] for s in ev["spectrum"].values()]
        L.append(f"  ({len(srs)} modules: stable rank min {min(srs):.2f} / mean {np.mean(srs):.2f} / max {max(srs):.2f})")
    return "\n".join(L)
