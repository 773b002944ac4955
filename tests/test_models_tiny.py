"""Tiny random Llama written as GGUF and as a HF folder: both loaders must agree.

Independent references: gguf's own dequantizer for the GGUF side, a Hugging Face
convention forward (half-split RoPE, HF row order, per-head loops) written here for the
Q/K permutation, and golden/llama_ref.py (which imports nothing from vkdsl) for logits.
"""
import numpy as np
import pytest

from vkdsl_golden import llama_ref
from vkdsl.models import (LlamaConfig, Tokenizer, gguf_to_hf_rows, hf_to_gguf_rows, load_gguf,
                          load_hf)
from fixtures.synthetic import DEFAULT_TYPES, SPECIAL_TOKENS, build_tiny

PROMPT = [1, 5, 100, 200, 7, 290, 42, 260, 2, 13, 77]    # (T=11,) arbitrary ids < 300


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def tiny_untied_f32(tmp_path_factory):
    # Every tensor F32 on both sides, separate lm_head: the exact-equality case.
    return build_tiny(tmp_path_factory.mktemp("tiny32"), seed=1, tied=False, types={},
                      hf_dtypes={})


def hf_forward(w: dict, cfg: dict, ids) -> np.ndarray:
    """Llama as transformers computes it: HF row order, rotate_half RoPE. logits (T, vocab)."""
    H, KV, hd = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    T = len(ids)
    f64 = {k: v.astype(np.float64) for k, v in w.items()}

    def norm(x, g):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + cfg["norm_eps"]) * g

    inv_freq = 1.0 / cfg["rope_base"] ** (np.arange(0, hd, 2) / hd)
    ang = np.outer(np.arange(T), inv_freq)
    ang = np.concatenate([ang, ang], axis=-1)                      # (T, hd): HF duplicates
    cos, sin = np.cos(ang), np.sin(ang)

    def rotate(v):                                                 # v (T, hd)
        rot_half = np.concatenate([-v[:, hd // 2:], v[:, :hd // 2]], axis=-1)
        return v * cos + rot_half * sin

    x = f64["model.embed_tokens.weight"][ids]
    for i in range(cfg["n_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, f64[p + "input_layernorm.weight"])
        q, k, v = (h @ f64[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        heads = []
        for head in range(H):
            kvh = head // (H // KV)                                # repeat_kv
            qh = rotate(q[:, head * hd:(head + 1) * hd])
            kh = rotate(k[:, kvh * hd:(kvh + 1) * hd])
            s = qh @ kh.T / np.sqrt(hd)
            s[np.triu_indices(T, 1)] = -np.inf
            pr = np.exp(s - s.max(-1, keepdims=True))
            heads.append(pr / pr.sum(-1, keepdims=True) @ v[:, kvh * hd:(kvh + 1) * hd])
        x = x + np.concatenate(heads, axis=-1) @ f64[p + "self_attn.o_proj.weight"].T
        h = norm(x, f64[p + "post_attention_layernorm.weight"])
        g, u = h @ f64[p + "mlp.gate_proj.weight"].T, h @ f64[p + "mlp.up_proj.weight"].T
        x = x + (g * (1 / (1 + np.exp(-g))) * u) @ f64[p + "mlp.down_proj.weight"].T
    x = norm(x, f64["model.norm.weight"])
    return x @ f64.get("lm_head.weight", f64["model.embed_tokens.weight"]).T


def test_permutation_functions_are_inverse_and_match_the_formula():
    rng = np.random.default_rng(0)
    n_heads, hd = 3, 8
    w = rng.standard_normal((n_heads * hd, 5))
    g = hf_to_gguf_rows(w, n_heads)
    for h in range(n_heads):                # GGUF row h*hd + 2i + j = HF row h*hd + hd/2*j + i
        for i in range(hd // 2):
            for j in range(2):
                np.testing.assert_array_equal(g[h * hd + 2 * i + j], w[h * hd + hd // 2 * j + i])
    np.testing.assert_array_equal(gguf_to_hf_rows(g, n_heads), w)
    np.testing.assert_array_equal(hf_to_gguf_rows(gguf_to_hf_rows(w, n_heads), n_heads), w)
    # axis=1: a LoRA B stored (r, out) permutes its columns the same way.
    np.testing.assert_array_equal(hf_to_gguf_rows(w.T, n_heads, axis=1), g.T)
    with pytest.raises(ValueError):
        hf_to_gguf_rows(np.zeros((10, 2)), 3)


def test_both_loaders_give_the_same_config_and_tensors(tiny):
    a, b = load_gguf(tiny.gguf_path), load_hf(tiny.hf_dir)
    fields = {k: v for k, v in tiny.cfg.items() if k not in ("qkv_bias", "qk_norm")}   # the arch's
    assert a.config == b.config == LlamaConfig(**fields, bos_id=1, eos_id=2, pad_id=2)
    assert a.config.tied_embeddings and "output.weight" not in a.tensors
    assert set(a.tensors) == set(b.tensors)
    for name, rec in a.tensors.items():
        assert rec.ggml_type == DEFAULT_TYPES.get(name, "F32"), name
        np.testing.assert_array_equal(rec.dequantize(), b[name].dequantize(), err_msg=name)


def test_gguf_records_are_raw_blocks_matching_gguf_dequantize(tiny):
    import gguf
    from gguf.quants import dequantize
    ck = load_gguf(tiny.gguf_path)
    reader = gguf.GGUFReader(tiny.gguf_path)
    for t in reader.tensors:
        rec = ck[t.name]
        assert rec.raw.dtype == np.uint8 and not rec.raw.flags.writeable
        assert rec.nbytes == t.n_bytes
        assert rec.shape == tuple(reversed(t.shape.tolist()))
        np.testing.assert_array_equal(rec.dequantize(), dequantize(t.data, t.tensor_type)
                                      .reshape(rec.shape))
    q = ck["blk.0.attn_v.weight"]            # Q4_1 (32, 64): 2 blocks of 20 bytes per row
    assert q.ggml_type == "Q4_1" and q.shape == (32, 64) and q.raw.shape == (32, 40)


def test_gguf_holds_the_hf_values_in_gguf_row_order(tiny):
    ck = load_gguf(tiny.gguf_path)
    hq = tiny.hf_weights["model.layers.1.self_attn.q_proj.weight"]
    gq = ck["blk.1.attn_q.weight"].dequantize()
    assert not np.array_equal(gq, hq)        # really permuted, not stored as-is
    np.testing.assert_array_equal(gguf_to_hf_rows(gq, 4), hq)


def test_reference_logits_agree_across_formats_and_with_hf_convention(tiny):
    cfg = load_gguf(tiny.gguf_path).config.to_dict()
    la = llama_ref.forward(load_gguf(tiny.gguf_path).dequantized(), cfg, PROMPT)
    lb = llama_ref.forward(load_hf(tiny.hf_dir).dequantized(), cfg, PROMPT)
    assert la.shape == (len(PROMPT), 300)
    np.testing.assert_array_equal(la, lb)
    # The proof that Q/K were permuted correctly: adjacent-pair RoPE on GGUF rows must equal
    # rotate_half RoPE on HF rows. A wrong permutation changes logits by O(1).
    ref = hf_forward(tiny.hf_weights, tiny.cfg, PROMPT)
    np.testing.assert_allclose(la, ref, rtol=1e-10, atol=1e-10)
    assert np.abs(ref).max() > 1.0 and ref[:, :].std(axis=0).max() > 0.1   # not degenerate


def test_skipping_the_permutation_would_be_caught(tiny):
    # Same check with the permutation deliberately left out: logits must differ a lot.
    w = load_hf(tiny.hf_dir).dequantized()
    for i in range(2):
        w[f"blk.{i}.attn_q.weight"] = gguf_to_hf_rows(w[f"blk.{i}.attn_q.weight"], 4)
        w[f"blk.{i}.attn_k.weight"] = gguf_to_hf_rows(w[f"blk.{i}.attn_k.weight"], 2)
    wrong = llama_ref.forward(w, tiny.cfg, PROMPT)
    assert np.abs(wrong - hf_forward(tiny.hf_weights, tiny.cfg, PROMPT)).max() > 0.1


def test_untied_f32_model_is_exact(tiny_untied_f32):
    m = tiny_untied_f32
    a, b = load_gguf(m.gguf_path), load_hf(m.hf_dir)
    assert not a.config.tied_embeddings and a["output.weight"].ggml_type == "F32"
    assert all(r.ggml_type == "F32" for r in b.tensors.values())
    wa, wb = a.dequantized(), b.dequantized()
    for name in wa:
        np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)
    la = llama_ref.forward(wa, a.config.to_dict(), PROMPT)
    np.testing.assert_array_equal(la, llama_ref.forward(wb, b.config.to_dict(), PROMPT))
    np.testing.assert_allclose(la, hf_forward(m.hf_weights, m.cfg, PROMPT), rtol=1e-10,
                               atol=1e-10)


def test_bf16_safetensors_decode_exactly(tmp_path):
    m = build_tiny(tmp_path, seed=2, types={}, hf_dtypes={
        "model.layers.0.self_attn.q_proj.weight": "BF16", "model.norm.weight": "BF16",
        "model.layers.1.mlp.down_proj.weight": "F16"})
    ck = load_hf(m.hf_dir)
    for hf_name, gg_name, perm in [("model.layers.0.self_attn.q_proj.weight",
                                    "blk.0.attn_q.weight", True),
                                   ("model.norm.weight", "output_norm.weight", False)]:
        want = m.hf_weights[hf_name].copy()
        want = (want.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)   # truncation
        want = hf_to_gguf_rows(want, 4) if perm else want
        assert ck[gg_name].ggml_type == "F32"          # BF16 widened exactly
        np.testing.assert_array_equal(ck[gg_name].dequantize(), want)
    down = ck["blk.1.ffn_down.weight"]
    assert down.ggml_type == "F16" and down.raw.shape == (64, 96 * 2)
    np.testing.assert_array_equal(
        down.dequantize(), m.hf_weights["model.layers.1.mlp.down_proj.weight"].astype(np.float16)
        .astype(np.float32))


TINY_TEXTS = ["The quick brown fox jumps over the lazy dog.", "isn't it? It's theirs.",
              "12345 and 3.14159, in 2024 or 2048", "def add(a, b):\n    return a + b\n",
              "<|im_start|>user\nHello there<|im_end|>\n", "  spaced   out \n\n", "héllo 世界 🎉"]


def test_tiny_tokenizer_same_from_gguf_hf_and_slow_bpe(tiny):
    tg, th = Tokenizer.from_gguf(tiny.gguf_path), Tokenizer.from_hf(tiny.hf_dir)
    for tok in (tg, th):
        assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (300, 1, 2, 2)
    for text in TINY_TEXTS:
        want = llama_ref.bpe_encode(text, tiny.vocab.tokens, tiny.vocab.merges,
                                    list(SPECIAL_TOKENS))
        assert tg.encode(text) == want, text
        assert th.encode(text) == want, text
        assert tg.decode(want) == text and th.decode(want) == text
    msgs = [{"role": "user", "content": "Hi"}]
    assert tg.apply_chat_template(msgs) == th.apply_chat_template(msgs)


def test_tiny_gguf_tokenizer_variants(tmp_path, tiny):
    """pre = "gpt2" (no digit splitting) and add_bos_token = true, against the slow BPE."""
    from fixtures.synthetic import write_gguf
    w = load_gguf(tiny.gguf_path).dequantized()
    path = write_gguf(tmp_path / "gpt2.gguf", w, tiny.cfg, tiny.vocab, types={}, pre="gpt2",
                      add_bos=True)
    tok = Tokenizer.from_gguf(path)
    for text in TINY_TEXTS:
        want = llama_ref.bpe_encode(text, tiny.vocab.tokens, tiny.vocab.merges,
                                    list(SPECIAL_TOKENS), split_digits=False)
        assert tok.encode(text, add_special=False) == want, text
        assert tok.encode(text) == [1] + want
        assert tok.decode(want) == text
    # " 2024" stays one piece here (merged digits); smollm splits it into " ", "2", "0", ...
    assert len(tok.encode(" 2024", add_special=False)) < 3
    assert Tokenizer.from_gguf(tiny.gguf_path).encode(" 2024") == [35, 53, 51, 53, 55]



def test_a_traced_forward_follows_swapped_adapters(tiny):
    """Replacing an adapter object after tracing rebuilds the program (it captured the old object);
    updating adapter values in place, as training does, replays the same program."""
    import vkdsl
    from vkdsl.trace import BUILT
    from vkdsl.models import load_model_files
    from vkdsl.models.llama import Llama
    from vkdsl.ops.lora import LoRA
    m = Llama(load_model_files(tiny.gguf_path)[0])
    name = "blk.1.attn_v"
    out_f, in_f = m.linear[name].shape
    rng = np.random.default_rng(0)
    random_b = lambda: vkdsl.tensor(rng.standard_normal((4, out_f)).astype(np.float32))   # noqa: E731

    def adapter(seed):
        lo = LoRA.init(in_f, out_f, 4, 8.0, seed=seed, name="attn_v")
        lo.B.assign(random_b())
        return lo
    m.lora[name] = adapter(1)
    ids = rng.integers(3, 300, (1, 9)).astype(np.int32)
    fwd = vkdsl.trace(lambda t: m.forward(t))
    first = fwd(ids)
    built = BUILT["programs"]
    m.lora[name] = adapter(2)
    swapped = fwd(ids)
    want = m.forward(vkdsl.tensor(ids)).numpy()
    assert BUILT["programs"] == built + 1 and np.abs(swapped - first).max() > 1e-3
    np.testing.assert_allclose(swapped, want, rtol=0, atol=1e-5 * np.abs(want).max())
    m.lora[name].B.assign(random_b())                 # in place: the same program, the new values
    updated = fwd(ids)
    want = m.forward(vkdsl.tensor(ids)).numpy()
    assert BUILT["programs"] == built + 1
    np.testing.assert_allclose(updated, want, rtol=0, atol=1e-5 * np.abs(want).max())
