"""Atomic checkpoints (adapter + optimizer + step + data order) and the base-model identity."""
from __future__ import annotations

from vkdsl.fileio import atomic_write  # noqa: F401  (train modules import it from here)

import hashlib
import io
import json
from pathlib import Path

import numpy as np


def sha256_file(path, chunk=1 << 20) -> str:
    h = hashlib.sha256()
    p = Path(path)
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    for f in files:
        with open(f, "rb") as fh:
            while b := fh.read(chunk):
                h.update(b)
    return h.hexdigest()


def tokenizer_hash(tok) -> str:
    h = hashlib.sha256()
    for i in range(tok.vocab_size):
        h.update((tok.id_to_token(i) or "").encode("utf-8", "surrogatepass") + b"\0")
    h.update(str((tok.bos_id, tok.eos_id, tok.pad_id, tok.chat_template)).encode())
    return h.hexdigest()


def save(run_dir, step, names, params, opt_state, sampler_state, identity):
    arrays = {f"p{i}": p for i, p in enumerate(params)}
    arrays.update({f"opt_{k}": np.asarray(v) for k, v in opt_state.items()})
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write(Path(run_dir) / "checkpoint.npz", buf.getvalue())
    meta = {"step": step, "modules": names, "sampler": sampler_state, **identity}
    atomic_write(Path(run_dir) / "checkpoint.json", json.dumps(meta).encode())


def load(run_dir):
    run_dir = Path(run_dir)
    if not (run_dir / "checkpoint.json").is_file():
        raise FileNotFoundError(f"{run_dir}: no checkpoint.json to resume from")
    meta = json.loads((run_dir / "checkpoint.json").read_text())
    with np.load(run_dir / "checkpoint.npz") as z:
        params = [z[f"p{i}"] for i in range(sum(1 for k in z.files if k.startswith("p")))]
        opt = {k[4:]: z[k] for k in z.files if k.startswith("opt_")}
    return meta, params, opt


def check_identity(meta, identity):
    for k in ("base_sha256", "tokenizer_sha256"):
        if meta.get(k) != identity[k]:
            what = "base model file" if k == "base_sha256" else "tokenizer"
            raise ValueError(f"refusing to resume: the {what} differs from the run's "
                             f"({k} {str(meta.get(k))[:12]}... vs {identity[k][:12]}...)")
