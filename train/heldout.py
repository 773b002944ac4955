"""The held-out side of a run: scoring the held-out rows (single-token label scoring when every
label is one token after the same prompt, else one candidate row per label) and the preservation
passages, adapters on or off, and the failure surfaces drawn from one scoring pass: label
decisions, calibration, format (greedy output = one label + end-of-turn, failures generated
verbatim), slices, and the decisions again on the base dequantized to fp32."""
from __future__ import annotations

import gc

import numpy as np

from vkdsl.models.build import build_model

from . import evidence
from .evidence import Scores, Surfaces
from .data import IGNORE, DataError, encode_row, reply_end, with_completion
from .distributed import Single
from .scoring import Scorer


class Heldout:
    def __init__(self, cfg, model, ckpt, tok, pad, scorer, heldout, passages):
        self.cfg, self.model, self.ckpt, self.tok = cfg, model, ckpt, tok
        self.pad, self.scorer = pad, scorer
        self.heldout, self.passages = heldout, passages
        self.labels = list(cfg.labels) if cfg.label_eval else []
        if self.labels:             # every held-out row is a label decision: none drops out unseen
            for ex in heldout:
                if ex.completion.strip() not in self.labels:
                    raise DataError(f"{ex.where}: completion {ex.completion.strip()!r} is not one "
                                    f"of the labels ({', '.join(self.labels)}): every held-out row "
                                    f"is scored as a label decision; fix the row, add the label "
                                    f"(--labels), or turn label evaluation off (--no-label-eval: "
                                    f"held-out loss only)")
        # one candidate row per (row, label); the single-token plan where every label is one token
        self.cands, self.extra = self._candidates(heldout)

    def encode_candidate(self, ex, label):
        c = self.cfg
        return encode_row(with_completion(ex.obj, label), self.tok, c.chat_template, c.max_len,
                          c.truncation_side, ex.where)

    def _candidates(self, rows):
        """(one candidate row per (row, label), per row [(answer position, label token)] when every
        label is one token at the same position after an identical prefix, else None)."""
        if not self.labels:
            return [], None
        cands = [self.encode_candidate(ex, lab) for ex in rows for lab in self.labels]
        L, end = len(self.labels), reply_end(self.tok, self.cfg.chat_template)
        extra = []
        for j, ex in enumerate(rows):
            p0 = next(t for t, x in enumerate(ex.labels) if x != IGNORE)
            extra.append([])
            for c in cands[j * L:(j + 1) * L]:
                q0 = next(t for t, x in enumerate(c.labels) if x != IGNORE)
                sup = [x for x in c.labels if x != IGNORE]
                if q0 != p0 or c.ids[:p0 + 1] != ex.ids[:p0 + 1] or len(sup) != 2 or sup[1] != end:
                    return cands, None
                extra[j].append((p0, sup[0]))
        return cands, extra

    def label_matrix(self, rows, adapters_on=True, plan=None, scorer=None):
        """The one label-matrix builder: (n, L) log-probs of each label as the completion of each
        row, and the scoring pass's RowScores. One pass over the rows (the label tokens' log-probs
        at the answer position) when the labels are single tokens, else one over the candidate rows.
        plan: _candidates(rows) when known. The label probabilities within the label set are a
        softmax of a row (two-way for two labels): not the model's probability of emitting it."""
        cands, extra = plan or self._candidates(rows)
        scorer = scorer or self.scorer
        if extra is not None:
            sc = scorer.scores(rows, adapters_on, extra)
            M = sc.extra
        else:
            sc = scorer.scores(cands, adapters_on)
            M = [s for s, _ in sc.sums]
        return np.array(M, np.float64).reshape(len(rows), len(self.labels)), sc

    def label_logprobs(self, rows, adapters_on=True):
        """For the rows whose completion is one of the labels: (their indices, label_matrix)."""
        idx = [i for i, ex in enumerate(rows) if ex.completion.strip() in self.labels]
        if not idx:
            return idx, np.zeros((0, len(self.labels)))
        return idx, self.label_matrix([rows[i] for i in idx], adapters_on)[0]

    def scores(self, adapters_on, with_format=True) -> Scores:
        """Held-out loss (per row), the label matrix, whether each row's greedy continuation is
        exactly one label then end-of-turn (format; in single-token mode a second pass over the rows
        whose greedy label is not the true one, skipped without with_format), preservation loss."""
        L, rows = len(self.labels), self.heldout
        truth = [self.labels.index(ex.completion.strip()) for ex in rows] if L else []
        fmt = []
        if not L:                                   # no label decisions: held-out loss only
            held, M = self.scorer.row_logprobs(rows, adapters_on), np.zeros((0, 0))
        elif self.extra is not None:
            M, sc = self.label_matrix(rows, adapters_on, (self.cands, self.extra))
            held = sc.sums
            # greedy: the first token is the label whose token is the argmax at the answer position;
            # then end-of-turn must be the argmax after it (on the row carrying that label)
            pending = []
            for j, t in enumerate(truth):
                g = [lab for lab, flag in enumerate(sc.extra_greedy[j]) if flag]
                fmt.append(False if not g else sc.greedy[j] if g[0] == t else None)
                if g and g[0] != t:
                    pending.append((j, self.cands[j * L + g[0]]))
            if not with_format:
                fmt = []
            elif pending:
                for (j, _), flag in zip(
                    pending, self.scorer.scores([c for _, c in pending], adapters_on).greedy):
                    fmt[j] = flag
        else:
            M, sc = self.label_matrix(rows, adapters_on, (self.cands, None))
            # the true label's candidate is the row
            held = [sc.sums[j * L + t] for j, t in enumerate(truth)]
            # greedy reproduces a candidate (label + end-of-turn) iff every one of its tokens is
            # greedy
            fmt = [any(sc.greedy[j * L:(j + 1) * L]) for j in range(len(rows))]
        k = int(sum(int(np.argmax(M[j])) == t for j, t in enumerate(truth)))
        pres = self.scorer.row_logprobs(self.passages, adapters_on) if self.passages else []
        return Scores(held, evidence.mean_loss(held) if held else float("nan"), k, len(truth), M,
                      truth, fmt, evidence.mean_loss(pres) if pres else 0.0)

    def surfaces(self, sc: Scores, adapters_on) -> Surfaces:
        """Calibration, format (with up to format_examples failures generated verbatim), slices and
        the label decisions of one scoring pass."""
        M, truth, fmt = sc.label_lp, sc.truth, sc.format
        slices = evidence.slices(self.heldout, sc.held, range(len(truth)), M, truth)
        out = Surfaces(evidence.calibration(M, truth), slices,
                       [int(x) for x in M.argmax(1)] if len(truth) else [])
        if fmt:
            out.format_valid, out.format_n = float(np.mean(fmt)), len(fmt)
            shown = [j for j, f in enumerate(fmt) if not f][:self.cfg.format_examples]
            out.format_failures = self._group().from_root(
                self._generate_failures, shown, adapters_on)
        return out

    def _group(self):
        """Rank 0 alone runs the few sequential generations and the fp32 copy of the base (they
        gain nothing from sharding, and idle ranks free a shared device)."""
        return self.scorer.group or Single()

    def _generate_failures(self, which, adapters_on):
        """Greedy generation (KV cache, up to format_tokens new tokens) on held-out prompts: the
        text a caller would have received."""
        if not which:
            return []
        from vkdsl.models.generate import Generator
        N = self.cfg.format_tokens
        prompts = []
        for j in which:
            ex = self.heldout[j]
            p0 = next(t for t, x in enumerate(ex.labels) if x != IGNORE)
            prompts.append((ex, ex.ids[:p0 + 1]))
        saved = self.model.lora
        if not adapters_on:
            self.model.lora = {}
        ctx = self.model.cfg.context_length
        stop = {self.tok.eos_id, reply_end(self.tok, self.cfg.chat_template)}
        # the failures decode together (one prefill, one step per token for all of them)
        B = Generator.batch_for(self.model.cfg, len(prompts))
        try:
            gen = Generator(self.model, min(ctx, max(len(p) for _, p in prompts) + N), batch=B)
            out = []
            for s in range(0, len(prompts), B):
                part = prompts[s:s + B]
                news = gen.generate_many([p for _, p in part],
                                         max(1, min(N, ctx - max(len(p) for _, p in part))),
                                         stop=stop)
                out += [{"row": ex.where, "expected": ex.completion.strip(),
                         "generated": self.tok.decode(new)} for (ex, _), new in zip(part, news)]
        finally:
            self.model.lora = saved
        return out

    def fp32_decisions(self, n_rows):
        """Label decisions on the first n_rows labelled held-out rows with the same adapters on the
        base dequantized to fp32 (the packed-quantized kernels' stability), beside the packed
        ones."""
        return self._group().from_root(self._fp32_decisions, n_rows)

    def _fp32_decisions(self, n_rows):
        n = min(n_rows, len(self.heldout)) if self.labels else 0
        if not n or self.cfg.quant == "none":
            return None
        fp = build_model(self.ckpt, quant="none")
        fp.lora = dict(self.model.lora)
        scorer = Scorer(fp, self.pad, self.cfg.bucket, self.cfg.max_len, self.cfg.eval_batch)
        plan = (self.cands[:n * len(self.labels)], None if self.extra is None else self.extra[:n])
        M, _ = self.label_matrix(self.heldout[:n], True, plan, scorer)
        del fp, scorer
        gc.collect()          # its weights and programs leave the device now (train.memplan)
        return [int(x) for x in M.argmax(1)]
