"""The Llama family as transformers computes it, in float64: Hugging Face tensor names and row
order, rotate_half RoPE over the two halves of each head, Qwen2's q/k/v biases, Qwen3's per-head
q/k RMSNorm, and PEFT's LoRA (y = x W^T + b + s (x A^T) B^T).

Independent of vkdsl, which stores Q/K rows in the adjacent-pair order and permutes every family's
files into it: a loader that permuted a bias or a norm wrongly, or dropped one, disagrees with this.
"""
from __future__ import annotations

import numpy as np


def _norm(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def forward(weights: dict, cfg: dict, ids, peft: dict | None = None,
            scale: float = 0.0) -> np.ndarray:
    """Logits (T, vocab) for token ids at positions 0..T-1.

    weights: HF names (model.layers.{i}.self_attn.q_proj.weight, ...) -> arrays.
    cfg: n_layers, n_heads, n_kv_heads, head_dim, rope_base, norm_eps; optional inv_freq (a scaled
    RoPE's frequencies), qkv_bias, qk_norm (whether those tensors must be read).
    peft: {'model.layers.{i}.self_attn.q_proj': (A (r, in), B (out, r))} applied with `scale`."""
    H, KV, hd, eps = (int(cfg["n_heads"]), int(cfg["n_kv_heads"]), int(cfg["head_dim"]),
                      float(cfg["norm_eps"]))
    f64 = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    peft = peft or {}
    ids = np.asarray(ids, np.int64)
    T = len(ids)

    def lin(x, module, bias=False):
        y = x @ f64[module + ".weight"].T
        if bias:
            y = y + f64[module + ".bias"]
        if module in peft:
            A, B = (np.asarray(a, np.float64) for a in peft[module])
            y = y + scale * ((x @ A.T) @ B.T)
        return y

    inv = cfg.get("inv_freq")
    inv = (1.0 / float(cfg["rope_base"]) ** (np.arange(0, hd, 2) / hd) if inv is None
           else np.asarray(inv))
    ang = np.outer(np.arange(T), inv)
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]        # (T, 1, hd): both halves
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]

    def rotate(v):                                                  # v (T, heads, hd)
        return v * cos + np.concatenate([-v[..., hd // 2:], v[..., :hd // 2]], -1) * sin

    x = f64["model.embed_tokens.weight"][ids]
    for i in range(int(cfg["n_layers"])):
        p = f"model.layers.{i}."
        h = _norm(x, f64[p + "input_layernorm.weight"], eps)
        q, k, v = (lin(h, p + f"self_attn.{n}_proj", bool(cfg.get("qkv_bias"))) for n in "qkv")
        q, k, v = q.reshape(T, H, hd), k.reshape(T, KV, hd), v.reshape(T, KV, hd)
        if cfg.get("qk_norm"):
            q = _norm(q, f64[p + "self_attn.q_norm.weight"], eps)
            k = _norm(k, f64[p + "self_attn.k_norm.weight"], eps)
        q, k = rotate(q), rotate(k)
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)   # repeat_kv
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        s = np.where(np.tri(T, dtype=bool), s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        a = np.einsum("hts,shd->thd", pr / pr.sum(-1, keepdims=True), v).reshape(T, H * hd)
        x = x + lin(a, p + "self_attn.o_proj")
        h = _norm(x, f64[p + "post_attention_layernorm.weight"], eps)
        g, u = lin(h, p + "mlp.gate_proj"), lin(h, p + "mlp.up_proj")
        x = x + lin(g / (1.0 + np.exp(-g)) * u, p + "mlp.down_proj")
    x = _norm(x, f64["model.norm.weight"], eps)
    return x @ f64.get("lm_head.weight", f64["model.embed_tokens.weight"]).T
