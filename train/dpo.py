"""DPO on the same LoRA adapters: data, the traced preference step, the cached reference, and
the evidence (pair accuracy, improvement accuracy, margin improvement, chosen and rejected drift
reported separately).

Sequence log-probability = sum of next-token log-probs over the response tokens only (the
prompt is masked to -100). The reference is the same model: the adapter disabled, or -- when DPO
follows SFT -- the SFT adapter as it stood when DPO began. Either way its log-probs are computed
once before the first step and cached with the hashes they depend on; a stale cache is refused.
With policy == reference every margin is 0 and the first loss is ln 2 = 0.693147."""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import vkdsl
from vkdsl.autograd import grad, saved_activations
from vkdsl.models.identity import digest
from vkdsl.ops import losses

from . import checkpoint, loop
from .data import IGNORE, DataError, Example, Sampler, collate, encode_row, read_jsonl
from .distributed import Single, my_share, sum_over_ranks
from .evidence import DpoEvidence, PairEvidence
from .prefix import FrozenPrefix
from .schedule import lr_at
from .scoring import Scorer
from .step import HostAdamW, kept_dtype, head_rows, select, selected_hidden

LN2 = math.log(2.0)


@dataclass
class Pair:
    chosen: Example
    rejected: Example
    where: str


def load_pairs(path, tok, use_template, max_len, side) -> tuple[list[Pair], int]:
    """TRL's {"prompt", "chosen", "rejected"} rows -> (pairs, number with identical responses)."""
    pairs, same = [], 0
    for n, obj in read_jsonl(path):
        where = f"{path}:{n}"
        for key in ("prompt", "chosen", "rejected"):
            if not isinstance(obj.get(key), str) or not obj[key].strip():
                raise DataError(f"{where}: field {key!r} is missing or empty")
        if obj["chosen"].strip() == obj["rejected"].strip():
            same += 1                     # no preference signal: counted and warned, not trained on
            continue
        row = {"prompt": obj["prompt"], "category": obj.get("category", ""),
               **({"system": obj["system"]} if "system" in obj else {})}
        c = encode_row(dict(row, completion=obj["chosen"]), tok, use_template, max_len, side,
                       where + " (chosen)")
        r = encode_row(dict(row, completion=obj["rejected"]), tok, use_template, max_len, side,
                       where + " (rejected)")
        pairs.append(Pair(c, r, where))
    if not pairs:
        raise DataError(f"{path}: no usable preference pairs ({same} had identical chosen and "
                        f"rejected)")
    return pairs, same


def stage_pairs(cfg, tok) -> tuple[list[Pair], list[Pair], int]:
    """The DPO stage's (training pairs, held-out pairs, pairs skipped for identical responses),
    read when the run starts: a bad pair file fails before SFT trains, and the plan sees them."""
    enc = (cfg.chat_template, cfg.max_len, cfg.truncation_side)
    pairs, same = load_pairs(cfg.dpo_train_file, tok, *enc)
    held, same_h = (load_pairs(cfg.dpo_heldout_file, tok, *enc) if cfg.dpo_heldout_file
                    else ([], 0))
    return pairs, held, same + same_h


def segments(pos, labels, T, B):
    """(B, S) one-hot: which sequence each selected position belongs to (0 for padding)."""
    seg = np.zeros((B, len(pos)), np.float32)
    live = labels != IGNORE
    seg[pos[live] // T, np.flatnonzero(live)] = 1.0
    return seg


def _logprob_rows(logits, labels):
    return losses.token_logprobs(logits, labels)[0]


def build_dpo_step(model, params, beta: float, nll_weight: float, start: int = 0,
                   checkpoint: int = 0, activations: str = "fp32"):
    """Traced: (chosen ids/pos/labels/segments, rejected ..., ref_margin (P,), inv_nc (1,)) ->
    (loss, policy chosen logp (P,), policy rejected logp (P,), *grads). start > 0: the ids are the
    frozen prefix's outputs (train.prefix). checkpoint: layers per recomputed group in the backward
    (Llama.forward). activations: storage of what the backward keeps (train.step.build_grad_fn)."""
    kept = kept_dtype(activations)

    @vkdsl.trace(keep=1)  # pairs of other lengths build another program; one is alive (memplan)
    def dpo_step(ids_c, pos_c, lab_c, seg_c, ids_r, pos_r, lab_r, seg_r, ref_margin, inv_nc):
        lpc, = head_rows(model, selected_hidden(model, ids_c, pos_c, True, start, (), checkpoint),
                         _logprob_rows, lab_c)
        lpr, = head_rows(model, selected_hidden(model, ids_r, pos_r, True, start, (), checkpoint),
                         _logprob_rows, lab_r)
        pc = (seg_c @ lpc.reshape(-1, 1)).reshape(-1)          # (P,) sequence log-probs
        pr = (seg_r @ lpr.reshape(-1, 1)).reshape(-1)
        margin = ((pc - pr) - ref_margin) * beta
        loss = losses.softplus(-margin).mean()
        if nll_weight > 0:  # optional NLL on the chosen responses
            loss = loss - pc.sum() * inv_nc[0] * nll_weight
        with saved_activations(kept):
            return [loss, pc, pr] + grad(loss, params)
    return dpo_step


def _pack(rows, pad, bucket, max_len, prefix=None):
    """-> (what the step takes for ids: the ids, or the frozen prefix's output), pos, labels,
    segments."""
    ids, lab = collate(rows, pad, bucket, max_len)
    pos, sl = select(lab, bucket=16)
    feed = ids if prefix is None else prefix.feed(ids, lab)
    return feed, pos, sl, segments(pos, sl, ids.shape[1], ids.shape[0])


def reference_logps(scorer, pairs, adapters_on: bool):
    c = scorer.row_logprobs([p.chosen for p in pairs], adapters_on)
    r = scorer.row_logprobs([p.rejected for p in pairs], adapters_on)
    return np.array([x for x, _ in c]), np.array([x for x, _ in r])


def cache_key(identity: dict, pairs, reference: str, adapter_sum: str) -> str:
    """What the reference log-probs depend on: the run's identity (base, tokenizer, template, quant,
    precision), the reference, the adapter it stands on, and every response's token ids and
    masks."""
    h = hashlib.sha256()
    for p in pairs:
        for ex in (p.chosen, p.rejected):
            h.update(np.asarray(ex.ids, np.int32).tobytes()
                     + np.asarray(ex.labels, np.int32).tobytes())
    keep = ("base_sha256", "tokenizer_sha256", "chat_template_sha256", "quant", "precision")
    return digest({**{k: identity.get(k) for k in keep}, "reference": reference,
                   "adapter": adapter_sum, "rows": h.hexdigest()})


def cached_reference(path: Path, key: str, compute, say=lambda s: None, group=None):
    """The cached reference log-probs when their hashes match; a cache made for other inputs (or
    unreadable) is never used: it is said, recomputed and replaced. group: rank 0 alone reads and
    writes the cache, and every rank takes its answer (computing is collective)."""
    g = group or Single()
    hit = g.from_root(_read_reference, path, key, say)
    if hit is not None:
        return np.array(hit[0]), np.array(hit[1])
    rc, rr = compute()
    if g.root:
        checkpoint.atomic_write(path, json.dumps({"key": key, "chosen": rc.tolist(),
                                                  "rejected": rr.tolist()}).encode())
    return rc, rr


def _read_reference(path: Path, key: str, say):
    if path.is_file():
        try:
            obj = json.loads(path.read_text())
        except (OSError, ValueError):
            obj = {}
        if isinstance(obj, dict) and obj.get("key") == key:
            return obj["chosen"], obj["rejected"]
        say(f"{path.name}: the cached DPO reference was computed for other inputs (base, "
            f"tokenizer, template, masks or reference adapter differ, or the file is damaged): "
            f"recomputed")
    return None


def dpo_evidence(scorer, pairs, rc, rr) -> PairEvidence:
    pc, pr = reference_logps(scorer, pairs, True)
    improvement = (pc - pr) - (rc - rr)
    return PairEvidence(float(np.mean(pc > pr)), float(np.mean(improvement > 0)),
                        float(improvement.mean()), float(np.mean(pc - rc)), float(np.mean(pr - rr)),
                        len(pairs))


def margin_story(ev: PairEvidence) -> str:
    """Which side carried the margin: chosen going up, or rejected going down."""
    up, down = ev.chosen_drift, -ev.rejected_drift          # both positive when they help
    total = up + down
    detail = f"chosen drift {up:+.3f} nats, rejected drift {-down:+.3f} nats per pair"
    if abs(total) < 1e-9:
        return f"the margin did not move ({detail})"
    if total < 0:
        return f"the margin shrank by {-total:.3f} nats ({detail})"
    if up < 0:
        return (f"the margin grew by {total:.3f} nats only because rejected responses fell further "
                f"than chosen ones: chosen log-probs also went down ({detail})")
    if down < 0:
        return (f"the margin grew by {total:.3f} nats only because chosen responses rose more than "
                f"rejected ones ({detail})")
    share = down / total
    side = "lowering rejected responses" if share >= 0.5 else "raising chosen responses"
    return f"{100 * max(share, 1 - share):.0f}% of the margin came from {side} ({detail})"


class PairOrder(Sampler):
    """The DPO stage's pair order: seeded permutations of the n pairs, concatenated, taken
    per_step at a time (data.Sampler without its length grouping; the same state())."""

    def __init__(self, n, per_step, seed):
        super().__init__(range(n), per_step, seed)

    def _refill(self):
        self.queue += self.rng.permutation(len(self.ex)).tolist()


class DpoObjective:
    """DPO as the loop's objective (train.loop): the traced preference step over a global batch of
    dpo_batch x P pairs, drawn as one process would draw them; each rank computes dpo_batch of them
    and one all-reduce sums the gradients (and losses), so the objective is the single-process
    one."""
    stage, finite = "dpo", ("loss",)

    def __init__(self, model, params, cfg, pad, pairs, rc, rr, prefix, group, say, event,
                 reference):
        self.cfg, self.pad, self.pairs, self.rc, self.rr = cfg, pad, pairs, rc, rr
        self.prefix, self.g, self.reference = prefix, group, reference
        self.say, self.event = say, event
        self.steps, self.clip = cfg.dpo_steps, cfg.clip
        self.order = PairOrder(len(pairs), cfg.dpo_batch * group.size, cfg.data_seed)
        self.fn = build_dpo_step(model, params, cfg.dpo_beta, cfg.dpo_nll_weight, prefix.start,
                                 cfg.checkpoint_layers, cfg.activations)
        self.history = []

    def lr(self, step):
        return lr_at(step, self.cfg.dpo_lr, self.steps, 0, self.cfg.min_lr_ratio)

    def gradient(self, idx, step):
        g, c, pairs = self.g, self.cfg, self.pairs
        mine = my_share(idx, g)
        batch = [pairs[i] for i in mine]
        ic, pc_, lc, sc = _pack([p.chosen for p in batch], self.pad, c.bucket, c.max_len,
                                self.prefix)
        ir, pr_, lr_, sr = _pack([p.rejected for p in batch], self.pad, c.bucket, c.max_len,
                                 self.prefix)
        ref = (self.rc[mine] - self.rr[mine]).astype(np.float32)
        # the NLL term's normalizer counts the whole global batch's chosen tokens; the traced mean
        # is over this rank's pairs, so every term is scaled by P here and divided by P after the
        # sum
        n_c = max(sum(int(np.sum(np.asarray(pairs[i].chosen.labels) != IGNORE)) for i in idx), 1)
        self.last_args = (ic, pc_, lc, sc, ir, pr_, lr_, sr, ref,
                          np.array([g.size / n_c], np.float32))
        out = self.fn(*self.last_args)
        loss, grads, extra = float(out[0]), [np.asarray(x, np.float32) for x in out[3:]], {}
        nll = -float(np.sum(np.asarray(out[1], np.float64))) * g.size / n_c * c.dpo_nll_weight
        if g.size > 1:
            grads, (loss, nll), extra = sum_over_ranks(g, grads, [loss, nll])
            grads, loss, nll = [x / g.size for x in grads], loss / g.size, nll / g.size
        return grads, {"loss": loss, "nll": nll, **extra}

    def record(self, step, rec):
        # the preference term alone: the loss less the NLL
        if step == 1 and self.reference != "none":
            pref = rec["loss"] - rec["nll"]
            self.say(f"DPO step 1 preference loss {pref:.6f}; policy == reference gives ln 2 = "
                     f"{LN2:.6f} (difference {pref - LN2:+.2e})"
                     + (f"; NLL on chosen {rec['nll']:.4f}" if rec["nll"] else ""))
        rec = {"step": step, "stage": "dpo", "dpo_loss": rec.pop("loss"), **rec}
        self.history.append(rec)
        self.event("dpo_step", **rec)
        self.say(f"dpo step {step}/{self.steps} loss {rec['dpo_loss']:.4f} |g| "
                 f"{rec['grad_norm']:.3g}  {rec['time']:.1f}s")


def train_dpo(model, params, cfg, pad, pairs, heldout, run_dir: Path, say, event, reference: str,
              identity: dict, prefix=None, group=None, stage=None, scorer=None):
    """reference: 'base' (adapter off), 'sft' (the adapter as it stands now, frozen), 'none'.
    cfg: a TrainConfig (dpo_*, bucket, max_len, eval_batch, clip, betas, eps, weight_decay,
    data_seed, min_lr_ratio). prefix: train.prefix.FrozenPrefix. Reference log-probs and evidence
    are scored in shards over group's ranks and gathered. stage: f(objective, optimizer) -> None
    runs the loop (train.stages: checkpoints and resume); None: train.loop.train from step 0.
    identity: the run's (models.identity.of_run), for the reference cache's key. scorer: the run's
    Scorer (its programs shared with the evaluation), else one made here.
    Returns (history, DpoEvidence: the pair evidence; the stage adds the rest)."""
    g = group or Single()
    prefix = prefix or FrozenPrefix(model, 0, 0)
    scorer = scorer or Scorer(model, pad, cfg.bucket, cfg.max_len, cfg.eval_batch, prefix, g)
    if reference == "none":
        rc = rr = np.zeros(len(pairs))
        hc = hr = np.zeros(len(heldout))
    else:
        on = reference == "sft"
        adapter_sum = (hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()
                       if on else "off")
        key = cache_key(identity, pairs + heldout, reference, adapter_sum)
        t0 = time.perf_counter()
        both = cached_reference(run_dir / "dpo_reference.json", key,
                                lambda: reference_logps(scorer, pairs + heldout, on), say, g)
        say(f"DPO reference log-probs of {len(pairs) + len(heldout)} pairs in "
            f"{time.perf_counter() - t0:.1f}s")
        rc, rr = both[0][:len(pairs)], both[1][:len(pairs)]
        hc, hr = both[0][len(pairs):], both[1][len(pairs):]
    obj = DpoObjective(model, params, cfg, pad, pairs, rc, rr, prefix, g, say, event, reference)
    opt = HostAdamW([p.shape for p in params], cfg.betas, cfg.eps, cfg.weight_decay)
    if stage is None:
        loop.train(obj, params, opt, g)
    else:
        stage(obj, opt)
    # the training pairs' evidence only when no held-out pairs exist: the held-out split carries the
    # gate and the drift story, and scoring both doubles the stage's evaluation time
    train_ev = dpo_evidence(scorer, pairs, rc, rr) if not heldout else None
    held_ev = dpo_evidence(scorer, heldout, hc, hr) if heldout else None
    return obj.history, DpoEvidence(train=train_ev, heldout=held_ev)
