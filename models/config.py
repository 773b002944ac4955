"""Hyper-parameters of a Llama-family model (Llama, Mistral, Qwen2, Qwen3), validated once at load
time."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .errors import ModelFileError

# The linear modules of a layer, in the order a layer computes them (GGUF names).
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Qwen3.5's Gated DeltaNet projections (llama.cpp's qwen35 names): every linear module of any
# family, in the order a layer computes them, is MODULES.
DELTANET_LINEARS = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out")
MODULES = LINEARS[:4] + DELTANET_LINEARS + LINEARS[4:]

# Families that share Llama's computation, and what each adds to it. Mistral (no sliding window)
# is Llama's computation under another name; its GGUF files say "llama".
#   qkv_bias: q, k and v projections carry a bias (Qwen2)
#   qk_norm:  per-head RMSNorm on q and k before RoPE (Qwen3)
#   gguf_pairs: the family's GGUF stores Q/K rows in adjacent-pair RoPE order (llama.cpp's
#     converter permutes Llama's); Qwen GGUF files keep Hugging Face's half-split order.
ARCHS = {
    "llama": dict(gguf_arch="llama", qkv_bias=False, qk_norm=False, gguf_pairs=True),
    "mistral": dict(gguf_arch="llama", qkv_bias=False, qk_norm=False, gguf_pairs=True),
    "qwen2": dict(gguf_arch="qwen2", qkv_bias=True, qk_norm=False, gguf_pairs=False),
    "qwen3": dict(gguf_arch="qwen3", qkv_bias=False, qk_norm=True, gguf_pairs=False),
}


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    dim: int                  # hidden size (residual stream width)
    n_heads: int              # query heads
    n_kv_heads: int           # key/value heads (GQA: each serves n_heads // n_kv_heads)
    head_dim: int
    ffn_dim: int              # SwiGLU inner width
    vocab_size: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    context_length: int = 2048
    tied_embeddings: bool = False   # True: logits use token_embd.weight (no output.weight)
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    # RoPE frequency divisors (head_dim / 2 of them): inv_freq_i = base^(-2i/head_dim) / d_i, as
    # llama.cpp's rope_freqs.weight tensor holds them; None = plain RoPE. Llama 3.x's scaling.
    rope_freq_divisors: tuple[float, ...] | None = None
    arch: str = "llama"             # a key of ARCHS; fixes qkv_bias, qk_norm and the GGUF row order

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ModelFileError(f"LlamaConfig.arch = {self.arch!r}; supported: {', '.join(ARCHS)}")
        for key in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                    "vocab_size", "context_length"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelFileError(f"LlamaConfig.{key} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ModelFileError(
                f"LlamaConfig: n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads}) so query heads share key/value heads evenly")
        if self.head_dim % 2:
            # RoPE rotates pairs of features.
            raise ModelFileError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_base > 1.0:
            raise ModelFileError(f"LlamaConfig.rope_base must be > 1, got {self.rope_base!r}")
        if not 0.0 < self.norm_eps < 1.0:
            raise ModelFileError(f"LlamaConfig.norm_eps must be in (0, 1), got {self.norm_eps!r}")
        d = self.rope_freq_divisors
        if (d is not None
            and (len(d) != self.head_dim // 2 or not all(math.isfinite(x) and x > 0 for x in d))):
            raise ModelFileError(f"LlamaConfig.rope_freq_divisors must be {self.head_dim // 2} "
                                 f"positive finite numbers (one per RoPE frequency), got {len(d)}")
        for key in ("bos_id", "eos_id", "pad_id"):
            value = getattr(self, key)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ModelFileError(
                    f"LlamaConfig.{key} = {value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def qkv_bias(self) -> bool:
        return ARCHS[self.arch]["qkv_bias"]

    @property
    def qk_norm(self) -> bool:
        return ARCHS[self.arch]["qk_norm"]

    @property
    def gguf_arch(self) -> str:
        return ARCHS[self.arch]["gguf_arch"]

    @property
    def gguf_pairs(self) -> bool:
        return ARCHS[self.arch]["gguf_pairs"]

    def linears(self, i: int) -> tuple:
        """The linear modules of layer i (every layer has the same)."""
        return LINEARS

    @property
    def rotary_dim(self) -> int:
        return self.head_dim        # RoPE turns every feature of a head (Qwen3.5 turns fewer)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        """Plain dict, the form golden/llama_ref.py takes (it must not import this module)."""
        return dict(asdict(self), qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)


def llama3_divisors(head_dim: int, base: float, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_context: int) -> tuple[float, ...]:
    """Llama 3.x RoPE scaling as per-frequency divisors: frequencies whose wavelength is shorter
    than original_context / high_freq_factor keep their value, those longer than original_context /
    low_freq_factor are divided by factor, and the ones between are blended linearly in
    original_context / wavelength (float32, as a GGUF file stores them)."""
    if not (factor > 0 and high_freq_factor > low_freq_factor > 0 and original_context > 0):
        raise ModelFileError(f"llama3 RoPE scaling: factor {factor}, low_freq_factor "
                             f"{low_freq_factor}, high_freq_factor {high_freq_factor}, original "
                             f"context {original_context}: expected factor > 0, high_freq_factor > "
                             f"low_freq_factor > 0, a positive context")
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    out = []
    for w in wavelen:
        if w < original_context / high_freq_factor:
            out.append(1.0)
        elif w > original_context / low_freq_factor:
            out.append(factor)
        else:
            smooth = (original_context / w - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(float(np.float32(x)) for x in out)
