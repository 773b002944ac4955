"""`vkdsl bench model`: prompt processing and generation speed on the device, beside a numpy
float32 forward of the same (dequantized) weights on the same input in the same process."""
from __future__ import annotations

import time

import numpy as np

from . import load_model_files
from .default import default_model_path
from .generate import Generator
from .llama import Llama, LogitsFn


def numpy_forward(w: dict, cfg, tokens) -> np.ndarray:
    """float32 numpy forward of any supported family (the side-by-side reference: BLAS on the same
    cores); weights in vkdsl's layout (GGUF names, adjacent-pair Q/K rows)."""
    H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    T = len(tokens)
    inv = cfg.rope_base ** (-np.arange(0, D, 2) / D)
    if cfg.rope_freq_divisors is not None:
        inv = inv / np.asarray(cfg.rope_freq_divisors)
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(ang).astype(np.float32)[:, None], np.sin(ang).astype(np.float32)[:, None]

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * g

    def rope(x):
        y = np.empty_like(x)
        y[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
        y[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
        return y
    x = w["token_embd.weight"][tokens]
    mask = np.triu(np.full((T, T), -np.inf, np.float32), 1)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q, k, v = ((h @ w[p + m + ".weight"].T + w.get(p + m + ".bias", 0)).reshape(T, n, D)
                   for m, n in (("attn_q", H), ("attn_k", KV), ("attn_v", KV)))
        if cfg.qk_norm:
            q, k = norm(q, w[p + "attn_q_norm.weight"]), norm(k, w[p + "attn_k_norm.weight"])
        q, k, v = rope(q).transpose(1, 0, 2), rope(k).transpose(1, 0, 2), v.transpose(1, 0, 2)
        k, v = np.repeat(k, H // KV, 0), np.repeat(v, H // KV, 0)
        s = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(D)) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True)) @ v
        x = x + a.transpose(1, 0, 2).reshape(T, H * D) @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        g, u = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "ffn_down.weight"].T
    x = norm(x, w["output_norm.weight"])
    return x @ w.get("output.weight", w["token_embd.weight"]).T


def bench_model(path=None, prompt_lengths=(128, 512), gen_tokens=32):
    ck, tok = load_model_files(path or default_model_path())
    model = Llama(ck)
    w = {k: v.astype(np.float32) for k, v in ck.dequantized().items()}
    rng = np.random.default_rng(0)
    rows, ctx_len = [], ck.config.context_length
    gen_tokens = min(gen_tokens, ctx_len - 16)             # a tiny model's context may be short
    for T in sorted({min(T, ctx_len) for T in prompt_lengths}):
        ids = rng.integers(0, ck.config.vocab_size, (1, T)).astype(np.int32)
        # the head in chunks: a 152k vocabulary's logits pass a binding
        f = LogitsFn(model)
        lg = f(ids)                                   # trace, compile, first run
        t = time.perf_counter()
        lg = f(ids)
        dev = time.perf_counter() - t
        t = time.perf_counter()
        ref = numpy_forward(w, ck.config, ids[0])
        npt = time.perf_counter() - t
        agree = float((lg[0].argmax(-1) == ref.argmax(-1)).mean())
        rows.append({"case": f"prompt_{T}", "tokens": T, "device_tok_s": T / dev,
                     "numpy_tok_s": T / npt, "ratio": npt / dev, "argmax_agreement": agree})
        f.release()
    gen = Generator(model, 16 + gen_tokens)
    ids = list(rng.integers(0, ck.config.vocab_size, 16))
    gen.generate(ids, 4)                              # compile the step program
    _, st = gen.generate(ids, gen_tokens)
    ctx = list(ids)
    t = time.perf_counter()
    for _ in range(4):                                # numpy has no KV cache here: full recompute
        ctx.append(int(numpy_forward(w, ck.config, ctx)[-1].argmax()))
    npt = (time.perf_counter() - t) / 4
    dev_tps = st["new_tokens"] / st["decode_s"]
    rows.append({"case": "generate", "tokens": st["new_tokens"], "device_tok_s": dev_tps,
                 "numpy_tok_s": 1 / npt, "ratio": dev_tps * npt,
                 "note": "numpy recomputes the full context per token (no KV cache)"})
    mem = model.device_bytes()
    rows.append({"case": "weights", **mem, "ratio": mem["device_bytes"] / mem["fp32_bytes"]})
    return rows
