"""What an adapter, a checkpoint and every cache of a training run depend on, hashed one way:
the base model's files, the tokenizer (tokens and merges), its chat template and special tokens,
data files, and settings. The manifest, checkpoints, the cached base evaluation and the DPO
reference cache all read these, so one tokenizer has one tokenizer_sha256 everywhere."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_FILES: dict[tuple, str] = {}


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (cached per path, size and mtime within the process)."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _FILES[key] = h.hexdigest()
    return _FILES[key]


def base_sha256(model_path: str | os.PathLike) -> str:
    """sha256 of a GGUF file; for a HF folder, sha256 over the sorted (file name, sha256) of
    config.json and its *.safetensors weight files (the tokenizer is hashed on its own)."""
    p = Path(model_path)
    if not p.is_dir():
        return file_sha256(p)
    h = hashlib.sha256()
    for f in sorted([p / "config.json"] + list(p.glob("*.safetensors"))):
        if f.is_file():
            h.update(f"{f.name}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_sha256(tokenizer) -> str:
    """sha256 of the token list (in id order) and the merges (rank order, "a b" strings).
    The same vocabulary read from a GGUF file and from tokenizer.json hashes the same."""
    engine = tokenizer._engine
    vocab = engine.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    model = json.loads(engine.to_str()).get("model", {})
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return text_sha256(json.dumps({"tokens": tokens, "merges": merges}, ensure_ascii=False))


def chat_template_sha256(tokenizer) -> str | None:
    t = getattr(tokenizer, "chat_template", None)
    return None if not t else text_sha256(t)


def digest(parts) -> str:
    """sha256 of JSON-able parts (keys sorted): the key of a cache, or of a run's settings."""
    return text_sha256(json.dumps(parts, sort_keys=True, default=str))


def of_run(model_path, tokenizer, quant: str, precision: str, data: dict) -> dict:
    """A training run's identity: base, tokenizer, template, special tokens, how the base is
    stored and multiplied, and {name: path} of the data files its steps read (as name_sha256)."""
    special = [getattr(tokenizer, k, None)
               for k in ("bos_id", "eos_id", "pad_id", "end_of_turn_id")]
    return {"base_sha256": base_sha256(model_path), "tokenizer_sha256": tokenizer_sha256(tokenizer),
            "chat_template_sha256": chat_template_sha256(tokenizer), "special_tokens": special,
            "quant": quant, "precision": precision,
            **{f"{k}_sha256": file_sha256(p) for k, p in data.items() if p}}
