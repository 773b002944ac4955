"""GLSL -> SPIR-V: preprocess (defines, includes), then bundle -> disk cache -> compiler.

A SPIR-V bundle (`vkdsl compile --bundle DIR`, used with $VKDSL_SPIRV_BUNDLE=DIR) lets vkdsl
run on a machine with no shader compiler: kernels are looked up by a hash of their expanded
source, which does not depend on the compiler that built them."""
from __future__ import annotations

import hashlib
import json
import os
import re

from . import cache
from .backends import find_backend
from .errors import CompileError, NoCompiler

KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "kernels")
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)
_backend = ...           # resolved lazily; None when no compiler exists
_bundle_cache = {}
_memo: dict[tuple, bytes] = {}   # (source, defines, bundle) -> SPIR-V: re-recording re-reads no disk
compiled_this_process: dict[str, tuple[str, str]] = {}   # source key -> (name, expanded source)

__all__ = ["compile_glsl", "expand", "forget_compiled", "CompileError", "NoCompiler", "backend", "write_bundle", "kernel_source"]


def kernel_source(filename: str) -> str:
    with open(os.path.join(KERNEL_DIR, filename)) as f:
        return f.read()


def expand(source: str, defines: dict | None = None, include_dir: str = KERNEL_DIR) -> str:
    """Inline #include "x.glsl" from include_dir (the kernel folder) and put #defines after #version."""
    seen = set()

    def inline(m):
        name = m.group(1)
        if name in seen:
            return ""
        seen.add(name)
        with open(os.path.join(include_dir, name)) as f:
            return _INCLUDE.sub(inline, f.read())
    src = _INCLUDE.sub(inline, source)
    if defines:
        lines = src.split("\n")
        at = next((i + 1 for i, l in enumerate(lines) if l.startswith("#version")), 0)
        lines[at:at] = [f"#define {k} {v}" for k, v in sorted(defines.items())]
        src = "\n".join(lines)
    return src


def forget_compiled():
    """Drop the in-memory SPIR-V (tests that inspect the disk cache start from it)."""
    _memo.clear()


def backend():
    global _backend
    if _backend is ...:
        _backend = find_backend()
    return _backend


def _bundle_lookup(k: str) -> bytes | None:
    root = os.environ.get("VKDSL_SPIRV_BUNDLE")
    if not root:
        return None
    if root not in _bundle_cache:
        try:
            with open(os.path.join(root, "index.json")) as f:
                _bundle_cache[root] = json.load(f)["kernels"]
        except (OSError, ValueError, KeyError) as e:
            raise NoCompiler(f"SPIR-V bundle {root}: cannot read index.json ({e})") from None
    entry = _bundle_cache[root].get(k)
    if entry is None:
        return None
    path = os.path.join(root, entry["file"])
    with open(path, "rb") as f:
        blob = f.read()
    if hashlib.sha256(blob).hexdigest() != entry["sha256"] or not cache.valid_spirv(blob):
        raise NoCompiler(f"SPIR-V bundle file {path} does not match its sha256 in index.json; rebuild the bundle")
    return blob


def compile_glsl(name: str, source: str, defines: dict | None = None) -> bytes:
    """SPIR-V for a GLSL source with defines: from memory, the bundle, the disk cache or the compiler."""
    mkey = (source, tuple(sorted((defines or {}).items())), os.environ.get("VKDSL_SPIRV_BUNDLE"))
    if mkey not in _memo:
        _memo[mkey] = _compile(name, source, defines)
    return _memo[mkey]


def _compile(name: str, source: str, defines: dict | None) -> bytes:
    src = expand(source, defines)
    skey = cache.key(src, "target=" + "vulkan1.2")
    compiled_this_process[skey] = (name, src)
    blob = _bundle_lookup(skey)
    if blob is not None:
        return blob
    be = backend()
    if be is None:
        where = os.environ.get("VKDSL_SPIRV_BUNDLE")
        raise NoCompiler(f"kernel '{name}' needs compiling, but no shader compiler is available (glslc, "
                         f"glslangValidator or libshaderc)" + (f" and bundle {where} does not hold it" if where
                                                                else "; set VKDSL_SPIRV_BUNDLE to a bundle"))
    k = cache.key(src, be.identity, "O=perf", "target=vulkan1.2")
    blob = cache.load(k)
    if blob is None:
        blob = be.compile(src, name)
        if not cache.valid_spirv(blob):
            raise CompileError(name, f"compiler returned {len(blob)} bytes that are not SPIR-V", src, be.identity)
        cache.store(k, blob)
    return blob


def write_bundle(root: str, entries: dict[str, tuple[str, str]]) -> int:
    """Compile each (name, expanded source) and write DIR/<key>.spv plus DIR/index.json."""
    os.makedirs(root, exist_ok=True)
    index = {}
    for skey, (name, src) in sorted(entries.items()):
        blob = compile_glsl(name, src)
        fname = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:60]}-{skey[:12]}.spv"
        cache.atomic_write(os.path.join(root, fname), blob)
        index[skey] = {"name": name, "file": fname, "sha256": hashlib.sha256(blob).hexdigest()}
    cache.atomic_write(os.path.join(root, "index.json"),
                       json.dumps({"format": 1, "kernels": index}, indent=1).encode())
    return len(index)
