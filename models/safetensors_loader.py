"""Read a Hugging Face Llama/Mistral/Qwen2/Qwen3 folder (config.json + *.safetensors) into the GGUF
layout.

The safetensors format is parsed here directly (8-byte header length, JSON header, raw
little-endian data) because numpy has no bfloat16; BF16 is widened to F32 exactly.
Q and K rows are permuted into llama.cpp's order so one forward serves both formats.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy

from .config import LlamaConfig, llama3_divisors
from .errors import ModelFileError
from .tensors import LlamaCheckpoint, TensorRecord, check_tensors

_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}

# HF name -> GGUF name; {i} is the layer index.
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",          # Qwen2
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # Qwen3
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
              "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def hf_name_to_gguf(name: str) -> str | None:
    """GGUF name of a HF Llama tensor, None if it is not a Llama weight."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def gguf_name_to_hf(name: str) -> str:
    """Inverse of hf_name_to_gguf (adapter export uses HF names)."""
    for hf, gg in _TOP_NAMES.items():
        if gg == name:
            return hf
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m:
        for hf, gg in _LAYER_NAMES.items():
            if gg == m.group(2):
                return f"model.layers.{m.group(1)}.{hf}"
    raise KeyError(f"not a Llama GGUF tensor name: {name!r}")


def _pair_permute(w: np.ndarray, n_heads: int, axis: int, to_gguf: bool) -> np.ndarray:
    w = np.moveaxis(np.asarray(w), axis, 0)
    rows = w.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    # HF head rows are [first halves i | second halves i] = (2, half); GGUF interleaves
    # them as (half, 2): GGUF row h*hd + 2i + j holds HF row h*hd + half*j + i.
    src = (n_heads, 2, half) if to_gguf else (n_heads, half, 2)
    out = w.reshape(src + w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return np.moveaxis(out, 0, axis)


def hf_to_gguf_rows(w: np.ndarray, n_heads: int, axis: int = 0) -> np.ndarray:
    """Permute Q or K rows (n_heads * head_dim along `axis`) from HF to GGUF order."""
    return _pair_permute(w, n_heads, axis, to_gguf=True)


def gguf_to_hf_rows(w: np.ndarray, n_heads: int, axis: int = 0) -> np.ndarray:
    """Inverse of hf_to_gguf_rows: GGUF (adjacent-pair RoPE) order back to HF (half-split)."""
    return _pair_permute(w, n_heads, axis, to_gguf=False)


def qk_heads(name: str, cfg: LlamaConfig) -> int | None:
    """How many RoPE heads the rows of a Q/K tensor (weight, bias or per-head norm, GGUF name)
    hold, None for any other tensor: the permutation between RoPE orders applies per head."""
    for suffix, heads in (("attn_q.weight", cfg.n_heads), ("attn_q.bias", cfg.n_heads),
                          ("attn_k.weight", cfg.n_kv_heads), ("attn_k.bias", cfg.n_kv_heads),
                          ("attn_q_norm.weight", 1), ("attn_k_norm.weight", 1)):
        if name.endswith(suffix):
            return heads
    return None


def to_pair_order(rec: TensorRecord, cfg: LlamaConfig) -> TensorRecord:
    """`rec` with its rows moved from half-split (HF) to adjacent-pair RoPE order, if it is a Q/K
    tensor of the size the config implies (else unchanged: check_tensors reports a wrong shape).
    Rows move whole, so packed blocks (one row of bytes each) move unchanged."""
    heads = qk_heads(rec.name, cfg)
    if heads is None or rec.shape[0] != heads * cfg.head_dim:
        return rec
    rows = rec.raw.reshape(rec.shape[0], -1)
    return TensorRecord(rec.name, rec.ggml_type, rec.shape,
                        np.ascontiguousarray(hf_to_gguf_rows(rows, heads)).reshape(rec.raw.shape))


_LIB_DTYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16", "float32": "F32", "float16": "F16",
               "bfloat16": "BF16"}


def read_safetensors(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """{name: (dtype, shape, uint8 bytes)} for one .safetensors file. The safetensors library checks
    the header and every tensor's byte range; its errors come back naming the file."""
    path = Path(path)
    try:
        entries = safetensors.deserialize(path.read_bytes())
    except safetensors.SafetensorError as e:
        raise ModelFileError(f"{path}: truncated or corrupt safetensors file ({e})") from None
    out = {}
    for name, info in entries:
        dtype = _LIB_DTYPES.get(str(info["dtype"]))
        if dtype is None:
            raise ModelFileError(f"{path}: tensor {name!r} has dtype {info['dtype']}; supported: "
                                 f"{', '.join(_DTYPES)}")
        out[name] = (dtype, tuple(int(d) for d in info["shape"]),
                     np.frombuffer(info["data"], np.uint8))
    return out


def safetensors_bytes(tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file's bytes (float32 unless a tensor is float16), written by the library."""
    arrays = {k: np.ascontiguousarray(v if v.dtype in (np.float32, np.float16)
                                      else v.astype(np.float32))
              for k, v in tensors.items()}
    return safetensors.numpy.save(arrays, metadata={str(k): str(v)
                                                    for k, v in (metadata or {}).items()} or None)


def as_f32(dtype: str, raw: np.ndarray, shape) -> np.ndarray:
    """One tensor's bytes (F32, F16 or BF16) as float32 of its shape."""
    if dtype == "F32":
        return raw.view("<f4").reshape(shape).astype(np.float32)
    if dtype == "F16":
        return raw.view("<f2").reshape(shape).astype(np.float32)
    if dtype == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    raise ModelFileError(f"unsupported dtype {dtype}")


def _to_record(name: str, dtype: str, shape: tuple[int, ...], raw: np.ndarray) -> TensorRecord:
    if dtype == "BF16":
        # bfloat16 is the top half of a float32: shift it back up, exact.
        f32 = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        raw, dtype = f32.view(np.uint8), "F32"
    rows = raw.reshape(shape[0], -1) if len(shape) == 2 else raw
    return TensorRecord(name, dtype, shape, rows)


_HF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def config_from_hf(cfg: dict, path: Path) -> LlamaConfig:
    """LlamaConfig from a HF config.json dict: model_type llama, mistral, qwen2 or qwen3. What
    the computation here does not implement (a sliding window inside the context, biases other
    than Qwen2's q/k/v ones, another activation) is refused by field name."""
    kind = cfg.get("model_type")
    if kind not in _HF_ARCHS:
        raise ModelFileError(f"{path}: model_type is {kind!r}; supported: "
                             f"{', '.join(map(repr, [*_HF_ARCHS, 'qwen3_5_text', 'qwen3_5']))}")
    _check_types(cfg, path)
    context = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    # Qwen configs name a window but switch it on with use_sliding_window; Mistral's is on when set
    windowed = cfg.get("use_sliding_window", kind == "mistral")
    if windowed and window is not None and int(window) < context:
        raise ModelFileError(f"{path}: sliding_window = {window} (below max_position_embeddings "
                             f"{context}): sliding-window attention is not supported")
    rope_base, divisors = _rope(cfg, path)
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ModelFileError(f"{path}: {key} = true; unsupported (only Qwen2's built-in q/k/v "
                                 f"biases are)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelFileError(f"{path}: hidden_act = {cfg['hidden_act']!r}, expected 'silu'")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                "vocab_size", "rms_norm_eps"):
        if key not in cfg:
            raise ModelFileError(f"{path}: missing config key {key!r}")

    def first_id(key: str) -> int | None:
        value = cfg.get(key)
        return int(value[0]) if isinstance(value, list) and value else \
            (None if value is None or isinstance(value, list) else int(value))

    dim, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if not cfg.get("head_dim") and dim % n_heads:
        raise ModelFileError(f"{path}: hidden_size {dim} is not divisible by num_attention_heads "
                             f"{n_heads} (and no head_dim is given)")
    try:
        return LlamaConfig(
            n_layers=int(cfg["num_hidden_layers"]), dim=dim, n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or dim // n_heads),
            ffn_dim=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            rope_base=rope_base, norm_eps=float(cfg["rms_norm_eps"]),
            context_length=context,
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_id=first_id("bos_token_id"), eos_id=first_id("eos_token_id"),
            pad_id=first_id("pad_token_id"), rope_freq_divisors=divisors, arch=_HF_ARCHS[kind])
    except ModelFileError as e:
        raise ModelFileError(f"{path}: {e}") from None


# config.json keys read as numbers, and their JSON kind: a wrong-typed value is named by key
_INT_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
             "sliding_window")
_FLOAT_KEYS = ("rms_norm_eps", "rope_theta")


def _check_types(cfg: dict, path: Path):
    for key in _INT_KEYS + _FLOAT_KEYS:
        v = cfg.get(key)
        if v is None:
            continue
        ok = (isinstance(v, int) if key in _INT_KEYS else isinstance(v, (int, float))
              and math.isfinite(v))
        if isinstance(v, bool) or not ok or (key in _INT_KEYS and v <= 0):
            want = "a positive integer" if key in _INT_KEYS else "a finite number"
            raise ModelFileError(f"{path}: {key} = {json.dumps(v)}, expected {want}")


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(cfg: dict, path: Path) -> tuple[float, tuple | None]:
    """(RoPE base, frequency divisors or None) from either form transformers writes: 4.x
    `rope_theta` and `rope_scaling` at the top level, 5.x `rope_parameters` {rope_theta, rope_type,
    ...}. RoPE types: default, and llama3 (its four keys all required). Anything else changes the
    computation and is refused by name, never replaced by a default."""
    params, top, scaling = (cfg.get("rope_parameters"), cfg.get("rope_theta"),
                            cfg.get("rope_scaling"))
    if params is None:
        theta = float(top if top is not None else 10000.0)
        if not scaling:
            return theta, None
        params, where = dict(scaling, rope_theta=theta), "rope_scaling"
    else:
        if scaling:
            raise ModelFileError(f"{path}: both rope_parameters and rope_scaling are set; "
                                 f"expected one")
        where = "rope_parameters"
    if not isinstance(params, dict):
        raise ModelFileError(f"{path}: {where} = {params!r}, expected an object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ModelFileError(f"{path}: {where}.rope_type = {kind!r}; supported: "
                             f"'default', 'llama3'")
    allowed = ({"rope_theta", "rope_type", "type"}
               | (set(LLAMA3_KEYS) if kind == "llama3" else set()))
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ModelFileError(f"{path}: {where} has {unknown}, which vkdsl does not implement for "
                             f"rope_type {kind!r}")
    theta = params.get("rope_theta", top)
    if theta is None:
        raise ModelFileError(f"{path}: {where} has no rope_theta")
    if top is not None and float(top) != float(theta):
        raise ModelFileError(f"{path}: rope_theta {top} and {where}.rope_theta {theta} disagree")
    if kind == "default":
        return float(theta), None
    missing = [k for k in LLAMA3_KEYS if params.get(k) is None]
    if missing:
        raise ModelFileError(f"{path}: {where} of rope_type 'llama3' lacks {missing}")
    head_dim = int(cfg.get("head_dim")
                   or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    return float(theta), llama3_divisors(head_dim, float(theta), float(params["factor"]),
                                         float(params["low_freq_factor"]),
                                         float(params["high_freq_factor"]),
                                         int(params["original_max_position_embeddings"]))


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelFileError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def load_hf(folder: str | os.PathLike) -> LlamaCheckpoint:
    """Config plus GGUF-named, GGUF-layout TensorRecords (F32/F16; BF16 becomes F32)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelFileError(f"{folder}: no config.json")
    cfg = config_from_hf(json.loads(config_path.read_text()), config_path)
    tensors: dict[str, TensorRecord] = {}
    for file in weight_files(folder):
        for hf_name, (dtype, shape, raw) in read_safetensors(file).items():
            name = hf_name_to_gguf(hf_name)
            if name is None:
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue   # a cached buffer in old checkpoints, recomputed from rope_theta
                raise ModelFileError(f"{file}: unexpected tensor {hf_name!r}; unsupported variant")
            if name == "output.weight" and cfg.tied_embeddings:
                continue       # some tied checkpoints still save a copy of the embedding
            tensors[name] = to_pair_order(_to_record(name, dtype, shape, raw), cfg)
    check_tensors(tensors, cfg, folder)
    return LlamaCheckpoint(cfg, tensors, folder, "safetensors")
