"""Qwen3.5's forward pass on the device, from vkdsl ops: three of every four layers mix tokens with
a Gated DeltaNet (ops/gated_delta.py), the others with gated full attention; every layer then has
the SwiGLU MLP. A models.llama.Llama with other layers: the embedding, the layer groups (and their
recomputation in the backward), the final norm, the head, the adapters and generation are Llama's.

Gated DeltaNet layer (transformers' Qwen3_5GatedDeltaNet):
  qkv = causal depthwise conv (kernel 4) of in_proj_qkv(x), then SiLU; split into q, k (key heads)
  and v (value heads); q, k L2-normalized per head; beta = sigmoid(in_proj_b(x)),
  g = A * softplus(in_proj_a(x) + dt_bias) (A < 0); o = gated delta rule(q, k, v, g, beta);
  out_proj(RMSNorm(o) * w * SiLU(in_proj_z(x))), the norm per value head.
Full-attention layer: q_proj gives each head's query and its output gate side by side; q and k
get a per-head RMSNorm, then RoPE on their first rotary_dim features (halves rotated, as
transformers' rotate_half); the attention output is multiplied by sigmoid(gate) before o_proj."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

import vkdsl
from vkdsl import Tensor
from vkdsl.ops import attention, gated_delta, nn
from vkdsl.runtime import default_device

from .llama import AdapterTable, Llama
from .qwen35_files import Qwen35Config
from .tensors import LlamaCheckpoint
from .weights import device_weight, planned_bytes

CHUNK = 64          # the delta rule's chunk length in training and prompts


def softplus(x: Tensor) -> Tensor:
    """log(1 + e^x) without overflow: max(x, 0) + log(1 + e^-|x|)."""
    return x.maximum(0.0) + ((-x).minimum(x).exp() + 1.0).log()


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * ((x * x).sum(-1, keepdim=True) + eps).rsqrt()


def causal_conv(x: Tensor, w: Tensor, segments: Tensor | None = None) -> Tensor:
    """Depthwise causal convolution over time: x (B, T, C), w (C, K): y_t = sum_j w_j x_{t-K+1+j};
    with segments (B, T) int32 (packed sequences' ids) a tap that reaches into another sequence
    reads 0."""
    B, T, C = x.shape
    K = w.shape[1]
    xp = x.pad(((0, 0), (K - 1, 0), (0, 0)))
    y = None
    for j in range(K):
        term = xp[:, j:j + T] * w[:, j]
        back = K - 1 - j
        if segments is not None and back:
            same = segments.eq(segments.pad(((0, 0), (back, 0)))[:, :T])
            term = term * same.reshape(B, T, 1)
        y = term if y is None else y + term
    return y


def rope_halves(x: Tensor, cos: Tensor, sin: Tensor, rot: int) -> Tensor:
    """RoPE on the first `rot` features of each head, the two halves of them rotated together
    (transformers' rotate_half); the rest pass. x (B, T, H, D); cos, sin (T, rot / 2), or
    (B, T, rot / 2) when each row has its own positions (packed sequences)."""
    B, T, H, D = x.shape
    h = rot // 2
    c, s = cos.reshape(*cos.shape[:-1], 1, h), sin.reshape(*sin.shape[:-1], 1, h)
    x1, x2 = x[..., :h], x[..., h:rot]
    parts = [x1 * c - x2 * s, x2 * c + x1 * s] + ([x[..., rot:]] if rot < D else [])
    return gated_delta._concat(parts, 3)


class Qwen35(Llama):
    """Llama's forward (the embedding, the layer groups and their recomputation, the final norm and
    head), with Qwen3.5's layers."""

    def __init__(self, ckpt: LlamaCheckpoint, quant: str = "keep"):
        self.cfg: Qwen35Config = ckpt.config
        self.source, self.format = ckpt.source, ckpt.format
        self.stored_types = dict(Counter(r.ggml_type for r in ckpt.tensors.values()).most_common())
        c = self.cfg
        need = sum(planned_bytes(ckpt[n], quant) for n in ckpt.tensors)
        default_device().reserve(need, f"model {Path(str(ckpt.source)).name} (quant {quant})")
        self.linear = {f"blk.{i}.{m}": device_weight(ckpt[f"blk.{i}.{m}.weight"], quant)
                       for i in range(c.n_layers) for m in c.linears(i)}
        matrices = {n + ".weight" for n in self.linear} | {"token_embd.weight", "output.weight"}
        self._vectors = {n: vkdsl.tensor(ckpt[n].dequantize(), name=n)    # norms, conv, dt, A
                         for n in ckpt.tensors if n not in matrices}
        self.bias = {}
        self.embed = device_weight(ckpt["token_embd.weight"], quant)
        self.head = device_weight(ckpt["output.weight"], quant) if "output.weight" in ckpt.tensors \
            else self.embed.as_linear()
        self._lora = AdapterTable()
        cos, sin = nn.rope_tables(np.arange(c.context_length), c.rotary_dim, c.rope_base)
        self._cos, self._sin = (vkdsl.tensor(cos, name="rope_cos"),
                                vkdsl.tensor(sin, name="rope_sin"))

    @property
    def vector(self) -> dict:
        return self._vectors

    def _full_attention(self, i, p, h, B, T, adapters_on, cos, sin, kv, mask, spans):
        c = self.cfg
        H, KV, D = c.n_heads, c.n_kv_heads, c.head_dim
        qg = self._lin(p + "attn_q", h, adapters_on).reshape(B, T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        k = self._lin(p + "attn_k", h, adapters_on).reshape(B, T, KV, D)
        v = self._lin(p + "attn_v", h, adapters_on).reshape(B, T, KV, D)
        q = rope_halves(nn.rmsnorm(q, self.vector[p + "attn_q_norm.weight"], c.norm_eps), cos, sin,
                        c.rotary_dim)
        k = rope_halves(nn.rmsnorm(k, self.vector[p + "attn_k_norm.weight"], c.norm_eps), cos, sin,
                        c.rotary_dim)
        if kv is not None:
            k, v, causal = kv.layer(i, k, v)       # generation: the cache's keys and values
            a = attention.attention(q, k, v, mask=mask, causal=causal)
        else:
            a = attention.attention(q, k, v, spans=spans)
        a = a * nn.sigmoid(gate)
        return self._lin(p + "attn_output", a.reshape(B * T, H * D), adapters_on)

    def _delta_net(self, i, p, h, B, T, adapters_on, cache, segments):
        """cache (generation, models.generate.StateCache): a prompt leaves the last K-1 conv inputs
        and the state after its last real token there (padding steps get g = 0, beta = 0: they
        leave the state as it is); a single new token continues from them."""
        c = self.cfg
        Hk, Hv, dk, dv = c.lin_k_heads, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim
        step = cache is not None and cache.onehot is not None
        mixed = self._lin(p + "attn_qkv", h, adapters_on).reshape(B, T, c.conv_dim)
        w = self.vector[p + "ssm_conv1d.weight"]
        if step:
            window = gated_delta._concat([cache.conv[i], mixed], 1)               # (1, K, channels)
            conv = causal_conv(window, w)[:, c.conv_kernel - 1:]
            cache.conv[i].assign(window[:, 1:])
        else:
            conv = causal_conv(mixed, w, segments)
            if cache is not None:
                cache.conv[i].assign(
                    (cache.tail @ mixed.reshape(T, c.conv_dim)).reshape(1, -1, c.conv_dim))
        mixed = nn.silu(conv)
        q = l2norm(mixed[..., :Hk * dk].reshape(B, T, Hk, dk))
        k = l2norm(mixed[..., Hk * dk:2 * Hk * dk].reshape(B, T, Hk, dk))
        v = mixed[..., 2 * Hk * dk:].reshape(B, T, Hv, dv)
        if Hv > Hk and not c.v_tiled:     # key head g serves value heads g*r .. g*r + r-1
            q, k = (t.reshape(B, T, Hk, 1, dk).expand((B, T, Hk, Hv // Hk, dk))
                    .reshape(B, T, Hv, dk) for t in (q, k))
        elif Hv > Hk:  # llama.cpp's order: value head j*Hk + g belongs to key head g
            q, k = (t.reshape(B, T, 1, Hk, dk).expand((B, T, Hv // Hk, Hk, dk))
                    .reshape(B, T, Hv, dk) for t in (q, k))
        beta = nn.sigmoid(self._lin(p + "ssm_beta", h, adapters_on)).reshape(B, T, Hv)
        a = self._lin(p + "ssm_alpha", h, adapters_on).reshape(B, T, Hv)
        g = softplus(a + self.vector[p + "ssm_dt.bias"]) * self.vector[p + "ssm_a"]
        if step:
            o, state = gated_delta.recurrent(q, k, v, g, beta, state=cache.state[i])
        elif cache is not None:
            valid = cache.valid.reshape(1, T, 1)
            o, state = gated_delta.chunked(q, k, v, g * valid, beta * valid, chunk=CHUNK)
        else:
            o, state = gated_delta.chunked(q, k, v, g, beta, chunk=CHUNK, segments=segments)
        if cache is not None:
            cache.state[i].assign(state)
        z = self._lin(p + "attn_gate", h, adapters_on).reshape(B, T, Hv, dv)
        o = nn.rmsnorm(o, self.vector[p + "ssm_norm.weight"], c.norm_eps) * nn.silu(z)
        return self._lin(p + "ssm_out", o.reshape(B * T, Hv * dv), adapters_on)

    def _layer(self, i, x, adapters_on, cos, sin, kv=None, mask=None, spans=None):
        c = self.cfg
        B, T = x.shape[:2]
        p = f"blk.{i}."
        h = nn.rmsnorm(x, self.vector[p + "attn_norm.weight"], c.norm_eps).reshape(B * T, c.dim)
        if c.layer_types[i] == "full_attention":
            mixed = self._full_attention(i, p, h, B, T, adapters_on, cos, sin, kv, mask, spans)
        else:
            # a packed sequence's first position
            segments = None if spans is None else spans[..., 0]
            mixed = self._delta_net(i, p, h, B, T, adapters_on, kv, segments)
        x = x + mixed.reshape(B, T, c.dim)
        h = nn.rmsnorm(x, self.vector[p + "post_attention_norm.weight"],
                       c.norm_eps).reshape(B * T, c.dim)
        f = nn.swiglu(self._lin(p + "ffn_gate", h, adapters_on),
                      self._lin(p + "ffn_up", h, adapters_on))
        return x + self._lin(p + "ffn_down", f, adapters_on).reshape(B, T, c.dim)
