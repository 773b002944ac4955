"""AdamW (decoupled weight decay) and global gradient-norm clipping over all trainable tensors.

Inside a trace the updates are assigns: they land at the end of each replayed step. Step
dependent scalars (learning rate, bias corrections) come in as a small input tensor so one
recorded program serves every step."""
from __future__ import annotations

import numpy as np

import vkdsl
from vkdsl import Tensor


def global_norm(grads) -> Tensor:
    total = None
    for g in grads:
        s = (g * g).sum()
        total = s if total is None else total + s
    return total.sqrt()


def clip_by_global_norm(grads, max_norm: float):
    """Returns (clipped grads, the norm before clipping)."""
    norm = global_norm(grads)
    scale = (max_norm / (norm + 1e-6)).minimum(1.0)
    return [g * scale for g in grads], norm


def adamw_update(p, g, m, v, lr, c1, c2, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
    """One AdamW step as lazy tensors: (new p, new m, new v). c1, c2 = 1/(1-b^t) bias corrections.
    Decoupled decay: p shrinks by lr*wd*p, not through Adam's normalisation."""
    m_new = m * b1 + g * (1.0 - b1)
    v_new = v * b2 + g * g * (1.0 - b2)
    upd = (m_new * c1) / ((v_new * c2).sqrt() + eps)
    return p - lr * (upd + p * wd), m_new, v_new


class AdamW:
    def __init__(self, params, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        self.params, self.betas, self.eps, self.wd = list(params), betas, eps, weight_decay
        self.m = [vkdsl.tensor(np.zeros(p.shape, np.float32), name="adam_m") for p in self.params]
        self.v = [vkdsl.tensor(np.zeros(p.shape, np.float32), name="adam_v") for p in self.params]
        self.t = 0

    def scalars(self, lr: float) -> np.ndarray:
        """[lr, 1/(1-b1^t), 1/(1-b2^t)] for the next step (host side, float64 -> float32)."""
        self.t += 1
        b1, b2 = self.betas
        return np.array([lr, 1.0 / (1.0 - b1 ** self.t), 1.0 / (1.0 - b2 ** self.t)], np.float32)

    def step(self, grads, scalars: Tensor):
        """Record the update of every parameter. scalars: the (3,) tensor from scalars()."""
        b1, b2 = self.betas
        lr, c1, c2 = scalars[0], scalars[1], scalars[2]
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            p_new, m_new, v_new = adamw_update(p, g, m, v, lr, c1, c2, b1, b2, self.eps, self.wd)
            p.assign(p_new)
            m.assign(m_new)
            v.assign(v_new)

    def state(self):
        return {"t": self.t, "m": [m.numpy() for m in self.m], "v": [v.numpy() for v in self.v]}

    def load_state(self, st):
        self.t = int(st["t"])
        for m, a in zip(self.m, st["m"]):
            m.assign(vkdsl.tensor(a))
        for v, a in zip(self.v, st["v"]):
            v.assign(vkdsl.tensor(a))
