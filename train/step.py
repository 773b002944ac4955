"""One optimizer step: traced gradients on the device, AdamW on the host.

Only the supervised positions reach the LM head: the hidden states at those positions are
gathered (S rows) before the (dim x vocab) head, so the big logits tensor is (S, V), not
(B*T, V). The objective per micro-batch is (sum CE + lambda * sum TMKL) / N, N = supervised
tokens of the whole optimizer step: k micro-batches then give exactly the gradient of one
batch k times larger. With lambda = 0 the base forward is never built (plain SFT graph).

The adapter update (AdamW, decoupled decay, global-norm clipping) runs in numpy float32 on
the few LoRA tensors; the new values are written back into the same device buffers."""
from __future__ import annotations

import numpy as np

import vkdsl
from vkdsl.autograd import grad
from vkdsl.ops import losses

IGNORE = -100


def select(labels: np.ndarray, bucket: int = 16):
    """labels (B, T) -> flat positions (S,) int32 and their labels (S,), S padded to a multiple
    of `bucket` with position 0 / label -100 (ignored)."""
    flat = labels.reshape(-1)
    pos = np.flatnonzero(flat != IGNORE).astype(np.int32)
    S = max(bucket, -(-len(pos) // bucket) * bucket)
    p = np.zeros(S, np.int32)
    lab = np.full(S, IGNORE, np.int32)
    p[:len(pos)], lab[:len(pos)] = pos, flat[pos]
    return p, lab


def selected_logits(model, ids, pos, adapters_on):
    B, T = ids.shape
    h = model.forward(ids, adapters_on=adapters_on, hidden_only=True)       # (B, T, dim)
    return model.head(h.reshape(B * T, model.cfg.dim).gather(pos))         # (S, V)


def build_grad_fn(model, params, lam: float):
    """Traced (ids (B,T), pos (S,), labels (S,), inv_n (1,)) -> (ce_sum, kl_sum, *grads)."""
    @vkdsl.trace
    def grad_step(ids, pos, labels, inv_n):
        lg = selected_logits(model, ids, pos, True)
        _, per = losses.cross_entropy(lg, labels)
        ce_sum = per.sum()
        obj = ce_sum
        kl_sum = ce_sum * 0.0
        if lam > 0:
            mask = 1.0 - labels.eq(IGNORE)
            base = selected_logits(model, ids, pos, False)
            kl_sum = losses.tmkl(lg, base, labels) * mask.sum()
            obj = ce_sum + kl_sum * lam
        gs = grad((obj * inv_n[0]), params)
        return [ce_sum, kl_sum] + gs
    return grad_step


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
        return {"t": self.t, **{f"m{i}": m for i, m in enumerate(self.m)}, **{f"v{i}": v for i, v in enumerate(self.v)}}

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


class Stepper:
    """Accumulates micro-batch gradients and applies one AdamW update per optimizer step."""

    def __init__(self, model, params, cfg):
        self.model, self.params, self.cfg = model, params, cfg
        self.fn = build_grad_fn(model, params, cfg.tmkl)
        self.opt = HostAdamW([p.shape for p in params], cfg.betas, cfg.eps, cfg.weight_decay)

    def grads(self, micro, n_total):
        """micro: list of (ids, labels) numpy; n_total supervised tokens over all of them.
        -> (summed grads, ce_sum, kl_sum)."""
        acc, ce, kl = None, 0.0, 0.0
        inv = np.array([1.0 / n_total], np.float32)
        for ids, labels in micro:
            pos, lab = select(labels)
            out = self.fn(ids, pos, lab, inv)
            ce, kl = ce + float(out[0]), kl + float(out[1])
            gs = [np.asarray(g, np.float32) for g in out[2:]]
            acc = gs if acc is None else [a + g for a, g in zip(acc, gs)]
        return acc, ce, kl

    def step(self, micro, lr):
        n_total = int(sum((lab != IGNORE).sum() for _, lab in micro))
        if n_total == 0:
            raise ValueError("an optimizer step with no supervised token")
        gs, ce, kl = self.grads(micro, n_total)
        raw = gs
        gs, norm = clip(gs, self.cfg.clip)
        cur = [p.numpy() for p in self.params]
        new = self.opt.update(cur, gs, lr)
        for p, a in zip(self.params, new):
            p.assign(vkdsl.tensor(a))
        return {"loss": ce / n_total, "tmkl": kl / n_total, "grad_norm": norm, "tokens": n_total,
                "raw_grads": raw}
