"""Scoring: the forward over scored positions only. Per row, the sum of next-token log-probs over
its supervised positions (and, on request, the log-probs of given tokens at given positions),
adapters on or off, in batches of one shape, shared out over the ranks of a parallel run."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import vkdsl
from vkdsl.ops import losses

from .data import IGNORE, Example, collate
from .prefix import FrozenPrefix
from .step import head_rows, selected_hidden


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
        self.model, self.pad, self.bucket = model, pad_id, bucket
        self.max_len, self.batch = max_len, batch
        self.keep = keep
        self.group = group
        self.prefix = prefix or FrozenPrefix(model, 0, 0)
        self.fns = {on: self._build(on) for on in (True, False)}

    def _build(self, on):
        @vkdsl.trace(keep=self.keep)
        def score(ids, pos, labels):
            h = selected_hidden(self.model, ids, pos, on, self.prefix.start)
            return head_rows(self.model, h, lambda lg, lab: (losses.token_logprobs(lg, lab)[0],
                                                             losses.greedy_gap(lg, lab)), labels,
                             differentiable=False)
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
        local = self._split(self._scores(rows, mine, adapters_on, extra),
                            [len(rows[s:s + self.batch]) for s in mine])
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
            parts.append((sc.sums[k:k + n], sc.greedy[k:k + n], sc.extra[k:k + n],
                          sc.extra_greedy[k:k + n]))
            k += n
        return parts

    def _scores(self, rows, starts, adapters_on, extra) -> RowScores:
        out = RowScores([], [], [], [])
        for s in starts:
            chunk = rows[s:s + self.batch]
            fill = ([Example(chunk[0].ids, [IGNORE] * len(chunk[0].ids), "", "")]
                    * (self.batch - len(chunk)))
            # one batch shape: fewer programs
            ids, lab = collate(chunk + fill, self.pad, self.bucket, self.max_len)
            T = ids.shape[1]
            pos, sl, owner = [], [], []
            scored = np.zeros(ids.shape, bool)
            for i in range(len(chunk)):
                for t in np.flatnonzero(lab[i] != IGNORE):
                    pos.append(i * T + t), sl.append(lab[i, t]), owner.append((i, -1))
                for j, (t, tokid) in enumerate((extra[s + i] if extra else [])):
                    pos.append(i * T + t), sl.append(tokid), owner.append((i, j))
                    scored[i, t] = True
            g = 16 if len(pos) <= 64 else 64  # few scored positions (labels): a 16-row LM head
            S = -(-len(pos) // g) * g
            p = np.zeros(S, np.int32)
            lb = np.full(S, IGNORE, np.int32)
            p[:len(pos)], lb[:len(pos)] = pos, sl
            lp, gap = (np.asarray(a, np.float64)
                       for a in self.fns[adapters_on](self.prefix.feed(ids, lab, scored), p, lb))
            for i in range(len(chunk)):
                mine = [k for k, o in enumerate(owner) if o == (i, -1)]
                ext = [k for k, o in enumerate(owner) if o[0] == i and o[1] >= 0]
                out.sums.append((float(lp[mine].sum()), len(mine)))
                out.greedy.append(bool(np.all(gap[mine] == 0)))
                out.extra.append([float(lp[k]) for k in ext])
                out.extra_greedy.append([bool(gap[k] == 0) for k in ext])
        return out
