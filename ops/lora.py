"""LoRA linear: y = x W + s (x A) B, W frozen, A (d_in, r) small random, B (r, d_out) zero."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import vkdsl
from vkdsl import Tensor


def lora_scale(alpha: float, r: int, rslora: bool = False) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


@dataclass
class LoRA:
    A: Tensor            # (d_in, r)
    B: Tensor            # (r, d_out)
    scale: float

    @staticmethod
    def init(d_in: int, d_out: int, r: int, alpha: float, rslora: bool = False, seed: int = 0,
             name: str = "") -> "LoRA":
        if not 0 < r <= min(d_in, d_out):
            raise ValueError(f"LoRA {name}: rank {r} must be in 1..min(d_in={d_in}, d_out={d_out})")
        rng = np.random.default_rng(seed)
        # Kaiming-uniform bound as PEFT uses for A; B = 0 so the adapter starts as the identity.
        bound = 1.0 / math.sqrt(d_in)
        A = rng.uniform(-bound, bound, (d_in, r)).astype(np.float32)
        return LoRA(vkdsl.tensor(A, requires_grad=True, name=f"{name}.lora_A"),
                    vkdsl.tensor(np.zeros((r, d_out), np.float32), requires_grad=True,
                                 name=f"{name}.lora_B"),
                    lora_scale(alpha, r, rslora))

    def delta(self, x: Tensor) -> Tensor:
        return ((x @ self.A) @ self.B) * self.scale

    def params(self):
        return [self.A, self.B]


def lora_linear(x: Tensor, W: Tensor, lora: LoRA | None, enabled: bool = True) -> Tensor:
    """x: (..., d_in); W: (d_in, d_out) frozen. With the adapter disabled this is the base layer."""
    y = x @ W
    return y + lora.delta(x) if (lora is not None and enabled) else y
