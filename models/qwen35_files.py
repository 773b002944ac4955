"""Qwen3.5 (the hybrid of Gated DeltaNet and gated full attention) from a Hugging Face folder:
its config (`model_type` qwen3_5_text, or the multimodal qwen3_5 wrapper's `text_config`) and its
weights under the GGUF names llama.cpp's converter gives architecture `qwen35`.

As that converter does, the zero-centred RMSNorm weights (transformers multiplies by 1 + w) are
stored as the gains 1 + w, A_log as A = -exp(A_log), and the depthwise convolution as (channels,
kernel). Multi-token-prediction tensors (`mtp.*`) and the vision tower of the wrapper are read
past and not used: generation and training here predict one token at a time from text."""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .errors import ModelFileError
from .safetensors_loader import as_f32, read_safetensors, weight_files
from .tensors import SUPPORTED_TYPES, LlamaCheckpoint, TensorRecord

# per-layer tensors of each layer type (GGUF names) and the HF modules they come from
FULL = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj"}
LINEAR = {"attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
          "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
          "ssm_out": "linear_attn.out_proj"}
MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
VECTORS = {"attn_norm.weight": "input_layernorm.weight",
           "post_attention_norm.weight": "post_attention_layernorm.weight",
           "attn_q_norm.weight": "self_attn.q_norm.weight",
           "attn_k_norm.weight": "self_attn.k_norm.weight",
           "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_dt.bias": "linear_attn.dt_bias",
           "ssm_a": "linear_attn.A_log", "ssm_norm.weight": "linear_attn.norm.weight"}
ZERO_CENTRED = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
                "attn_k_norm.weight")
LAYER_TYPES = ("linear_attention", "full_attention")
INT_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
            "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "full_attention_interval")


@dataclass(frozen=True)
class Qwen35Config:
    n_layers: int
    dim: int
    n_heads: int                # full attention: query heads
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    layer_types: tuple          # "linear_attention" | "full_attention", one per layer
    lin_k_heads: int            # Gated DeltaNet: key (and query) heads
    lin_v_heads: int            # value heads (each key head serves lin_v_heads // lin_k_heads)
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int = 4
    rope_base: float = 10_000_000.0
    rotary_dim: int = 64        # the leading features of each head that RoPE rotates
    norm_eps: float = 1e-6
    context_length: int = 32768
    tied_embeddings: bool = False
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    # the order of the value heads in the per-head DeltaNet tensors: Hugging Face groups them by
    # key head (key head g serves value heads g*r .. g*r + r-1), llama.cpp's converter tiles them
    # (value head j*Hk + g belongs to key head g); the computation follows the file's order
    v_tiled: bool = False
    arch: str = "qwen35"

    def __post_init__(self):
        for key in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size",
                    "lin_k_heads", "lin_v_heads", "lin_k_dim", "lin_v_dim", "conv_kernel",
                    "rotary_dim", "context_length"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ModelFileError(f"Qwen35Config.{key} must be a positive int, got {v!r}")
        if len(self.layer_types) != self.n_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ModelFileError(f"Qwen35Config.layer_types: expected {self.n_layers} of "
                                 f"{LAYER_TYPES}, got {list(self.layer_types)}")
        if self.n_heads % self.n_kv_heads or self.lin_v_heads % self.lin_k_heads:
            raise ModelFileError(f"Qwen35Config: query heads {self.n_heads} / kv heads "
                                 f"{self.n_kv_heads} and value heads {self.lin_v_heads} / key "
                                 f"heads {self.lin_k_heads} must divide")
        if not 2 <= self.conv_kernel <= 16:
            raise ModelFileError(f"Qwen35Config.conv_kernel = {self.conv_kernel} "
                                 f"(linear_conv_kernel_dim): the convolution and its generation "
                                 f"cache take kernels of 2 to 16 taps")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ModelFileError(f"Qwen35Config.rotary_dim {self.rotary_dim}: expected even, at "
                                 f"most head_dim {self.head_dim}")
        if not 0.0 < self.norm_eps < 1.0 or not self.rope_base > 1.0:
            raise ModelFileError(f"Qwen35Config: norm_eps {self.norm_eps} / rope_base "
                                 f"{self.rope_base} out of range")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def gguf_arch(self) -> str:
        return "qwen35"

    @property
    def rope_freq_divisors(self):
        return None                 # plain RoPE (on rotary_dim features)

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in, out) of a linear module (`attn_qkv` or `blk.0.attn_qkv`)."""
        m = module.split(".")[-1]
        hd, kv, vd, Hv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, \
            self.lin_v_heads * self.lin_v_dim, self.lin_v_heads
        return {"attn_q": (self.dim, 2 * hd), "attn_k": (self.dim, kv), "attn_v": (self.dim, kv),
                "attn_output": (hd, self.dim), "attn_qkv": (self.dim, self.conv_dim),
                "attn_gate": (self.dim, vd), "ssm_beta": (self.dim, Hv),
                "ssm_alpha": (self.dim, Hv), "ssm_out": (vd, self.dim),
                "ffn_gate": (self.dim, self.ffn_dim), "ffn_up": (self.dim, self.ffn_dim),
                "ffn_down": (self.ffn_dim, self.dim)}[m]

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    def linears(self, i: int) -> tuple:
        """The linear modules of layer i (GGUF names), in the order the layer computes them."""
        mixer = FULL if self.layer_types[i] == "full_attention" else LINEAR
        return tuple(mixer) + tuple(MLP)


def config_from_hf(cfg: dict, path: Path) -> Qwen35Config:
    kind = cfg.get("model_type")
    if kind == "qwen3_5":
        if not isinstance(cfg.get("text_config"), dict):
            raise ModelFileError(f"{path}: model_type 'qwen3_5' without a text_config object")
        cfg = cfg["text_config"]
    elif kind != "qwen3_5_text":
        raise ModelFileError(f"{path}: model_type is {kind!r}; expected 'qwen3_5_text' or "
                             f"'qwen3_5'")
    for key in ("attention_bias",):
        if cfg.get(key):
            raise ModelFileError(f"{path}: {key} = true; unsupported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelFileError(f"{path}: hidden_act = {cfg['hidden_act']!r}, expected 'silu'")
    need = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
            "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ModelFileError(f"{path}: missing config key {missing[0]!r}")
    for key in INT_KEYS:
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ModelFileError(f"{path}: {key} = {json.dumps(v)}, expected a positive integer")
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        raise ModelFileError(f"{path}: rope_parameters = {json.dumps(rope)}; supported: rope_type "
                             f"'default'")
    if rope.get("mrope_interleaved") and rope.get("mrope_section"):
        pass  # text positions are the same on the three axes: the multimodal split changes nothing
    head_dim = int(cfg.get("head_dim", 256))
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    rotary = int(head_dim * factor)
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10_000_000.0))
    if not (isinstance(theta, (int, float)) and math.isfinite(theta)):
        raise ModelFileError(f"{path}: rope_theta = {json.dumps(theta)}, expected a finite number")

    def first_id(key):
        v = cfg.get(key)
        return (int(v[0]) if isinstance(v, list) and v
                else (None if v is None or isinstance(v, list) else int(v)))
    try:
        return Qwen35Config(
            n_layers=n, dim=int(cfg["hidden_size"]), n_heads=int(cfg["num_attention_heads"]),
            n_kv_heads=int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])),
                            head_dim=head_dim,
            ffn_dim=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
                            layer_types=tuple(types),
            lin_k_heads=int(cfg.get("linear_num_key_heads", 16)),
                            lin_v_heads=int(cfg.get("linear_num_value_heads", 32)),
            lin_k_dim=int(cfg.get("linear_key_head_dim", 128)),
                            lin_v_dim=int(cfg.get("linear_value_head_dim", 128)),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)), rope_base=float(theta),
                            rotary_dim=rotary,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                            context_length=int(cfg.get("max_position_embeddings", 32768)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                            bos_id=first_id("bos_token_id"),
            eos_id=first_id("eos_token_id"), pad_id=first_id("pad_token_id"))
    except ModelFileError as e:
        raise ModelFileError(f"{path}: {e}") from None


def reorder_v(c: Qwen35Config, module: str, a: np.ndarray, axis: int, to_tiled: bool) -> np.ndarray:
    """A DeltaNet tensor's value-head axis between the grouped and the tiled order (axis: the output
    rows of attn_qkv's value part, attn_gate, ssm_beta, ssm_alpha and the vectors; ssm_out's
    input)."""
    Hk, Hv = c.lin_k_heads, c.lin_v_heads
    m = module.split(".")[-1]
    if Hk == Hv or m not in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out", "ssm_a",
                             "ssm_dt", "ssm_conv1d"):
        return a
    a = np.moveaxis(np.asarray(a), axis, 0)
    skip = 2 * Hk * c.lin_k_dim if m in ("attn_qkv", "ssm_conv1d") else 0  # q and k keep their rows
    v = a[skip:]
    d = v.shape[0] // Hv
    src = (Hk, Hv // Hk, d) if to_tiled else (Hv // Hk, Hk, d)
    v = v.reshape(src + v.shape[1:]).swapaxes(0, 1).reshape(v.shape)
    return np.moveaxis(np.concatenate([a[:skip], v]), 0, axis)


def expected_shapes(c: Qwen35Config) -> dict[str, tuple]:
    shapes = {"token_embd.weight": (c.vocab_size, c.dim), "output_norm.weight": (c.dim,)}
    if not c.tied_embeddings:
        shapes["output.weight"] = (c.vocab_size, c.dim)
    kd, vd, Hv = c.lin_k_heads * c.lin_k_dim, c.lin_v_heads * c.lin_v_dim, c.lin_v_heads
    for i, kind in enumerate(c.layer_types):
        p = f"blk.{i}."
        layer = {"attn_norm.weight": (c.dim,), "post_attention_norm.weight": (c.dim,),
                 "ffn_gate.weight": (c.ffn_dim, c.dim), "ffn_up.weight": (c.ffn_dim, c.dim),
                 "ffn_down.weight": (c.dim, c.ffn_dim)}
        if kind == "full_attention":
            D = c.head_dim
            layer.update({"attn_q.weight": (2 * c.n_heads * D, c.dim),
                          "attn_k.weight": (c.n_kv_heads * D, c.dim),
                          "attn_v.weight": (c.n_kv_heads * D, c.dim),
                          "attn_output.weight": (c.dim, c.n_heads * D), "attn_q_norm.weight": (D,),
                          "attn_k_norm.weight": (D,)})
        else:
            layer.update({"attn_qkv.weight": (c.conv_dim, c.dim), "attn_gate.weight": (vd, c.dim),
                          "ssm_beta.weight": (Hv, c.dim), "ssm_alpha.weight": (Hv, c.dim),
                          "ssm_out.weight": (c.dim, vd),
                          "ssm_conv1d.weight": (c.conv_dim, c.conv_kernel), "ssm_dt.bias": (Hv,),
                          "ssm_a": (Hv,), "ssm_norm.weight": (c.lin_v_dim,)})
        shapes.update({p + k: v for k, v in layer.items()})
    return shapes


_PREFIXES = ("model.language_model.", "model.")
_IGNORED = re.compile(r"(mtp\.|model\.visual\.|visual\.).*")


def hf_name_to_gguf(name: str, c: Qwen35Config) -> str | None:
    """The GGUF name of a Qwen3.5 HF tensor; '' for tensors read past (MTP, vision); None if
    unknown."""
    if _IGNORED.fullmatch(name):
        return ""
    if name == "lm_head.weight":
        return "output.weight"
    for pre in _PREFIXES:
        if not name.startswith(pre):
            continue
        rest = name[len(pre):]
        if rest == "embed_tokens.weight":
            return "token_embd.weight"
        if rest == "norm.weight":
            return "output_norm.weight"
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
        if m:
            for gg, hf in {**{k + ".weight": v + ".weight"
                              for k, v in {**FULL, **LINEAR, **MLP}.items()},
                           **VECTORS}.items():
                if m.group(2) == hf:
                    return f"blk.{m.group(1)}.{gg}"
    return None


def convert(gguf_name: str, w: np.ndarray) -> np.ndarray:
    """HF values into the GGUF convention: 1 + w for the zero-centred norms, A = -exp(A_log),
    the depthwise convolution (channels, 1, kernel) as (channels, kernel)."""
    if gguf_name.endswith(ZERO_CENTRED) or gguf_name == "output_norm.weight":
        return (np.asarray(w, np.float64) + 1.0).astype(np.float32)
    if gguf_name.endswith(".ssm_a"):
        return (-np.exp(np.asarray(w, np.float64))).astype(np.float32)
    if gguf_name.endswith("ssm_conv1d.weight"):
        return np.asarray(w, np.float32).reshape(w.shape[0], w.shape[-1])
    return np.asarray(w, np.float32)


def record(name: str, w: np.ndarray) -> TensorRecord:
    w = np.ascontiguousarray(w, np.float32)
    raw = w.view(np.uint8).reshape(w.shape[0], -1) if w.ndim == 2 else w.view(np.uint8).reshape(-1)
    return TensorRecord(name, "F32", tuple(w.shape), raw)


def check(tensors: dict, c: Qwen35Config, source) -> None:
    want = expected_shapes(c)
    missing = [n for n in want if n not in tensors]
    if missing:
        raise ModelFileError(f"{source}: missing tensor {missing[0]!r}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise ModelFileError(f"{source}: unexpected tensor {extra[0]!r} for this qwen35 config; "
                             f"unsupported variant")
    for name, shape in want.items():
        rec = tensors[name]
        if rec.shape != shape:
            raise ModelFileError(f"{source}: tensor {name!r} has shape {rec.shape}, the config "
                                 f"implies {shape}")
        if rec.ggml_type not in SUPPORTED_TYPES:
            raise ModelFileError(f"{source}: tensor {name!r} has type {rec.ggml_type}; supported: "
                                 f"{', '.join(SUPPORTED_TYPES)}")
        if rec.ggml_type in ("F32", "F16") and not np.isfinite(rec.dequantize()).all():
            raise ModelFileError(f"{source}: tensor {name!r} holds non-finite values (a "
                                 f"damaged file?)")


def is_qwen35(config: dict) -> bool:
    return config.get("model_type") in ("qwen3_5_text", "qwen3_5")


def load_hf(folder: Path, raw_cfg: dict, config_path: Path) -> LlamaCheckpoint:
    """The checkpoint of a Qwen3.5 folder whose config.json holds raw_cfg."""
    c = config_from_hf(raw_cfg, config_path)
    tensors = {}
    for file in weight_files(folder):
        for hf_name, (dtype, shape, raw) in read_safetensors(file).items():
            name = hf_name_to_gguf(hf_name, c)
            if name is None:
                raise ModelFileError(f"{file}: unexpected tensor {hf_name!r}; unsupported variant")
            if name == "" or (name == "output.weight" and c.tied_embeddings):
                continue
            tensors[name] = record(name, convert(name, as_f32(dtype, raw, shape)))
    check(tensors, c, folder)
    return LlamaCheckpoint(c, tensors, folder, "safetensors")


def config_from_gguf(reader, path) -> Qwen35Config:
    """Qwen35Config from the qwen35.* keys llama.cpp's converter writes."""
    from .gguf_loader import _f32, read_key

    def key(name, default=...):
        return read_key(reader, f"qwen35.{name}", default, path=path)
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelFileError(f"{path}: missing tensor 'token_embd.weight'")
    recurrent = key("attention.recurrent_layers", None)
    # MTP blocks come last: read past
    n = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    if recurrent is None:
        every = int(key("full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(n)]
    if len(recurrent) < n or n <= 0:
        raise ModelFileError(f"{path}: qwen35.attention.recurrent_layers has {len(recurrent)} "
                             f"entries for {n} blocks")
    recurrent = recurrent[:n]
    Hk, Hv = int(key("ssm.group_count")), int(key("ssm.time_step_rank"))
    inner = int(key("ssm.inner_size"))
    if Hv <= 0 or inner % Hv:
        raise ModelFileError(f"{path}: qwen35.ssm.inner_size {inner} does not split into "
                             f"ssm.time_step_rank {Hv} value heads")

    def token_id(name):
        v = read_key(reader, f"tokenizer.ggml.{name}_token_id", None)
        return None if v is None else int(v)
    try:
        return Qwen35Config(
            n_layers=n, dim=int(key("embedding_length")), n_heads=int(key("attention.head_count")),
            n_kv_heads=int(key("attention.head_count_kv")),
                            head_dim=int(key("attention.key_length")),
            ffn_dim=int(key("feed_forward_length")),
                            vocab_size=int(names["token_embd.weight"].shape[-1]),
            layer_types=tuple("linear_attention" if r else "full_attention" for r in recurrent),
            lin_k_heads=Hk, lin_v_heads=Hv, lin_k_dim=int(key("ssm.state_size")),
                            lin_v_dim=inner // Hv,
            conv_kernel=int(key("ssm.conv_kernel")),
                            rope_base=_f32(key("rope.freq_base", 10_000_000.0)),
            rotary_dim=int(key("rope.dimension_count")),
                            norm_eps=_f32(key("attention.layer_norm_rms_epsilon")),
            context_length=int(key("context_length", 32768)),
                            tied_embeddings="output.weight" not in names,
            bos_id=token_id("bos"), eos_id=token_id("eos"), pad_id=token_id("padding"),
                            v_tiled=Hk != Hv)
    except ModelFileError as e:
        raise ModelFileError(f"{path}: {e}") from None


def load_gguf(reader, path: Path) -> LlamaCheckpoint:
    """A qwen35 GGUF as llama.cpp's converter writes it: the values already in the GGUF convention
    (1 + w norms, A, the conv as (channels, kernel)), value heads in the tiled order. Blocks past
    block_count - nextn_predict_layers (multi-token prediction) are read past."""
    c = config_from_gguf(reader, path)
    tensors = {}
    for t in reader.tensors:
        block = re.match(r"blk\.(\d+)\.", t.name)
        if block and int(block.group(1)) >= c.n_layers:
            continue                        # a multi-token-prediction block: not used here
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = TensorRecord(t.name, t.tensor_type.name, shape,
                                       np.asarray(t.data).view(np.uint8))
    check(tensors, c, path)
    return LlamaCheckpoint(c, tensors, path, "gguf")
