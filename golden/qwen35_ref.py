"""Qwen3.5 as transformers computes it (Qwen3_5ForCausalLM), in float64, from Hugging Face names
and values: zero-centred RMSNorms (x_hat * (1 + w)), the Gated DeltaNet layers through the
step-by-step delta rule of golden/gated_delta.py, the full-attention layers with their output gate,
q/k norms and rotate_half RoPE on the first rotary_dim features. Independent of vkdsl (which
converts these tensors at load and runs the chunked form)."""
from __future__ import annotations

import numpy as np

from . import gated_delta


def _rms(x, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def forward(w: dict, cfg: dict, ids, prefix: str = "model.", peft: dict | None = None,
            scale: float = 0.0) -> np.ndarray:
    """Logits (T, vocab) of token ids at positions 0..T-1. w: HF name -> array; cfg: config.json's
    text part (layer_types, linear_* sizes, head_dim, rope_parameters, rms_norm_eps, ...).
    peft: {HF module name: (A (r, in), B (out, r))}, PEFT's LoRA y += scale (x A^T) B^T."""
    peft = {k: tuple(np.asarray(a, np.float64) for a in v) for k, v in (peft or {}).items()}
    f = {k: np.asarray(v, np.float64) for k, v in w.items()}
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    Hk, Hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    rope = cfg.get("rope_parameters") or {}
    rot = int(D * rope.get("partial_rotary_factor", 0.25))
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 1e7)))
    ids = np.asarray(ids, np.int64)
    T = len(ids)
    inv = 1.0 / theta ** (np.arange(0, rot, 2) / rot)
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def lin(x, name):
        y = x @ f[name + ".weight"].T
        if name in peft:
            A, B = peft[name]
            y = y + scale * ((x @ A.T) @ B.T)
        return y

    def norm(x, name):
        return _rms(x, eps) * (1.0 + f[name])

    def rotate(x):                          # (T, heads, D): rotate_half on the first rot features
        xr, rest = x[..., :rot], x[..., rot:]
        half = np.concatenate([-xr[..., rot // 2:], xr[..., :rot // 2]], -1)
        return np.concatenate([xr * cos[:, None] + half * sin[:, None], rest], -1)

    x = f[prefix + "embed_tokens.weight"][ids]
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"{prefix}layers.{i}."
        h = norm(x, p + "input_layernorm.weight")
        if kind == "full_attention":
            a = p + "self_attn."
            qg = lin(h, a + "q_proj").reshape(T, H, 2 * D)
            q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
            q = rotate(norm(q, a + "q_norm.weight"))
            k = rotate(norm(lin(h, a + "k_proj").reshape(T, KV, D), a + "k_norm.weight"))
            v = lin(h, a + "v_proj").reshape(T, KV, D)
            k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
            s = np.einsum("thd,uhd->htu", q, k) / np.sqrt(D)
            s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            o = np.einsum("htu,uhd->thd", pr, v).reshape(T, H * D) * _sigmoid(gate)
            x = x + lin(o, a + "o_proj")
        else:
            a = p + "linear_attn."
            mixed, _ = gated_delta.causal_conv(lin(h, a + "in_proj_qkv")[None],
                                               f[a + "conv1d.weight"][:, 0])
            mixed = _silu(mixed[0])
            q = gated_delta.l2norm(mixed[:, :Hk * dk].reshape(T, Hk, dk))
            k = gated_delta.l2norm(mixed[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk))
            v = mixed[:, 2 * Hk * dk:].reshape(T, Hv, dv)
            q, k = np.repeat(q, Hv // Hk, axis=1), np.repeat(k, Hv // Hk, axis=1)
            beta = _sigmoid(lin(h, a + "in_proj_b"))
            z = lin(h, a + "in_proj_a") + f[a + "dt_bias"]
            g = -np.exp(f[a + "A_log"]) * np.logaddexp(0.0, z)
            o, _ = gated_delta.recurrent(q[None], k[None], v[None], g[None], beta[None])
            o = (_rms(o[0], eps) * f[a + "norm.weight"]
                 * _silu(lin(h, a + "in_proj_z").reshape(T, Hv, dv)))
            x = x + lin(o.reshape(T, Hv * dv), a + "out_proj")
        h = norm(x, p + "post_attention_layernorm.weight")
        m = p + "mlp."
        x = x + lin(_silu(lin(h, m + "gate_proj")) * lin(h, m + "up_proj"), m + "down_proj")
    x = norm(x, prefix + "norm.weight")
    head = f.get("lm_head.weight", f[prefix + "embed_tokens.weight"])
    return x @ head.T
