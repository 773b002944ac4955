"""The frozen prefix: layers below the first adapted one never change during training, so the
residual stream entering that layer is a function of the row's tokens alone. It is computed once
per row (adapter-free, exact) and fed to every later forward -- SFT steps, TMKL's base logits,
evaluation, DPO and its reference -- which then run only the adapted layers.

Causal attention makes position t depend on tokens 0..t only, so a row is keyed by its tokens up
to its last scored position; later positions (right padding) are fed zeros, which no scored
position can see. Another data set, template or length can therefore never hit a stale entry."""
from __future__ import annotations

import hashlib

import numpy as np

import vkdsl

from .data import IGNORE


def first_adapted_layer(names: list[str]) -> int:
    return min(int(n.split(".")[1]) for n in names) if names else 0


class FrozenPrefix:
    """feed(ids, labels) -> what the traced functions take: the ids themselves when start == 0,
    else the (B, T, dim) residual stream entering layer `start`."""

    def __init__(self, model, start: int, budget_bytes: int):
        self.model, self.start = model, start if budget_bytes > 0 else 0
        self.budget, self.bytes, self.rows = int(budget_bytes), 0, {}
        self.hits = self.misses = 0
        def frozen_prefix(ids):     # named: the profile files its dispatches by this name
            return model.forward(ids, stop=self.start)
        self.fn = vkdsl.trace(frozen_prefix) if self.start else None

    @staticmethod
    def key(ids_row: np.ndarray, scored: np.ndarray) -> tuple[bytes, int]:
        sup = np.flatnonzero(scored)
        end = int(sup[-1]) + 1 if len(sup) else 0
        return hashlib.sha256(ids_row[:end].tobytes()).digest(), end

    def feed(self, ids: np.ndarray, labels: np.ndarray,
             extra_scored: np.ndarray | None = None) -> np.ndarray:
        """labels (B, T): positions with a label are scored; extra_scored (B, T) bool marks more."""
        if not self.start:
            return ids
        scored = labels != IGNORE
        if extra_scored is not None:
            scored = scored | extra_scored
        B, T = ids.shape
        keys = [self.key(ids[b], scored[b]) for b in range(B)]
        out = np.zeros((B, T, self.model.cfg.dim), np.float32)
        miss, seen = [], {}
        for b, (k, end) in enumerate(keys):
            if end and k not in self.rows and k not in seen:
                seen[k] = len(miss)
                miss.append(b)
        self.hits += B - len(miss)
        if miss:
            # only the rows not cached yet, padded to a power of two (a few batch shapes, few
            # programs)
            self.misses += 1
            n = min(B, 1 << (len(miss) - 1).bit_length())
            full = np.asarray(self.fn(ids[miss + miss[:1] * (n - len(miss))]), np.float32)
            for j, b in enumerate(miss):
                k, end = keys[b]
                if self.bytes + 4 * end * out.shape[2] <= self.budget:
                    self.rows[k] = full[j, :end].copy()
                    self.bytes += self.rows[k].nbytes
        for b, (k, end) in enumerate(keys):
            if end:
                out[b, :end] = self.rows[k] if k in self.rows else full[seen[k], :end]
        return out
