"""The convention both adapter formats translate from: per module `blk.{i}.{attn_q|attn_qkv|...}`,
A (in, r) and B (r, out) with out in the GGUF Q/K row order, y = x W^T + s (x A) B."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import MODULES


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
    # PEFT: the weight file's; GGUF: its tensors' (tensors_sha256)
    weights_sha256: str | None = None

    @property
    def target_modules(self) -> list[str]:
        return sorted({n.split(".")[-1] for n in self.modules})


def module_shape(cfg, module: str) -> tuple[int, int]:
    """(in, out) of a linear module (`attn_q` or `blk.3.attn_q`)."""
    m = module.split(".")[-1]
    if hasattr(cfg, "module_shape"):          # Qwen3.5: its own table
        return cfg.module_shape(m)
    return {"attn_q": (cfg.dim, cfg.q_dim), "attn_k": (cfg.dim, cfg.kv_dim),
            "attn_v": (cfg.dim, cfg.kv_dim), "attn_output": (cfg.q_dim, cfg.dim),
            "ffn_gate": (cfg.dim, cfg.ffn_dim), "ffn_up": (cfg.dim, cfg.ffn_dim),
            "ffn_down": (cfg.ffn_dim, cfg.dim)}[m]


def heads(cfg, module: str) -> int | None:
    """Heads of a module whose rows vkdsl keeps in the adjacent-pair RoPE order (Llama family q, k);
    None where rows are as the files have them (Qwen3.5 rotates halves, as its files are)."""
    m = module.split(".")[-1]
    if cfg.arch == "qwen35":
        return None
    return cfg.n_heads if m == "attn_q" else cfg.n_kv_heads if m == "attn_k" else None


def file_rows(cfg, module: str, rows: np.ndarray, fmt: str, to_file: bool) -> np.ndarray:
    """A module's output rows (axis 0) between vkdsl's adjacent-pair Q/K order and a file's: HF
    and PEFT files use the half-split order, GGUF files their family's (llama.cpp permutes Llama's
    rows, not Qwen's). Other modules' rows pass through."""
    from ..safetensors_loader import gguf_to_hf_rows, hf_to_gguf_rows
    if cfg.arch == "qwen35":
        return (_value_heads(cfg, module, rows, 0, fmt, to_file)
                if module.split(".")[-1] != "ssm_out" else rows)
    h = heads(cfg, module)
    if h is None or (fmt == "gguf" and cfg.gguf_pairs):
        return rows
    return gguf_to_hf_rows(rows, h, axis=0) if to_file else hf_to_gguf_rows(rows, h, axis=0)


def file_cols(cfg, module: str, cols: np.ndarray, fmt: str, to_file: bool) -> np.ndarray:
    """A module's input features (axis 0 of A (in, r), axis 1 of a weight) between vkdsl's order and
    a file's: only Qwen3.5's out_proj reads value heads, whose order HF and GGUF files differ in."""
    if cfg.arch == "qwen35" and module.split(".")[-1] == "ssm_out":
        return _value_heads(cfg, module, cols, 0, fmt, to_file)
    return cols


def _value_heads(cfg, module, a, axis, fmt, to_file):
    """Qwen3.5's value heads: grouped by key head in HF/PEFT files, tiled in GGUF files (llama.cpp's
    converter); the model keeps its base file's order (cfg.v_tiled)."""
    from ..qwen35_files import reorder_v
    file_tiled = fmt == "gguf"
    if file_tiled == cfg.v_tiled:
        return a
    return reorder_v(cfg, module, a, axis, to_tiled=file_tiled if to_file else cfg.v_tiled)


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
    return (int(parts[1]), MODULES.index(parts[2]) if parts[2] in MODULES else 99, name)


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


def tensors_sha256(named_arrays) -> str:
    """sha256 over (name, bytes) of each tensor in order: a GGUF adapter's weights, which cannot
    hold their own file's checksum."""
    h = hashlib.sha256()
    for name, a in named_arrays:
        h.update(name.encode() + b"\0" + np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def adapter_mismatches(aw: AdapterWeights) -> list[str]:
    """How an adapter on disk differs from what its manifest recorded: hyper-parameters, modules,
    scale, weight checksum. Empty when it matches (or there is no manifest)."""
    m = aw.manifest
    if m is None:
        return []
    out, rec = [], m.get("adapter") or {}
    for key, got in (("r", aw.r), ("alpha", aw.alpha), ("rslora", aw.rslora)):
        if (key in rec and rec[key] != got
            and not (key == "alpha" and math.isclose(float(rec[key]), got))):
            out.append(f"adapter {key} is {got!r}, the manifest records {rec[key]!r}")
    if "target_modules" in rec and sorted(rec["target_modules"]) != aw.target_modules:
        out.append(f"adapted modules are {aw.target_modules}, the manifest records "
                   f"{sorted(rec['target_modules'])}")
    scales = {s for _, _, s in aw.modules.values()}
    if "scaling" in rec and any(not math.isclose(s, rec["scaling"], rel_tol=1e-6) for s in scales):
        out.append(f"scale is {sorted(scales)}, the manifest records {rec['scaling']}")
    want = m.get("weights_sha256")
    if want and aw.weights_sha256 != want:
        out.append(f"the weights' sha256 is {str(aw.weights_sha256)[:16]}…, the manifest records "
                   f"{want[:16]}… (changed after saving)")
    return out

