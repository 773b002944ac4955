"""Tensor records and the checkpoint contents both loaders must produce.

Names and layouts follow GGUF (llama.cpp): shapes are numpy (out, in), Q/K rows are in the
converter's permuted order (adjacent-pair RoPE). The safetensors loader converts to this.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

from .config import LlamaConfig
from .errors import ModelFileError

# The types the device kernels will read. Anything else is refused at load time.
SUPPORTED_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def block_bytes(ggml_type: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML type, e.g. Q4_1 -> (32, 20)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]


@dataclass(frozen=True)
class TensorRecord:
    """One weight as stored: raw blocks plus what is needed to read them.

    raw is uint8, (rows, bytes_per_row) for matrices and (nbytes,) for vectors; for a
    GGUF file it is a read-only view into the memory-mapped file (nothing is copied).
    """
    name: str
    ggml_type: str             # one of SUPPORTED_TYPES
    shape: tuple[int, ...]     # logical numpy shape: (out, in) or (n,)
    raw: np.ndarray = field(repr=False)

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def dequantize(self) -> np.ndarray:
        """float32 array of self.shape (for references and tests, not the device path)."""
        qtype = GGMLQuantizationType[self.ggml_type]
        out = _gguf_dequantize(np.ascontiguousarray(self.raw), qtype)   # decodes the last axis
        return np.asarray(out, dtype=np.float32).reshape(self.shape)


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of the config's family must hold, GGUF names -> numpy (out, in)
    shapes."""
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.vocab_size, cfg.dim),
        "output_norm.weight": (cfg.dim,),
    }
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        shapes[p + "attn_norm.weight"] = (cfg.dim,)
        shapes[p + "attn_q.weight"] = (cfg.q_dim, cfg.dim)
        shapes[p + "attn_k.weight"] = (cfg.kv_dim, cfg.dim)
        shapes[p + "attn_v.weight"] = (cfg.kv_dim, cfg.dim)
        shapes[p + "attn_output.weight"] = (cfg.dim, cfg.q_dim)
        if cfg.qkv_bias:
            shapes[p + "attn_q.bias"], shapes[p + "attn_k.bias"] = (cfg.q_dim,), (cfg.kv_dim,)
            shapes[p + "attn_v.bias"] = (cfg.kv_dim,)
        if cfg.qk_norm:
            shapes[p + "attn_q_norm.weight"] = shapes[p + "attn_k_norm.weight"] = (cfg.head_dim,)
        shapes[p + "ffn_norm.weight"] = (cfg.dim,)
        shapes[p + "ffn_gate.weight"] = (cfg.ffn_dim, cfg.dim)
        shapes[p + "ffn_up.weight"] = (cfg.ffn_dim, cfg.dim)
        shapes[p + "ffn_down.weight"] = (cfg.dim, cfg.ffn_dim)
    if not cfg.tied_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, cfg.dim)
    return shapes


def check_tensors(tensors: dict[str, TensorRecord], cfg: LlamaConfig, source: Path) -> None:
    """Raise ModelFileError unless `tensors` is exactly the set the config calls for."""
    want = expected_shapes(cfg)
    missing = [n for n in want if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFileError(f"{source}: missing tensor {missing[0]!r}{more}")
    extra = sorted(n for n in tensors if n not in want)
    if extra:
        # Unknown tensors (rope_freqs, biases, ...) change the math: refuse, never ignore.
        raise ModelFileError(f"{source}: unexpected tensor {extra[0]!r} (not part of a {cfg.arch} "
                             f"model with {cfg.n_layers} layers); unsupported variant")
    for name, shape in want.items():
        rec = tensors[name]
        if rec.shape != shape:
            raise ModelFileError(f"{source}: tensor {name!r} has shape {rec.shape}, the config "
                                 f"implies {shape}")
        if rec.ggml_type not in SUPPORTED_TYPES:
            raise ModelFileError(f"{source}: tensor {name!r} has type {rec.ggml_type}; supported: "
                                 f"{', '.join(SUPPORTED_TYPES)}")
        per_block, block_size = block_bytes(rec.ggml_type)
        if shape[-1] % per_block:
            raise ModelFileError(f"{source}: tensor {name!r} rows of {shape[-1]} do not fill whole "
                                 f"{rec.ggml_type} blocks of {per_block}")
        n_bytes = int(np.prod(shape)) // per_block * block_size
        if rec.raw.dtype != np.uint8 or rec.nbytes != n_bytes:
            raise ModelFileError(f"{source}: tensor {name!r} holds {rec.nbytes} bytes, expected "
                                 f"{n_bytes} for {rec.ggml_type} {shape} (truncated or corrupt)")
    for name, rec in tensors.items():
        # a NaN or Inf weight or block scale makes every logit NaN: refuse it at load, by name
        bad = nonfinite(rec)
        if bad:
            where = "" if rec.ggml_type in ("F32", "F16") else "in its block scales "
            raise ModelFileError(f"{source}: tensor {name!r} holds {bad} non-finite value(s) "
                                 f"{where}(a damaged file?)")


# Byte offsets of the fp16 fields in one block of each quantized type (d; m or dmin): the only
# fields that can hold a NaN or Inf, the rest being small integers. Checked against gguf's own
# dequantize in tests/test_hostile_input.py.
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,)}


def nonfinite(rec: TensorRecord) -> int:
    """How many of a tensor's stored floats are NaN or Inf: its values (F32, F16) or its blocks'
    scales (a few ms for SmolLM2-135M, where dequantizing every tensor takes ~2 s)."""
    flat = np.ascontiguousarray(rec.raw).reshape(-1)
    if rec.ggml_type in ("F32", "F16"):
        vals = flat.view("<f4" if rec.ggml_type == "F32" else "<f2")
    else:
        blocks = flat.reshape(-1, block_bytes(rec.ggml_type)[1])
        vals = np.concatenate([np.ascontiguousarray(blocks[:, o:o + 2]).view("<f2").reshape(-1)
                               for o in F16_FIELDS[rec.ggml_type]])
    return int(np.count_nonzero(~np.isfinite(vals)))


@dataclass(frozen=True)
class LlamaCheckpoint:
    """A loaded model: config plus GGUF-named, GGUF-layout tensor records."""
    config: LlamaConfig
    tensors: dict[str, TensorRecord]
    source: Path
    format: str                # "gguf" or "safetensors"

    def __getitem__(self, name: str) -> TensorRecord:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.source}: no tensor {name!r}") from None

    def dequantized(self) -> dict[str, np.ndarray]:
        """All weights as float32 arrays keyed by GGUF name: the input llama_ref.forward takes."""
        return {name: rec.dequantize() for name, rec in self.tensors.items()}
