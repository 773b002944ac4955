"""Read a Llama/Qwen2/Qwen3 GGUF file: config from {arch}.* keys, tensors as raw blocks (no
dequantizing).

Qwen files keep Q/K rows in half-split RoPE order (llama.cpp runs them with NEOX RoPE); their rows
move to the adjacent-pair order here, so one forward serves every family.

Only metadata and tensor bytes are read (memory-mapped); nothing in the file is executed.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from .config import LlamaConfig
from .errors import ModelFileError
from .safetensors_loader import to_pair_order
from .tensors import LlamaCheckpoint, TensorRecord, check_tensors

GGUF_ARCHS = ("llama", "qwen2", "qwen3")


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """GGUFReader over `path`, with the reader's low-level errors turned into ModelFileError."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such GGUF file")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError/IndexError/... on damaged files
        detail = _truncation_detail(path) or "expected the GGUF header, key/value metadata, " \
            "tensor table and tensor data"
        raise ModelFileError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({detail}; file is "
            f"{path.stat().st_size} bytes): {type(e).__name__}: {e}") from e
    if reader.byte_order != "I":
        raise ModelFileError(f"{path}: GGUF byte order differs from this machine's; unsupported")
    return reader


class _TableOnlyReader(GGUFReader):
    """Parses header and tensor table but maps no tensor data (for diagnosing a bad file)."""

    def _build_tensors(self, start_offs, fields):
        self.table = (start_offs, fields)


def _truncation_detail(path: Path) -> str | None:
    """'tensor X (Q4_1 [576, 576]) needs bytes [a, b)' for the first tensor past the end of
    the file, or None when the table itself cannot be read. Best effort: uses reader
    internals, so any surprise just means no detail."""
    try:
        reader = _TableOnlyReader(path, "r")
        start, fields = reader.table
        size = len(reader.data)
        for f in fields:
            _, name, _, dims, qtype, offset = f.parts
            qtype = GGMLQuantizationType(int(qtype[0]))
            per_block, block_size = GGML_QUANT_SIZES[qtype]
            begin = int(start + offset[0])
            end = begin + int(np.prod(dims)) // per_block * block_size
            if end > size:
                return (f"tensor {bytes(name).decode()!r} ({qtype.name} "
                        f"{list(reversed(dims.tolist()))}) needs bytes [{begin}, {end})")
    except Exception:
        return None
    return None


def read_key(reader: GGUFReader, key: str, default: Any = ..., *, path: Path | str = "") -> Any:
    """One metadata value as a Python object; a missing key without default is an error."""
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ModelFileError(f"{path}: missing GGUF metadata key {key!r}")
        return default
    try:
        return field.contents()
    except (UnicodeDecodeError, ValueError, IndexError) as e:     # a damaged string or array
        raise ModelFileError(f"{path}: GGUF metadata key {key!r} is damaged "
                             f"({type(e).__name__}: {e})") from None


def _f32(value: float) -> float:
    """The shortest decimal that rounds to the stored float32 (1e-5, not 9.9999997e-06),
    so a GGUF and a config.json of the same model give equal configs."""
    return float(str(np.float32(value)))


def config_from_gguf(reader: GGUFReader, path: Path | str) -> LlamaConfig:
    """LlamaConfig from the {arch}.* keys (vocab falls back to token_embd's rows)."""
    arch = read_key(reader, "general.architecture", None, path=path)
    if arch not in GGUF_ARCHS:
        raise ModelFileError(f"{path}: general.architecture is {arch!r}; supported: "
                             f"{', '.join(GGUF_ARCHS)}, qwen35")

    def key(name: str, default: Any = ...) -> Any:
        return read_key(reader, f"{arch}.{name}", default, path=path)

    dim, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    if n_heads <= 0 or (key("attention.key_length", None) is None and dim % n_heads):
        raise ModelFileError(f"{path}: {arch}.embedding_length {dim} is not divisible by "
                             f"{arch}.attention.head_count {n_heads} (and no attention.key_length "
                             f"is given)")
    head_dim = int(key("attention.key_length", dim // n_heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ModelFileError(f"{path}: {arch}.attention.value_length differs from key_length; "
                             f"unsupported")
    rope_dims = int(key("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelFileError(f"{path}: {arch}.rope.dimension_count = {rope_dims} but head_dim = "
                             f"{head_dim}; partial RoPE is unsupported")
    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ModelFileError(f"{path}: {arch}.rope.scaling.type = {scaling!r}; unsupported")
    window = key("attention.sliding_window", None)
    if window is not None and int(window) < int(key("context_length", 2048)):
        raise ModelFileError(f"{path}: {arch}.attention.sliding_window = {window} (below the "
                             f"context): sliding-window attention is not supported")

    names = {t.name: t for t in reader.tensors}
    freqs = names.get("rope_freqs.weight")
    divisors = None
    if freqs is not None:                 # Llama 3.x scaling, as llama.cpp stores it
        if freqs.tensor_type.name != "F32" or int(np.prod(freqs.shape)) != head_dim // 2:
            raise ModelFileError(f"{path}: rope_freqs.weight must be {head_dim // 2} F32 values "
                                 f"(one per RoPE frequency), found {freqs.tensor_type.name} of "
                                 f"shape {tuple(freqs.shape)}")
        divisors = tuple(float(x) for x in np.asarray(freqs.data, np.float32).ravel())
    vocab = key("vocab_size", None)
    if vocab is None:
        embd = names.get("token_embd.weight")
        if embd is None:
            raise ModelFileError(f"{path}: missing tensor 'token_embd.weight'")
        vocab = int(embd.shape[-1])   # GGUF dims are (in, out): the last is the row count

    def token_id(name: str) -> int | None:
        value = read_key(reader, f"tokenizer.ggml.{name}_token_id", None)
        return None if value is None else int(value)

    try:
        return LlamaConfig(
            n_layers=int(key("block_count")), dim=dim, n_heads=n_heads,
            n_kv_heads=int(key("attention.head_count_kv", n_heads)), head_dim=head_dim,
            ffn_dim=int(key("feed_forward_length")), vocab_size=int(vocab),
            rope_base=_f32(key("rope.freq_base", 10000.0)),
            norm_eps=_f32(key("attention.layer_norm_rms_epsilon")),
            context_length=int(key("context_length", 2048)),
            tied_embeddings="output.weight" not in names,
            bos_id=token_id("bos"), eos_id=token_id("eos"), pad_id=token_id("padding"),
            rope_freq_divisors=divisors, arch=arch)
    except ModelFileError as e:
        raise ModelFileError(f"{path}: {e}") from None


def load_gguf(path: str | os.PathLike, reader: GGUFReader | None = None) -> LlamaCheckpoint:
    """Config plus every tensor as a TensorRecord viewing the file's raw blocks (Qwen's Q/K rows
    copied into adjacent-pair order)."""
    path = Path(path)
    reader = reader if reader is not None else open_gguf(path)
    cfg = config_from_gguf(reader, path)
    tensors: dict[str, TensorRecord] = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))   # GGUF (in, out) -> (out, in)
        # F32/F16 come back as float arrays, quantized types as (rows, row_bytes) uint8:
        # view both as raw bytes so the device path sees one format.
        raw = np.asarray(t.data).view(np.uint8)
        if t.name == "rope_freqs.weight":      # read into the config (rope_freq_divisors)
            continue
        rec = TensorRecord(t.name, t.tensor_type.name, shape, raw)
        tensors[t.name] = rec if cfg.gguf_pairs else to_pair_order(rec, cfg)
    check_tensors(tensors, cfg, path)   # names, shapes, types and byte counts
    return LlamaCheckpoint(cfg, tensors, path, "gguf")
