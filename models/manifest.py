"""Provenance manifest written beside every saved adapter (`vkdsl_manifest.json`), and the
check that refuses to apply an adapter to a base or tokenizer it was not trained on.

The manifest records what the adapter depends on (base file sha256 and name, tokenizer and
chat-template hashes) and how it was made (target modules, rank, alpha, rsLoRA, scaling,
dtype, plus whatever the trainer passes: data hashes, seeds, objective, metrics, gates...).
"""
from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from vkdsl.fileio import atomic_write
from vkdsl.ops.lora import lora_scale

from .errors import ModelFileError
from .identity import base_sha256, chat_template_sha256, tokenizer_sha256

MANIFEST_NAME = "vkdsl_manifest.json"
MANIFEST_VERSION = 1


class ManifestMismatch(ModelFileError):
    """The adapter's manifest names another base model or tokenizer."""


# ----------------------------------------------------------------------------- build / io

def build_manifest(model_path: str | os.PathLike, tokenizer, *, target_modules, r: int,
                   alpha: float, rslora: bool, scaling: float | None = None,
                   dtype: str = "float32", extra: dict | None = None, **fields) -> dict:
    """The manifest dict. `extra` and keyword `fields` are copied in as given (the trainer's
    data hashes and row counts, seeds, objective and hyper-parameters, max length,
    truncation side, masking rule, steps, device and driver, final metrics, gates...)."""
    try:
        from importlib.metadata import version
        vk_version = version("vkdsl")
    except Exception:
        vk_version = "unknown"
    p = Path(model_path)
    m: dict[str, Any] = {
        "vkdsl_manifest_version": MANIFEST_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "vkdsl_version": vk_version,
        "base": {"name": p.name, "sha256": base_sha256(p),
                 "format": "safetensors" if p.is_dir() else "gguf"},
        "tokenizer_sha256": tokenizer_sha256(tokenizer) if tokenizer is not None else None,
        "chat_template_sha256": chat_template_sha256(tokenizer) if tokenizer is not None else None,
        "adapter": {"target_modules": sorted(target_modules), "r": int(r), "alpha": float(alpha),
                    "rslora": bool(rslora),
                    "scaling": float(scaling if scaling is not None
                                     else lora_scale(alpha, r, rslora)),
                    "dtype": dtype},
    }
    for k, v in {**(extra or {}), **fields}.items():
        if k in m:
            raise ValueError(f"manifest field {k!r} is reserved")
        m[k] = v
    return m




def write_manifest(folder_or_file: str | os.PathLike, manifest: dict) -> Path:
    """Write vkdsl_manifest.json into a folder (or to the given .json path), atomically."""
    p = Path(folder_or_file)
    path = p if p.suffix == ".json" else p / MANIFEST_NAME
    return atomic_write(path, (json.dumps(manifest, indent=1, sort_keys=True,
                                                default=str) + "\n").encode())


def read_manifest(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{path}: unreadable manifest: {e}") from e
    if not isinstance(m, dict) or "base" not in m:
        raise ModelFileError(f"{path}: not a vkdsl manifest (no 'base' entry)")
    return m


# ----------------------------------------------------------------------------- check

def manifest_mismatches(manifest: dict, model_path: str | os.PathLike,
                        tokenizer=None) -> list[str]:
    """Human-readable differences between what the manifest names and this base/tokenizer."""
    out = []
    base = manifest.get("base") or {}
    want = base.get("sha256")
    if want:
        got = base_sha256(model_path)
        if got != want:
            out.append(f"base model: the adapter was trained on {base.get('name')!r} "
                       f"(sha256 {want[:16]}…) but is applied to {Path(model_path).name!r} "
                       f"(sha256 {got[:16]}…)")
    if tokenizer is not None:
        want = manifest.get("tokenizer_sha256")
        if want and tokenizer_sha256(tokenizer) != want:
            out.append(f"tokenizer: sha256 of tokens+merges is "
                       f"{tokenizer_sha256(tokenizer)[:16]}…, the manifest says {want[:16]}…")
        want = manifest.get("chat_template_sha256")
        got = chat_template_sha256(tokenizer)
        if "chat_template_sha256" in manifest and want != got:
            out.append(f"chat template: sha256 {str(got)[:16]}…, the manifest says "
                       f"{str(want)[:16]}…")
    return out


def check_manifest(manifest: dict, model_path: str | os.PathLike, tokenizer=None,
                   force: bool = False, source: str | os.PathLike = "adapter",
                   more=()) -> list[str]:
    """Raise ManifestMismatch naming each mismatch (with `more`: the adapter's own, e.g. a changed
    alpha or weight file); with force=True print a loud warning to stderr instead and return
    them."""
    bad = manifest_mismatches(manifest, model_path, tokenizer) + list(more)
    if bad and not force:
        raise ManifestMismatch(f"{source}: manifest does not match the model it is applied to:\n  "
                               + "\n  ".join(bad) + "\n(use --force / force=True to apply anyway)")
    if bad:
        bar = "!" * 78
        print(f"{bar}\nWARNING: {source}: applying an adapter whose manifest does NOT match "
              f"(forced):\n  " + "\n  ".join(bad) + f"\n{bar}", file=sys.stderr, flush=True)
    return bad
