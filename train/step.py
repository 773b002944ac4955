"""One optimizer step: traced gradients on the device, AdamW on the host.

Only the supervised positions reach the LM head: the hidden states at those positions are
gathered (S rows) before the (dim x vocab) head, so the big logits tensor is (S, V), not
(B*T, V). The objective per micro-batch is (sum CE + lambda * sum TMKL) / N, N = supervised
tokens of the whole optimizer step: k micro-batches then give exactly the gradient of one
batch k times larger. With lambda = 0 the base forward is never built (plain SFT graph).

The adapter update (AdamW, decoupled decay, global-norm clipping) runs in numpy float32 on
the few LoRA tensors; the new values are written back into the same device buffers."""
from __future__ import annotations

import hashlib

import numpy as np

import vkdsl
from vkdsl.autograd import grad, rowwise, saved_activations
from vkdsl.models.llama import head_in_chunks
from vkdsl.ops import losses
from vkdsl.ops.losses import IGNORE
from vkdsl.runtime import default_device

from .distributed import my_share, sum_over_ranks
from .packing import Packing
from .prefix import FrozenPrefix

# TrainConfig.activations -> the kept values' dtype
STORAGE = {"fp32": "float32", "fp16": "float16"}


def kept_dtype(activations: str) -> str:
    """The dtype the backward keeps activations in; fp16 on a device without 16-bit storage is
    refused."""
    dev = default_device()
    if activations == "fp16" and not dev.limits.storage16:
        raise ValueError(f"activations = fp16 needs 16-bit storage "
                         f"(storageBuffer16BitAccess), which {dev.info.name} lacks: use "
                         f"activations = fp32")
    return STORAGE[activations]


def select(labels: np.ndarray, bucket: int = 16, size: int = 0):
    """labels (B, T) -> flat positions (S,) int32 and their labels (S,), S padded to a multiple
    of `bucket` (or to `size` when they fit it) with position 0 / label -100 (ignored)."""
    flat = labels.reshape(-1)
    pos = np.flatnonzero(flat != IGNORE).astype(np.int32)
    S = size if 0 < size and len(pos) <= size else max(bucket, -(-len(pos) // bucket) * bucket)
    p = np.zeros(S, np.int32)
    lab = np.full(S, IGNORE, np.int32)
    p[:len(pos)], lab[:len(pos)] = pos, flat[pos]
    return p, lab


def selected_hidden(model, ids, pos, adapters_on, start=0, packing=(), checkpoint=0):
    """The final hidden states (S, dim) at the flat positions pos. ids: (B, T) token ids, or with
    start > 0 the residual stream entering layer `start` (train.prefix.FrozenPrefix).
    packing: () or (positions, spans) of packed rows (train.packing). checkpoint: layers per
    recomputed group in the backward (Llama.forward; 0: every activation kept)."""
    B, T = ids.shape[:2]
    pk = dict(zip(("positions", "spans"), packing))
    h = model.forward(ids, adapters_on=adapters_on, hidden_only=True, start=start,
                      checkpoint=checkpoint, **pk)  # (B, T, dim)
    return h.reshape(B * T, model.cfg.dim).gather(pos)


def head_rows(model, h, fn, *row_inputs, differentiable=True):
    """The LM head fused with a per-row loss, in chunks of model.logit_rows rows (256, or what one
    storage binding holds of a large vocabulary): fn(logits, *row_inputs chunk) -> (objective rows,
    *report rows). Each chunk's logits live only for its own forward (vkdsl.autograd.rowwise);
    returns the concatenated rows of each output. A row input is an (S, ...) tensor, or a tuple of
    its chunks (base logits, which one binding may not hold whole: see split_rows).
    differentiable=False (scoring): no gradient rows, even where h depends on trainable adapters."""
    outs, n = [], model.logit_rows
    for k, s in enumerate(range(0, h.shape[0], n)):
        xs = [x[k] if isinstance(x, tuple) else x[s:s + n] for x in row_inputs]
        rows = lambda hc, *xs: fn(model.head(hc), *xs)          # noqa: E731
        part = rowwise(rows, h[s:s + n], *xs) if differentiable else rows(h[s:s + n], *xs)
        outs.append(part if isinstance(part, tuple) else (part,))
    return [o[0] if len(outs) == 1 else _cat([p[i] for p in outs])
            for i, o in enumerate(zip(*outs))]


def split_rows(a: np.ndarray, n: int) -> list:
    """a's rows in chunks of n (head_rows' chunks), each its own input buffer."""
    return [a[s:s + n] for s in range(0, len(a), n)]


def _cat(parts):
    n = sum(p.shape[0] for p in parts)
    out, at = None, 0
    for p in parts:
        piece = p.pad(((at, n - at - p.shape[0]),))
        out = piece if out is None else out + piece
        at += p.shape[0]
    return out


def build_grad_fn(model, params, lam: float, base_input: bool = False, start: int = 0,
                  packed: bool = False, checkpoint: int = 0, keep: int = 0,
                  activations: str = "fp32"):
    """Traced (ids (B,T), pos (S,), labels (S,), inv_n (1,) [, positions (B,T), spans (B,T,2)] [,
    base logits (S,V) as split_rows' chunks]) -> (ce_sum, kl_sum, *grads). base_input: the base
    model's logits come in (cached) instead of a base forward. start > 0: ids is the frozen prefix's
    output (train.prefix). packed: rows share sequences (train.packing): their positions and row
    spans come in too. checkpoint: layers per recomputed group (0: keep every activation). keep:
    programs held at once (vkdsl.trace; 0: one per shape seen). activations: fp32, or fp16 storage
    of what the backward keeps (vkdsl.autograd.saved_activations)."""
    kept = kept_dtype(activations)

    def rows(lg, labels, *base):
        ce = -losses.token_logprobs(lg, labels)[0]
        if not base:
            return ce, ce
        # cached logits, or the base's hidden rows
        base_lg = base[0] if base_input else model.head(base[0])
        kl = losses.tmkl_rows(lg, base_lg, labels)
        return ce + kl * lam, ce, kl

    @vkdsl.trace(keep=keep)
    def grad_step(ids, pos, labels, inv_n, *rest):
        pk, base = (rest[:2], rest[2:]) if packed else ((), rest)
        h = selected_hidden(model, ids, pos, True, start, pk, checkpoint)
        base_rows = () if lam <= 0 else (tuple(base),) if base_input else \
            (selected_hidden(model, ids, pos, False, start, pk),)
        obj, ce, *kl = head_rows(model, h, rows, labels, *base_rows)
        ce_sum = ce.sum()
        kl_sum = kl[0].sum() if kl else ce_sum * 0.0
        with saved_activations(kept):
            gs = grad(obj.sum() * inv_n[0], params)
        return [ce_sum, kl_sum] + gs
    return grad_step


class BaseLogitCache:
    """The base model's logits at each training row's supervised positions, computed once (adapter
    off) and kept within a byte budget. During SFT they never change, so TMKL needs no base forward
    after a row's first visit. Rows are keyed by their tokens up to the last supervised position
    (what those logits depend on, causally), so another data set can never hit a stale entry."""

    def __init__(self, model, budget_bytes: int, start: int = 0):
        self.budget, self.bytes, self.rows = int(budget_bytes), 0, {}
        self.hits = self.misses = 0
        self.model = model
        def base_hidden(ids, pos):  # named: the profile files its dispatches by these names
            return selected_hidden(model, ids, pos, False, start)

        def base_head(h):
            return model.head(h)
        self.hidden, self.head = vkdsl.trace(base_hidden), vkdsl.trace(base_head)

    def fn(self, ids, pos) -> np.ndarray:
        """(S, V) base logits at the flat positions pos, the head in chunks one binding holds."""
        return head_in_chunks(self.head, np.asarray(self.hidden(ids, pos)), self.model.logit_rows)

    @staticmethod
    def key(ids_row: np.ndarray, lab_row: np.ndarray) -> bytes:
        sup = np.flatnonzero(lab_row != IGNORE)
        end = int(sup[-1]) + 1 if len(sup) else 0
        return hashlib.sha256(ids_row[:end].tobytes() + b"|" + lab_row[:end].tobytes()).digest()

    def logits(self, ids: np.ndarray, labels: np.ndarray, pos: np.ndarray, feed=None) -> np.ndarray:
        """(S, V) base logits in select()'s order for this micro-batch (padding rows zero).
        feed: what the traced function takes for ids (the frozen prefix's output), when not ids."""
        keys = [self.key(ids[b], labels[b]) for b in range(ids.shape[0])]
        counts = [int((labels[b] != IGNORE).sum()) for b in range(ids.shape[0])]
        if any(k not in self.rows for k in keys):
            self.misses += 1
            full = np.asarray(self.fn(ids if feed is None else feed, pos), np.float32)
            off = 0
            for k, n in zip(keys, counts):
                rows = full[off:off + n]
                if k not in self.rows and self.bytes + rows.nbytes <= self.budget:
                    self.rows[k] = rows.copy()
                    self.bytes += rows.nbytes
                off += n
            return full
        self.hits += 1
        out = np.zeros((len(pos), next(iter(self.rows.values())).shape[1]), np.float32)
        off = 0
        for k, n in zip(keys, counts):
            out[off:off + n] = self.rows[k]
            off += n
        return out


class HostAdamW:
    """AdamW as ops.optim.adamw_update, on numpy float32 arrays."""

    def __init__(self, shapes, betas, eps, wd):
        self.b1, self.b2 = betas
        self.eps, self.wd, self.t = eps, wd, 0
        self.m = [np.zeros(s, np.float32) for s in shapes]
        self.v = [np.zeros(s, np.float32) for s in shapes]

    def update(self, ps, gs, lr):
        self.t += 1
        c1 = np.float32(1.0 / (1.0 - self.b1 ** self.t))
        c2 = np.float32(1.0 / (1.0 - self.b2 ** self.t))
        out = []
        for i, (p, g) in enumerate(zip(ps, gs)):
            self.m[i] = self.m[i] * np.float32(self.b1) + g * np.float32(1 - self.b1)
            self.v[i] = self.v[i] * np.float32(self.b2) + g * g * np.float32(1 - self.b2)
            upd = (self.m[i] * c1) / (np.sqrt(self.v[i] * c2) + np.float32(self.eps))
            out.append((p - np.float32(lr) * (upd + p * np.float32(self.wd))).astype(np.float32))
        return out

    def state(self):
        return {"t": self.t, **{f"m{i}": m for i, m in enumerate(self.m)},
                **{f"v{i}": v for i, v in enumerate(self.v)}}

    def load(self, st):
        self.t = int(st["t"])
        self.m = [np.asarray(st[f"m{i}"], np.float32) for i in range(len(self.m))]
        self.v = [np.asarray(st[f"v{i}"], np.float32) for i in range(len(self.v))]


def clip(gs, max_norm):
    norm = float(np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in gs)))
    if max_norm > 0 and norm > max_norm:
        s = np.float32(max_norm / (norm + 1e-6))
        gs = [g * s for g in gs]
    return gs, norm


def apply(params, opt, gs, lr, max_norm) -> float:
    """The update of every stage (train.loop): clip -> AdamW (host, float32) -> write back into the
    same device buffers; returns |g|."""
    gs, norm = clip(gs, max_norm)
    new = opt.update([p.numpy() for p in params], gs, lr)
    for p, a in zip(params, new):
        p.assign(vkdsl.tensor(a))
    return norm


class Stepper:
    """Accumulates micro-batch gradients and applies one AdamW update per optimizer step."""

    def __init__(self, model, params, cfg, prefix=None, base_cache=None):
        """prefix: train.prefix.FrozenPrefix (None: the whole model every step). base_cache: a
        BaseLogitCache of the same model and prefix to continue (None: a new one)."""
        prefix = prefix or FrozenPrefix(model, 0, 0)
        self.model, self.params, self.cfg, self.prefix = model, params, cfg, prefix
        budget = getattr(cfg, "tmkl_cache_bytes", 0)
        self.base_cache = None
        if cfg.tmkl > 0 and budget > 0:
            self.base_cache = (base_cache if base_cache is not None
                               else BaseLogitCache(model, budget, prefix.start))
        # window mode: every micro-batch is batch_size windows and head_rows head rows (a bound from
        # the data, set by the run), so one program serves every step and is planned exactly
        # (memplan)
        self.window = getattr(cfg, "window", 0)
        self.head_rows = 0  # window mode: supervised positions of the largest micro-batch (memplan)
        if self.window:
            self.base_cache = None  # TMKL's base forward runs in the step, on the windows
        def build(packed):
            return build_grad_fn(model, params, cfg.tmkl, base_input=self.base_cache is not None,
                                 start=prefix.start, packed=packed,
                                 checkpoint=getattr(cfg, "checkpoint_layers", 0),
                                 activations=getattr(cfg, "activations", "fp32"),
                                 keep=2 if self.window else 0)
        self.fn, self.fn_packed = build(False), build(True)
        self.pack = bool(getattr(cfg, "pack", False))
        self.opt = HostAdamW([p.shape for p in params], cfg.betas, cfg.eps, cfg.weight_decay)

    def release(self):
        """Free the step programs' device buffers (a later step builds them again)."""
        for fn in (self.fn, self.fn_packed):
            for prog, _, _ in fn.programs.values():
                prog.release()
            fn.programs.clear()

    def grads(self, micro, n_total):
        """micro: list of (ids, labels[, lengths]) numpy; n_total supervised tokens over all of
        them. With lengths (real tokens per row) and cfg.pack, rows are packed (train.packing) into
        sequences of cfg.window tokens, or of the micro-batch's length. -> (summed grads, ce_sum,
        kl_sum, {"computed": positions, "micro": n, "packed": n packed})."""
        acc, ce, kl = None, 0.0, 0.0
        count = {"computed": 0, "micro": len(micro), "packed": 0}
        inv = np.array([1.0 / n_total], np.float32)
        for ids, labels, *lengths in micro:
            pos, lab = select(labels)
            x = self.prefix.feed(ids, labels)
            base = None if self.base_cache is None else self.base_cache.logits(ids, labels, pos, x)
            pk = self.packing(lengths[0], ids.shape[1]) if self.pack and lengths else None
            if pk is not None and (pk.packed or self.window):
                out = self._packed(pk, ids, labels, x, base, inv)
                count["computed"] += pk.n_seq * pk.T
                count["packed"] += 1
            else:
                out = self.fn(x, pos, lab, inv, *self._chunks(base))
                count["computed"] += ids.size
            ce, kl = ce + float(out[0]), kl + float(out[1])
            gs = [np.asarray(g, np.float32) for g in out[2:]]
            acc = gs if acc is None else [a + g for a, g in zip(acc, gs)]
        return acc, ce, kl, count

    def packing(self, lengths, T):
        """Rows into sequences of the micro-batch's length T, or into batch_size windows."""
        if self.window:
            return Packing.plan(lengths, self.window, min_seq=self.cfg.batch_size)
        return Packing.plan(lengths, T)

    def _chunks(self, base):
        return () if base is None else split_rows(base, self.model.logit_rows)

    def _packed(self, pk, ids, labels, x, base, inv):
        """The step on packed rows: the frozen prefix's streams and cached base logits (computed row
        by row in the padded layout) are moved to the packed layout."""
        plab = pk.apply(labels, IGNORE)
        pos, lab = select(plab, size=self.head_rows)
        if base is not None:
            order = pk.supervised_order(labels)
            moved = np.zeros((len(pos),) + base.shape[1:], np.float32)
            moved[:len(order)] = base[order]
            base = moved
        feed = pk.apply(x, 0)
        return self.fn_packed(feed, pos, lab, inv, pk.positions(), pk.spans(), *self._chunks(base))

    def step(self, micro, lr, rehearsal=None, group=None):
        """gradient() then train.loop.apply (clip, AdamW, assign): the loop's step, for callers
        that drive the Stepper alone (probes, tests, bench)."""
        gs, rec = self.gradient(micro, rehearsal, group)
        rec["grad_norm"] = apply(self.params, self.opt, gs, lr, self.cfg.clip)
        return rec

    def gradient(self, micro, rehearsal=None, group=None):
        """-> (the step's unclipped gradient, its record: loss, tmkl, tokens, counts, raw_grads).
        rehearsal: (micro-batches of general text, weight w): the objective becomes the task's
        mean plus w times the general text's mean (each over its own supervised tokens).
        group (train.distributed): micro-batches are the whole step's on every rank; this rank
        computes its share, and one all-reduce of the flat gradient (with the loss sums) makes the
        step's gradient everywhere, normalized by the global token counts as in one process."""
        n_total = int(sum((m[1] != IGNORE).sum() for m in micro))
        if n_total == 0:
            raise ValueError("an optimizer step with no supervised token")
        share = micro if group is None else my_share(micro, group)
        nothing = (None, 0.0, 0.0, {"computed": 0, "micro": 0, "packed": 0})
        gs, ce, kl, count = self.grads(share, n_total) if share else nothing
        gs = gs if gs is not None else [np.zeros(p.shape, np.float32) for p in self.params]
        extra = {}
        if rehearsal is not None and rehearsal[1] > 0:
            rmicro, w = rehearsal
            n_r = int(sum((m[1] != IGNORE).sum() for m in rmicro))
            rshare = rmicro if group is None else my_share(rmicro, group)
            ce_r = 0.0
            if rshare:
                gr, ce_r, _, cr = self.grads(rshare, n_r / w)
                gs = [a + b for a, b in zip(gs, gr)]
                count["computed"] += cr["computed"]
            extra["rehearsal_loss"] = ce_r / n_r
        if group is not None and group.size > 1:
            counted = ("computed", "micro", "packed")        # every rank's, not only this one's
            gs, (ce, kl, ce_r, *n), info = sum_over_ranks(
                group, gs, [ce, kl, extra.get("rehearsal_loss", 0.0)] + [count[k] for k in counted])
            extra.update(info)
            count.update({k: int(v) for k, v in zip(counted, n)})
            if "rehearsal_loss" in extra:
                extra["rehearsal_loss"] = ce_r
        return gs, {"loss": ce / n_total, "tmkl": kl / n_total, "tokens": n_total, **count, **extra,
                    "raw_grads": gs}
