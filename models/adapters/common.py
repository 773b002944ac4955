"""The convention both adapter formats translate from: per module `blk.{i}.{attn_q|...}`,
A (in, r) and B (r, out) with out in the GGUF Q/K row order, y = x W^T + s (x A) B."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import LINEARS


@dataclass
class AdapterWeights:
    """Host copy of an adapter in vkdsl's convention: {module: (A (in, r), B (r, out) GGUF
    rows, scale)}."""
    modules: dict[str, tuple[np.ndarray, np.ndarray, float]]
    format: str                       # "peft" or "gguf"
    source: Path
    r: int
    alpha: float
    rslora: bool
    manifest: dict | None = None
    manifest_path: Path | None = None
    config: dict = field(default_factory=dict)

    @property
    def target_modules(self) -> list[str]:
        return sorted({n.split(".")[-1] for n in self.modules})


def module_shape(cfg, module: str) -> tuple[int, int]:
    """(in, out) of a linear module (`attn_q` or `blk.3.attn_q`)."""
    m = module.split(".")[-1]
    return {"attn_q": (cfg.dim, cfg.q_dim), "attn_k": (cfg.dim, cfg.kv_dim),
            "attn_v": (cfg.dim, cfg.kv_dim), "attn_output": (cfg.q_dim, cfg.dim),
            "ffn_gate": (cfg.dim, cfg.ffn_dim), "ffn_up": (cfg.dim, cfg.ffn_dim),
            "ffn_down": (cfg.ffn_dim, cfg.dim)}[m]


def heads(cfg, module: str) -> int | None:
    m = module.split(".")[-1]
    return cfg.n_heads if m == "attn_q" else cfg.n_kv_heads if m == "attn_k" else None


def model_adapter_arrays(model) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """{module: (A (in, r), B (r, out), scale)} read back from the device."""
    if not model.lora:
        raise ValueError("the model has no LoRA adapters to save")
    out = {}
    for name in sorted(model.lora, key=module_order):
        lo = model.lora[name]
        A = np.asarray(lo.A.numpy(), np.float32)
        B = np.asarray(lo.B.numpy(), np.float32)
        out[name] = (A, B, float(lo.scale))
    return out


def module_order(name: str):
    parts = name.split(".")
    return (int(parts[1]), LINEARS.index(parts[2]) if parts[2] in LINEARS else 99, name)


def infer_hparams(arrays, r, alpha, rslora):
    ranks = {A.shape[1] for A, _, _ in arrays.values()}
    if len(ranks) != 1:
        raise ValueError(f"adapters have different ranks {sorted(ranks)}; one rank is required")
    rank = ranks.pop()
    if r is not None and int(r) != rank:
        raise ValueError(f"r={r} but the adapters have rank {rank}")
    scales = {s for _, _, s in arrays.values()}
    if alpha is None:
        if len(scales) != 1:
            raise ValueError("adapters have different scales; pass alpha explicitly")
        s = next(iter(scales))
        alpha = s * math.sqrt(rank) if rslora else s * rank
    return rank, float(alpha), bool(rslora)
