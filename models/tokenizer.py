"""Text <-> token ids for Llama-family models, built from the model's own files.

Two sources give one engine (HF `tokenizers`):
- a GGUF file: tokenizer.ggml.* keys (vocab, merges, token types, pre-tokenizer name);
- a HF folder: tokenizer.json (+ tokenizer_config.json for the chat template).
Chat templates are rendered with jinja2's sandbox: a template is data from the model file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from jinja2 import TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from .errors import ModelFileError
from .gguf_loader import open_gguf, read_key


def _byte_level(split_digits: bool) -> pre_tokenizers.PreTokenizer:
    """GPT-2 byte-level pre-tokenizer (its regex: 's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+|
    ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+), optionally isolating every digit first."""
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    return pre_tokenizers.Sequence(steps)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    """A family's own split regex, then byte-level mapping without GPT-2's regex (the form Llama 3's
    and Qwen2's tokenizer.json files take)."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])


# The split regexes llama.cpp (llama-vocab.cpp) and the models' tokenizer.json files use: Llama 3
# groups up to three digits, Qwen2 isolates each; both attach one leading non-letter to a word.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| "
                 r"?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Qwen3.5's: combining marks belong to words (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35)
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| "
                 r"?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (pre-tokenizer, NFC-normalize first). Following llama.cpp: STARCODER,
# REFACT, COMMAND_R, SMOLLM, CODESHELL isolate digits and run GPT-2's regex; GPT2, MPT, OLMO run
# GPT-2's alone; llama-bpe (Llama 3) and qwen2 (Qwen2, Qwen2.5, Qwen3) their own regexes; Qwen's
# tokenizer.json also NFC-normalizes, which HF's tokenizer (what the model was trained with) does.
# Other names (deepseek, llama.cpp's "default", ...) use other regexes or BPE options: refused.
_PRE = {**{name: (lambda: _byte_level(False), False) for name in ("gpt2", "mpt", "olmo")},
        **{name: (lambda: _byte_level(True), False)
           for name in ("smollm", "starcoder", "refact", "command-r", "codeshell")},
        "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), False),
        "qwen2": (lambda: _split_then_bytes(_QWEN2_SPLIT), True),
        "qwen35": (lambda: _split_then_bytes(_QWEN35_SPLIT), True)}

# GGUF token types (gguf.TokenType): 2 UNKNOWN, 3 CONTROL and 4 USER_DEFINED are matched verbatim in
# text; 1 NORMAL tokens are what BPE merges into; 6 BYTE are SentencePiece's <0xNN> fallbacks.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4


def _byte_level_engine(key, path, vocab) -> _HFTokenizer:
    """GPT-2 style BPE: merges from tokenizer.ggml.merges, the pre-tokenizer tokenizer.ggml.pre
    names."""
    pre = key("tokenizer.ggml.pre", None)
    if pre not in _PRE:
        raise ModelFileError(f"{path}: tokenizer.ggml.pre is {pre!r}; supported: "
                             f"{', '.join(sorted(_PRE))}")
    merges = [tuple(m.split(" ", 1)) for m in key("tokenizer.ggml.merges")]
    try:
        engine = _HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    except Exception as e:           # the tokenizers library raises a bare Exception on bad merges
        raise ModelFileError(f"{path}: tokenizer.ggml.merges do not fit "
                             f"tokenizer.ggml.tokens ({e})") from None
    make_pre, nfc = _PRE[pre]
    engine.pre_tokenizer = make_pre()
    if nfc:
        engine.normalizer = normalizers.NFC()
    engine.decoder = decoders.ByteLevel()
    return engine


def _spm_engine(key, path, vocab, types) -> _HFTokenizer:
    """SentencePiece BPE (tokenizer.ggml.model 'llama') as Hugging Face's converted tokenizers run
    it:
    spaces become U+2581 with one in front (add_space_prefix), pieces merge highest score first --
    as BPE merges ranked by the merged piece's score -- and characters outside the vocabulary fall
    back to <0xNN> byte tokens."""
    scores = key("tokenizer.ggml.scores")
    if len(scores) != len(vocab):
        raise ModelFileError(f"{path}: {len(vocab)} tokens but {len(scores)} tokenizer.ggml.scores")
    if key("tokenizer.ggml.remove_extra_whitespaces", False):
        raise ModelFileError(f"{path}: tokenizer.ggml.remove_extra_whitespaces = true is not "
                             f"supported")
    unk = key("tokenizer.ggml.unknown_token_id", None)
    normal = {t for t, i in vocab.items() if types[i] == _NORMAL}
    ranked = []
    for t in normal:
        for k in range(1, len(t)):
            if t[:k] in normal and t[k:] in normal:
                ranked.append((-scores[vocab[t]], vocab[t], vocab[t[:k]], t[:k], t[k:]))
    merges = [(a, b) for *_, a, b in sorted(ranked)]
    engine = _HFTokenizer(models.BPE(vocab, merges,
                                     unk_token=None if unk is None else _token(vocab, int(unk)),
                                     fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("\u2581")] if key("tokenizer.ggml.add_space_prefix", True) else []
    engine.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    engine.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                        decoders.Fuse()]
                                       + ([decoders.Strip(" ", 1, 0)] if steps else []))
    return engine


def _token(vocab: dict, i: int) -> str:
    return next(t for t, j in vocab.items() if j == i)


class Tokenizer:
    """encode/decode plus the model's chat template. Build with from_gguf or from_hf."""

    def __init__(self, engine: _HFTokenizer, *, bos_id: int | None, eos_id: int | None,
                 pad_id: int | None, chat_template: str | None, source: Path,
                 template_origin: str | None = None):
        self._engine = engine
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.chat_template = chat_template
        self.source = source
        # where the template text came from, for its errors: a file, or a GGUF file and key
        self.template_origin = template_origin or str(source)
        self._template = (None, None)        # (source text, compiled): compiling costs ~6 ms a row
        self._turn_end = (None, None)        # (template it was found in, token id)

    @property
    def vocab_size(self) -> int:
        return self._engine.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids. Special tokens written in `text` (e.g. <|im_start|>) always become
        their single ids; add_special adds BOS/EOS only where the model asks for them."""
        return self._engine.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids) -> str:
        """Text of `ids`, special tokens included, so decode(encode(t)) == t."""
        return self._engine.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        return self._engine.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._engine.token_to_id(token)

    @property
    def end_of_turn_id(self) -> int | None:
        """The token that closes an assistant turn: the first special token the chat template
        renders after an assistant's content (<|im_end|> for ChatML and Qwen, <|eot_id|> for Llama
        3, often not EOS in a base model's files); EOS when there is no template or it renders
        none."""
        if not self.chat_template:
            return self.eos_id
        if self._turn_end[0] != self.chat_template:
            mark = "\ue000vkdsl-reply\ue001"
            try:
                text = self.apply_chat_template([{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": mark}],
                                                add_generation_prompt=False)
            # a template that wants other turns than this probe's: EOS, as without one
            except Exception:
                text = ""
            after = text[text.find(mark) + len(mark):] if mark in text else ""
            specials = {self._engine.token_to_id(t.content)
                        for t in self._engine.get_added_tokens_decoder().values()
                        if t.special}
            found = next((i for i in self.encode(after, add_special=False) if i in specials),
                         None) \
                if after else None
            self._turn_end = (self.chat_template, self.eos_id if found is None else found)
        return self._turn_end[1]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra) -> str:
        """Render the model's own Jinja chat template (sandboxed) to a string."""
        if not self.chat_template:
            raise ModelFileError(f"{self.source}: no chat template in the model files")
        token = lambda i: None if i is None else self._engine.id_to_token(i)  # noqa: E731
        try:
            if self._template[0] != self.chat_template:
                self._template = (self.chat_template, self._compile_template())
            return self._template[1].render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=token(self.bos_id) or "", eos_token=token(self.eos_id) or "",
                pad_token=token(self.pad_id) or "", **extra)
        except ModelFileError:
            raise
        except TemplateSyntaxError as e:
            raise ModelFileError(f"{self.template_origin}: chat template line {e.lineno}: "
                                 f"{e.message}") from None
        except (TemplateError, ArithmeticError, TypeError, ValueError, LookupError, AttributeError,
                RecursionError) as e:
            # the sandbox's refusals (SecurityError), undefined names, and what a template's own
            # arithmetic or indexing raises (OverflowError of a huge range, ...): the template's
            # fault
            raise ModelFileError(f"{self.template_origin}: chat template failed to render: "
                                 f"{type(e).__name__}: {e}") from None

    def _compile_template(self):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message):
            raise ModelFileError(f"{self.source}: chat template error: {message}")

        env.globals["raise_exception"] = raise_exception
        # Like transformers: non-ASCII stays readable and nothing is HTML-escaped.
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False,
                                                                       indent=indent)
        return env.from_string(self.chat_template)

    # ------------------------------------------------------------------ builders

    @classmethod
    def from_gguf(cls, source, expected_vocab: int | None = None) -> "Tokenizer":
        """From a GGUF path (or an open gguf.GGUFReader). expected_vocab defaults to the
        model's llama.vocab_size / token_embd rows; a different token count is an error."""
        if isinstance(source, (str, os.PathLike)):
            path, reader = Path(source), open_gguf(source)
        else:
            reader = source
            path = Path(getattr(getattr(reader, "data", None), "filename", "") or "<gguf>")

        def key(name, default=...):
            return read_key(reader, name, default, path=path)

        kind = key("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ModelFileError(f"{path}: tokenizer.ggml.model is {kind!r}; supported: 'gpt2' "
                                 f"(byte-level BPE), 'llama' (SentencePiece BPE: Llama 2, Mistral)")
        tokens: list[str] = key("tokenizer.ggml.tokens")
        types = key("tokenizer.ggml.token_type", [1] * len(tokens))
        if len(types) != len(tokens):
            raise ModelFileError(f"{path}: {len(tokens)} tokens but {len(types)} token types")
        vocab = {}
        for i, tok in enumerate(tokens):
            if vocab.setdefault(tok, i) != i:
                raise ModelFileError(f"{path}: token {tok!r} appears twice (ids {vocab[tok]}, {i})")
        if expected_vocab is None:
            expected_vocab = key(f"{key('general.architecture', 'llama')}.vocab_size", None)
            if expected_vocab is None:
                embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
                expected_vocab = None if embd is None else int(embd.shape[-1])
        _check_vocab(len(tokens), expected_vocab, path)

        engine = (_byte_level_engine(key, path, vocab) if kind == "gpt2"
                  else _spm_engine(key, path, vocab, types))
        engine.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                   for t, k in zip(tokens, types) if k in (_UNKNOWN, _CONTROL)])
        engine.add_tokens([AddedToken(t, special=False, normalized=False)
                           for t, k in zip(tokens, types) if k == _USER_DEFINED])

        ids = {name: key(f"tokenizer.ggml.{name}_token_id", None)
               for name in ("bos", "eos", "padding")}
        ids = {name: None if i is None else int(i) for name, i in ids.items()}
        add_bos = bool(key("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(key("tokenizer.ggml.add_eos_token", False))
        _set_post_processor(engine, tokens, bos=ids["bos"] if add_bos else None,
                            eos=ids["eos"] if add_eos else None)
        return cls(engine, bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["padding"],
                   chat_template=key("tokenizer.chat_template", None), source=path,
                   template_origin=f"{path} (GGUF key tokenizer.chat_template)")

    @classmethod
    def from_hf(cls, folder: str | os.PathLike, expected_vocab: int | None = None) -> "Tokenizer":
        """From a HF folder: tokenizer.json, tokenizer_config.json (chat template, special
        tokens), config.json (vocab_size, used as expected_vocab unless given)."""
        folder = Path(folder)
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise ModelFileError(f"{folder}: no tokenizer.json")
        try:
            engine = _HFTokenizer.from_file(str(tok_path))
        except Exception as e:
            raise ModelFileError(f"{tok_path}: not a readable tokenizer.json: {e}") from e
        tcfg = _read_json(folder / "tokenizer_config.json")
        mcfg = _read_json(folder / "config.json")
        if expected_vocab is None:
            expected_vocab = mcfg.get("vocab_size")
        _check_vocab(engine.get_vocab_size(with_added_tokens=True), expected_vocab, tok_path)

        def special(name: str) -> int | None:
            tok = tcfg.get(f"{name}_token")
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if tok is not None and engine.token_to_id(tok) is not None:
                return engine.token_to_id(tok)
            value = mcfg.get(f"{name}_token_id")
            return int(value[0] if isinstance(value, list) else value) if value is not None \
                else None

        template = tcfg.get("chat_template")
        origin = f"{folder / 'tokenizer_config.json'} (chat_template)"
        if isinstance(template, list):   # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template, origin = jinja_file.read_text(), str(jinja_file)
        return cls(engine, bos_id=special("bos"), eos_id=special("eos"), pad_id=special("pad"),
                   chat_template=template, source=folder, template_origin=origin)


def load_tokenizer(path: str | os.PathLike, expected_vocab: int | None = None,
                   reader=None) -> Tokenizer:
    """Tokenizer from a .gguf file (or its open reader) or a HF folder."""
    path = Path(path)
    if path.is_dir():
        return Tokenizer.from_hf(path, expected_vocab=expected_vocab)
    return Tokenizer.from_gguf(reader if reader is not None else path,
                               expected_vocab=expected_vocab)


def _check_vocab(n_tokens: int, expected: int | None, path: Path) -> None:
    """A tokenizer may have fewer tokens than the model has embedding rows (Qwen's tokenizer.json
    holds 151,665 for 151,936 rows: the table is padded), never more: its ids would index
    nothing."""
    if expected is not None and n_tokens > int(expected):
        raise ModelFileError(f"{path}: tokenizer has {n_tokens} tokens but the model's "
                             f"vocabulary is {int(expected)} (ids from {int(expected)} on index no "
                             f"embedding row)")


def _set_post_processor(engine: _HFTokenizer, tokens: list[str], *, bos: int | None,
                        eos: int | None) -> None:
    """BOS/EOS insertion (only when the GGUF's add_bos/add_eos ask for it)."""
    if bos is None and eos is None:
        return
    parts, specials = ["$A"], []
    if bos is not None:
        parts.insert(0, tokens[bos])
        specials.append((tokens[bos], bos))
    if eos is not None:
        parts.append(tokens[eos])
        specials.append((tokens[eos], eos))
    engine.post_processor = processors.TemplateProcessing(
        single=" ".join(parts), special_tokens=specials)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{path}: invalid JSON: {e}") from e
