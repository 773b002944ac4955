"""Row packing: several short rows share one sequence instead of each padding to the longest.

Rows are placed first-fit, in batch order, into sequences of T tokens: the micro-batch's own length
(the bucketed longest row), so packing never lengthens a sequence and only removes padded ones; or,
for long data, a fixed window (TrainConfig.window: data.WindowSampler fills the windows first).
Inside a sequence each row restarts its positions at 0 and sees only its own tokens (block-
diagonal causal attention), so every row's logits are what it would get alone: the model needs
the per-token positions and row spans (models.llama.Llama.forward, `positions=`, `spans=`).

A Packing maps arrays in the padded layout (B, T, ...) to the packed one (P, T, ...) and the
supervised positions' order between the two (for logits computed or cached row by row)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .data import IGNORE


@dataclass
class Packing:
    T: int
    lengths: np.ndarray              # (B,) real tokens per row
    place: list                      # per row: (sequence, offset)
    n_seq: int

    @classmethod
    def plan(cls, lengths, T: int, min_seq: int = 0) -> "Packing":
        """First-fit placement; min_seq: at least this many sequences (the rest padding), so a
        window-mode micro-batch always has the same shape (one program)."""
        free, place = [], []
        for n in (int(x) for x in lengths):
            if not 0 < n <= T:
                raise ValueError(f"packing: a row of {n} tokens does not fit a sequence of {T}")
            s = next((i for i, f in enumerate(free) if f >= n), None)
            if s is None:
                s = len(free)
                free.append(T)
            place.append((s, T - free[s]))
            free[s] -= n
        return cls(T, np.asarray(lengths, np.int64), place, max(len(free), min_seq))

    @property
    def packed(self) -> bool:
        """True when some sequence holds more than one row."""
        return self.n_seq < len(self.place)

    def apply(self, arr: np.ndarray, fill) -> np.ndarray:
        """(B, T, ...) padded layout -> (P, T, ...): row b's real tokens moved to its place."""
        out = np.full((self.n_seq, self.T) + arr.shape[2:], fill, arr.dtype)
        for b, ((s, o), n) in enumerate(zip(self.place, self.lengths)):
            out[s, o:o + n] = arr[b, :n]
        return out

    def positions(self) -> np.ndarray:
        """(P, T) int32: each token's position within its own row (0 on padding)."""
        pos = np.zeros((self.n_seq, self.T), np.int32)
        for (s, o), n in zip(self.place, self.lengths):
            pos[s, o:o + n] = np.arange(n)
        return pos

    def spans(self) -> np.ndarray:
        """(P, T, 2) int32: each token's row [start, end) within its sequence; a padding token is a
        row of its own, [t, t + 1). Rows are contiguous from offset 0 and padding follows them, so
        starts and ends never decrease along T (what ops.attention's fused kernels rely on)."""
        t = np.arange(self.T, dtype=np.int32)
        span = np.stack(np.broadcast_arrays(t, t + 1), -1)
        span = np.repeat(span[None], self.n_seq, 0)
        for (s, o), n in zip(self.place, self.lengths):
            span[s, o:o + n] = (o, o + n)
        return span

    def supervised_order(self, labels: np.ndarray) -> np.ndarray:
        """For the packed layout's supervised positions in flat order, the index of the same token
        among the padded layout's supervised positions (flat order): packed[i] =
        padded[order[i]]."""
        B, T = labels.shape
        live = labels != IGNORE
        index = np.full((B, T), -1, np.int64)
        index[live] = np.arange(int(live.sum()))
        return self.apply(index, -1).reshape(-1)[self.apply(live, False).reshape(-1)]

    def efficiency(self, labels: np.ndarray) -> dict:
        """Tokens computed, real and supervised, packed and as padded rows would have been."""
        return {"computed": self.n_seq * self.T, "computed_unpacked": len(self.place) * self.T,
                "real": int(self.lengths.sum()), "supervised": int((labels != IGNORE).sum())}


def efficiency_line(tk: dict, pack: bool) -> str:
    """What a run says of its SFT positions: computed, real, supervised, and how many micro-batches
    packed rows together (tk: the Run's token counts)."""
    return (f"SFT token efficiency: {tk['computed']:,} positions computed, {tk['real']:,} real "
            f"({100 * tk['real'] / tk['computed']:.0f}%; the rest is padding), "
            f"{tk['supervised']:,} supervised ({100 * tk['supervised'] / tk['computed']:.1f}%); "
            + (f"{tk['packed']} of {tk['micro']} micro-batches packed several rows into a sequence"
               if pack else "packing off"))
