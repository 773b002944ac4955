"""The held-out side of a run: scoring the held-out rows (single-token label scoring when every
label is one token after the same prompt, else one candidate row per label) and the preservation
passages, adapters on or off, and the failure surfaces drawn from one scoring pass: label
decisions, calibration, format (greedy output = one label + end-of-turn, failures generated
verbatim), slices, and the decisions again on the base dequantized to fp32."""
from __future__ import annotations

import numpy as np

from vkdsl.models.llama import Llama

from . import evidence
from .data import IGNORE, DataError, encode_row, reply_end, with_completion
from .distributed import Single


class Heldout:
    def __init__(self, cfg, model, ckpt, tok, pad, scorer, heldout, passages):
        self.cfg, self.model, self.ckpt, self.tok, self.pad, self.scorer = cfg, model, ckpt, tok, pad, scorer
        self.heldout, self.passages = heldout, passages
        self.labels = list(cfg.labels) if cfg.label_eval else []
        if self.labels:             # every held-out row is a label decision: none drops out unseen
            for ex in heldout:
                if ex.completion.strip() not in self.labels:
                    raise DataError(f"{ex.where}: completion {ex.completion.strip()!r} is not one of the labels "
                                    f"({', '.join(self.labels)}): every held-out row is scored as a label decision; "
                                    f"fix the row, add the label (--labels), or turn label evaluation off "
                                    f"(--no-label-eval: held-out loss only)")
        self.cand_idx, self.cands = evidence.label_candidates(heldout, self.labels, self.encode_candidate)
        self.extra = self._single_token_labels(heldout, self.cand_idx, self.cands)

    def encode_candidate(self, ex, label):
        c = self.cfg
        return encode_row(with_completion(ex.obj, label), self.tok, c.chat_template, c.max_len,
                          c.truncation_side, ex.where)

    def _single_token_labels(self, rows, idx, cands):
        """Per row [(answer position, label token) for each label] when every label is one token
        at the same position after an identical prefix; else None (score candidates)."""
        L, end = len(self.labels), reply_end(self.tok, self.cfg.chat_template)
        extra = [[] for _ in rows]
        for j, i in enumerate(idx):
            ex = rows[i]
            p0 = next(t for t, x in enumerate(ex.labels) if x != IGNORE)
            for c in cands[j * L:(j + 1) * L]:
                q0 = next(t for t, x in enumerate(c.labels) if x != IGNORE)
                sup = [x for x in c.labels if x != IGNORE]
                if q0 != p0 or c.ids[:p0 + 1] != ex.ids[:p0 + 1] or len(sup) != 2 or sup[1] != end:
                    return None
                extra[i].append((p0, sup[0]))
        return extra

    def label_logprobs(self, rows, adapters_on=True):
        """For the rows whose completion is one of cfg.labels: (their indices, (n, L) log-probs of
        each label as the completion). The label probabilities within the label set are softmax of a
        row (two-way for two labels): not the model's probability of emitting that token."""
        idx, cands = evidence.label_candidates(rows, self.labels, self.encode_candidate)
        if not idx:
            return idx, np.zeros((0, len(self.labels)))
        extra = self._single_token_labels(rows, idx, cands)
        if extra is not None:
            _, ext = self.scorer.row_logprobs(rows, adapters_on, extra)
            return idx, np.array([ext[i] for i in idx], np.float64)
        sc = self.scorer.row_logprobs(cands, adapters_on)
        return idx, np.array([s for s, _ in sc], np.float64).reshape(len(idx), len(self.labels))

    def scores(self, adapters_on, with_format=True):
        """Held-out loss (per row), label log-probs of the labelled rows, whether each labelled row's
        greedy continuation is exactly one label then end-of-turn (format; in single-token mode a
        second pass over the rows whose greedy label is not the true one, skipped without
        with_format), preservation loss."""
        L = len(self.labels)
        truth = [self.labels.index(self.heldout[i].completion.strip()) for i in self.cand_idx]
        if self.extra is not None:
            sc = self.scorer.scores(self.heldout, adapters_on, self.extra)
            held = sc.sums
            M = np.array([sc.extra[i] for i in self.cand_idx], np.float64).reshape(len(self.cand_idx), L)
            # greedy: the first token is the label whose token is the argmax at the answer position;
            # then end-of-turn must be the argmax after it (on the row carrying that label)
            fmt, pending = [], []
            for j, i in enumerate(self.cand_idx):
                g = [lab for lab, flag in enumerate(sc.extra_greedy[i]) if flag]
                if not g:
                    fmt.append(False)
                elif g[0] == truth[j]:
                    fmt.append(sc.greedy[i])
                else:
                    fmt.append(None)
                    pending.append((j, self.cands[j * L + g[0]]))
            if not with_format:
                fmt = []
            elif pending:
                for (j, _), flag in zip(pending, self.scorer.scores([c for _, c in pending], adapters_on).greedy):
                    fmt[j] = flag
        else:
            lab_set = set(self.cand_idx)
            rest = [ex for i, ex in enumerate(self.heldout) if i not in lab_set]
            cs = self.scorer.scores(self.cands, adapters_on) if self.cands else None
            cand = cs.sums if cs else []
            other = self.scorer.row_logprobs(rest, adapters_on) if rest else []
            M = np.array([s for s, _ in cand], np.float64).reshape(len(self.cand_idx), L)
            # greedy reproduces a candidate (label + end-of-turn) iff every one of its tokens is greedy
            fmt = [any(cs.greedy[j * L:(j + 1) * L]) for j in range(len(self.cand_idx))]
            held, it = [], iter(other)
            pos = {i: j for j, i in enumerate(self.cand_idx)}
            for i, ex in enumerate(self.heldout):       # the true label's candidate is the row itself
                held.append(cand[pos[i] * L + self.labels.index(ex.completion.strip())] if i in pos else next(it))
        n = len(truth)
        k = int(sum(int(np.argmax(M[j])) == t for j, t in enumerate(truth)))
        pres = self.scorer.row_logprobs(self.passages, adapters_on) if self.passages else []
        return {"held": held, "heldout_loss": evidence.mean_loss(held) if held else float("nan"),
                "acc": k / n if n else None, "k": k, "n": n, "label_lp": M, "truth": truth, "format": fmt,
                "pres": evidence.mean_loss(pres) if pres else 0.0}

    def surfaces(self, sc, adapters_on) -> dict:
        """Calibration, format (with up to format_examples failures generated verbatim), slices and the label
        decisions of one scoring pass (_scores)."""
        M, truth, fmt = sc["label_lp"], sc["truth"], sc["format"]
        out = {"calibration": evidence.calibration(M, truth),
               "slices": evidence.slices(self.heldout, sc["held"], self.cand_idx, M, truth),
               "decisions": [int(x) for x in M.argmax(1)] if len(truth) else []}
        if fmt:
            out["format_valid"] = float(np.mean(fmt))
            out["format_n"] = len(fmt)
            shown = [j for j, f in enumerate(fmt) if not f][:self.cfg.format_examples]
            out["format_failures"] = self._group().from_root(self._generate_failures, shown, adapters_on)
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
            ex = self.heldout[self.cand_idx[j]]
            p0 = next(t for t, x in enumerate(ex.labels) if x != IGNORE)
            prompts.append((ex, ex.ids[:p0 + 1]))
        saved = self.model.lora
        if not adapters_on:
            self.model.lora = {}
        ctx = self.model.cfg.context_length
        try:
            gen = Generator(self.model, min(ctx, max(len(p) for _, p in prompts) + N))
            out = []
            for ex, prompt in prompts:
                new, _ = gen.generate(prompt, max(1, min(N, ctx - len(prompt))),
                                      stop={self.tok.eos_id, reply_end(self.tok, self.cfg.chat_template)})
                out.append({"row": ex.where, "expected": ex.completion.strip(), "generated": self.tok.decode(new)})
        finally:
            self.model.lora = saved
        return out

    def fp32_decisions(self, n_rows):
        """Label decisions on the first n_rows labelled held-out rows with the same adapters on the
        base dequantized to fp32 (the packed-quantized kernels' stability), beside the packed ones."""
        return self._group().from_root(self._fp32_decisions, n_rows)

    def _fp32_decisions(self, n_rows):
        js = list(range(min(n_rows, len(self.cand_idx))))
        if not js or self.cfg.quant == "none":
            return None
        fp = Llama(self.ckpt, quant="none")
        fp.lora = dict(self.model.lora)
        scorer = evidence.Scorer(fp, self.pad, self.cfg.bucket, self.cfg.max_len, self.cfg.eval_batch)
        L = len(self.labels)
        rows = [self.heldout[self.cand_idx[j]] for j in js]
        if self.extra is not None:
            ext = scorer.scores(rows, True, [self.extra[self.cand_idx[j]] for j in js]).extra
            M = np.array(ext, np.float64)
        else:
            M = np.array([s for s, _ in scorer.row_logprobs([c for j in js for c in self.cands[j * L:(j + 1) * L]])],
                         np.float64).reshape(len(js), L)
        del fp, scorer
        return [int(x) for x in M.argmax(1)]
