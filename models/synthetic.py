"""Tiny random Llama checkpoints in both formats, for tests (here and in the device work).

The same float weights are written as a GGUF file (gguf.GGUFWriter, mixed F32/F16/Q8_0/
Q4_0/Q4_1 tensors) and as a Hugging Face folder (safetensors' own writer, HF names, HF Q/K
row order, a hand-written tokenizer.json). Values are first snapped to what each tensor's
GGUF type can represent, so the two files hold exactly the same numbers.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import safetensors
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from .safetensors_loader import gguf_name_to_hf, hf_name_to_gguf, hf_to_gguf_rows

TINY_CONFIG = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
                   vocab_size=300, rope_base=10000.0, norm_eps=1e-5, context_length=64)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")   # ids 0, 1, 2 as in SmolLM2
BOS_ID, EOS_ID, PAD_ID = 1, 2, 2

# SmolLM2-135M-Instruct's template, verbatim.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

# Mixed storage for the default tiny GGUF; tensors not listed are F32.
DEFAULT_TYPES = {
    "token_embd.weight": "Q8_0",
    "blk.0.attn_q.weight": "F16", "blk.0.attn_k.weight": "Q4_0", "blk.0.attn_v.weight": "Q4_1",
    "blk.0.attn_output.weight": "Q8_0", "blk.0.ffn_gate.weight": "Q4_1",
    "blk.0.ffn_up.weight": "Q8_0", "blk.0.ffn_down.weight": "F16",
    "blk.1.attn_q.weight": "Q4_1", "blk.1.attn_k.weight": "Q8_0",
}

_CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.
def add(a, b):
    return a + b
Paris is the capital of France. Berlin is the capital of Germany.
There are 12345 apples and 3.14159 pies in the the the house, isn't it? It's theirs.
<|im_start|>user
Hello there, how are you?<|im_end|>
In 2024 and 2025, 12 of 20 were 2020 models with 1024 or 2048 units; 2024 was 2024.
"""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE tokens are built from it)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass(frozen=True)
class TinyVocab:
    tokens: list[str]
    merges: list[str]            # "left right", rank order
    token_types: list[int]       # GGUF: 1 normal, 3 control


def tiny_bpe(vocab_size: int = TINY_CONFIG["vocab_size"]) -> TinyVocab:
    """Specials + 256 byte tokens + merges learned greedily from a small fixed corpus."""
    b2u = bytes_to_unicode()
    tokens = list(SPECIAL_TOKENS) + [b2u[b] for b in range(256)]
    known = set(tokens)
    corpus = _CORPUS
    for s in SPECIAL_TOKENS:
        corpus = corpus.replace(s, " ")
    words = Counter(tuple(b2u[b] for b in w.encode())
                    for w in re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", corpus))
    merges: list[str] = []
    while len(tokens) < vocab_size:
        pairs: Counter = Counter()
        for w, n in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += n
        if not pairs:
            raise ValueError(f"corpus too small for a vocabulary of {vocab_size}")
        best = min(pairs, key=lambda p: (-pairs[p], p))     # most frequent, then alphabetical
        merges.append(" ".join(best))
        if best[0] + best[1] not in known:
            known.add(best[0] + best[1])
            tokens.append(best[0] + best[1])
        words = Counter({_merge(w, best): n for w, n in words.items()})
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return TinyVocab(tokens, merges, types)


def _merge(word: tuple, pair: tuple) -> tuple:
    out, i = [], 0
    while i < len(word):
        if word[i:i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def random_hf_weights(cfg: dict, seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """float32 weights by HF name, HF (half-split RoPE) Q/K row order, (out, in) shapes."""
    rng = np.random.default_rng(seed)
    d, f, v = cfg["dim"], cfg["ffn_dim"], cfg["vocab_size"]
    q, kv = cfg["n_heads"] * cfg["head_dim"], cfg["n_kv_heads"] * cfg["head_dim"]

    def mat(out, inp, gain=1.0):
        return (rng.standard_normal((out, inp)) * gain / np.sqrt(inp)).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(np.float32),
         "model.norm.weight": norm()}
    for i in range(cfg["n_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = mat(q, d, 2.0)   # gain: non-trivial attention
        w[p + "self_attn.k_proj.weight"] = mat(kv, d, 2.0)
        w[p + "self_attn.v_proj.weight"] = mat(kv, d)
        w[p + "self_attn.o_proj.weight"] = mat(d, q)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = mat(f, d)
        w[p + "mlp.up_proj.weight"] = mat(f, d)
        w[p + "mlp.down_proj.weight"] = mat(d, f)
    if not tied:
        w["lm_head.weight"] = mat(v, d)
    return w


def snap(weights: dict[str, np.ndarray], types: dict[str, str]) -> dict[str, np.ndarray]:
    """Round each tensor to the values its storage type (by GGUF name) can hold exactly.

    Works on HF names too (mapped to GGUF names); quantization blocks run along rows, so
    it commutes with the Q/K row permutation."""
    out = {}
    for name, w in weights.items():
        t = types.get(hf_name_to_gguf(name) or name, "F32")
        qt = GGMLQuantizationType[t]
        w32 = np.asarray(w, dtype=np.float32)
        out[name] = w32 if t == "F32" else dequantize(quantize(w32, qt), qt).reshape(w32.shape)
    return out


def write_gguf(path, gguf_weights: dict[str, np.ndarray], cfg: dict, vocab: TinyVocab,
               types: dict[str, str] | None = None, arch: str = "llama",
               pre: str = "smollm", add_bos: bool = False) -> Path:
    """GGUF file with llama.* keys, tokenizer.ggml.* keys and the tensors in `types`' storage."""
    types = DEFAULT_TYPES if types is None else types
    path = Path(path)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg["n_layers"])
    w.add_context_length(cfg["context_length"])
    w.add_embedding_length(cfg["dim"])
    w.add_feed_forward_length(cfg["ffn_dim"])
    w.add_head_count(cfg["n_heads"])
    w.add_head_count_kv(cfg["n_kv_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_base"])
    w.add_layer_norm_rms_eps(cfg["norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, arr in gguf_weights.items():
        t = types.get(name, "F32")
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if t == "F32":
            w.add_tensor(name, arr)
        elif t == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            qt = GGMLQuantizationType[t]
            w.add_tensor(name, quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_config_json(cfg: dict, tied: bool) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": cfg["dim"], "intermediate_size": cfg["ffn_dim"],
            "num_hidden_layers": cfg["n_layers"], "num_attention_heads": cfg["n_heads"],
            "num_key_value_heads": cfg["n_kv_heads"], "head_dim": cfg["head_dim"],
            "vocab_size": cfg["vocab_size"], "rope_theta": cfg["rope_base"],
            "rms_norm_eps": cfg["norm_eps"], "max_position_embeddings": cfg["context_length"],
            "tie_word_embeddings": tied, "hidden_act": "silu", "rope_scaling": None,
            "attention_bias": False, "mlp_bias": False,
            "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def hf_tokenizer_json(vocab: TinyVocab) -> dict:
    """tokenizer.json as Hugging Face writes it for SmolLM2 (digits split, byte-level)."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i, (t, k) in enumerate(zip(vocab.tokens, vocab.token_types))
                         if k == 3],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]},
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(vocab.tokens)}, "merges": vocab.merges},
    }


def write_safetensors(path, tensors: dict[str, np.ndarray], dtypes: dict[str, str]) -> Path:
    """Write with safetensors' own serializer; dtype per name: F32, F16 or BF16
    (BF16 keeps the top 16 bits of each float32, i.e. truncates)."""
    specs, keep = {}, []
    for name, arr in tensors.items():
        dt = dtypes.get(name, "F32")
        a = np.ascontiguousarray(arr, dtype=np.float32)
        if dt == "F16":
            a = a.astype("<f2")
        elif dt == "BF16":
            a = (a.view(np.uint32) >> 16).astype("<u2")
        keep.append(a)
        specs[name] = safetensors.TensorSpec(
            dtype={"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dt],
            shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
    safetensors.serialize_file(specs, str(path))
    return Path(path)


def write_hf(folder, hf_weights: dict[str, np.ndarray], cfg: dict, vocab: TinyVocab,
             dtypes: dict[str, str] | None = None) -> Path:
    """HF folder: config.json, model.safetensors, tokenizer.json, tokenizer_config.json.
    dtypes: per HF name (default F32)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tied = "lm_head.weight" not in hf_weights
    (folder / "config.json").write_text(json.dumps(hf_config_json(cfg, tied), indent=1))
    write_safetensors(folder / "model.safetensors", hf_weights, dtypes or {})
    (folder / "tokenizer.json").write_text(json.dumps(hf_tokenizer_json(vocab), ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID], "add_prefix_space": False,
        "chat_template": CHAT_TEMPLATE, "model_max_length": cfg["context_length"]}))
    return folder


@dataclass
class TinyModel:
    cfg: dict                    # TINY_CONFIG (+ tied flag), the form llama_ref.forward takes
    hf_weights: dict[str, np.ndarray]     # snapped float32, HF names and row order
    vocab: TinyVocab
    gguf_path: Path
    hf_dir: Path
    types: dict[str, str] = field(default_factory=dict)


def build_tiny(folder, seed: int = 0, tied: bool = True, types: dict[str, str] | None = None,
               hf_dtypes: dict[str, str] | None = None) -> TinyModel:
    """Write tiny.gguf and hf/ under `folder` from one set of random HF-order weights.

    The GGUF side gets Q/K rows permuted by hf_to_gguf_rows (the function under test);
    tests prove the permutation with an HF-convention forward on hf_weights."""
    cfg = dict(TINY_CONFIG, tied_embeddings=tied)
    if types is None:
        types = dict(DEFAULT_TYPES, **({} if tied else {"output.weight": "Q8_0"}))
    hf = snap(random_hf_weights(cfg, seed, tied), types)
    gguf_weights = {}
    for name, w in hf.items():
        g = hf_name_to_gguf(name)
        if g.endswith("attn_q.weight"):
            w = hf_to_gguf_rows(w, cfg["n_heads"])
        elif g.endswith("attn_k.weight"):
            w = hf_to_gguf_rows(w, cfg["n_kv_heads"])
        gguf_weights[g] = w
    vocab = tiny_bpe(cfg["vocab_size"])
    folder = Path(folder)
    gguf_path = write_gguf(folder / "tiny.gguf", gguf_weights, cfg, vocab, types)
    if hf_dtypes is None:   # F16 where the GGUF has F16, so F16 storage is read on both sides
        hf_dtypes = {gguf_name_to_hf(n): "F16" for n, t in types.items() if t == "F16"}
    hf_dir = write_hf(folder / "hf", hf, cfg, vocab, hf_dtypes)
    return TinyModel(cfg, hf, vocab, gguf_path, hf_dir, types)
