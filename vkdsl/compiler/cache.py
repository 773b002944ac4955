"""On-disk SPIR-V cache keyed by sha256(source, compiler identity, options).

Entry = b"VKSP" + sha256(spirv) + spirv, written atomically. An entry whose digest or
SPIR-V magic does not check out is deleted and rebuilt, never loaded."""
from __future__ import annotations

import hashlib
import os
import sys

from ..fileio import atomic_write

SPIRV_MAGIC = b"\x03\x02\x23\x07"


def cache_dir() -> str:
    return os.environ.get("VKDSL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vkdsl", "spirv")


def key(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def valid_spirv(blob: bytes) -> bool:
    return len(blob) >= 20 and len(blob) % 4 == 0 and blob[:4] == SPIRV_MAGIC


def load(k: str) -> bytes | None:
    path = os.path.join(cache_dir(), k + ".spv")
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError:
        return None
    spirv = blob[36:]
    if (blob[:4] != b"VKSP" or hashlib.sha256(spirv).digest() != blob[4:36]
        or not valid_spirv(spirv)):
        print(f"vkdsl: SPIR-V cache entry {path} is corrupted; rebuilding it", file=sys.stderr)
        os.unlink(path)
        return None
    return spirv


def store(k: str, spirv: bytes):
    try:
        atomic_write(os.path.join(cache_dir(), k + ".spv"),
                     b"VKSP" + hashlib.sha256(spirv).digest() + spirv)
    except OSError as e:       # a read-only home must not stop the run
        print(f"vkdsl: cannot write the SPIR-V cache ({e}); continuing without it", file=sys.stderr)
