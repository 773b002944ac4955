"""GLSL -> SPIR-V: backends, errors with numbered source, the disk cache, bundles."""

import pytest

from vkdsl import compiler
from vkdsl.compiler import cache
from vkdsl.compiler.backends import find_backend
from vkdsl.compiler.errors import CompileError

OK = """#version 450
layout(local_size_x_id = 0, local_size_y_id = 1, local_size_z_id = 2) in;
layout(std430, binding = 0) buffer B { float x[]; };
void main() { x[gl_GlobalInvocationID.x] += 1.0; }
"""


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VKDSL_CACHE_DIR", str(tmp_path / "cache"))
    compiler.forget_compiled()
    yield tmp_path / "cache"
    compiler.forget_compiled()


def test_compile_is_memoized_in_memory(fresh_cache):
    # a second request for the same source and defines reads neither the disk cache nor the compiler
    blob = compiler.compile_glsl("ok", OK)
    for entry in fresh_cache.glob("*.spv"):
        entry.unlink()
    assert compiler.compile_glsl("ok", OK) == blob
    assert list(fresh_cache.glob("*.spv")) == []


def test_compile_produces_spirv(fresh_cache):
    blob = compiler.compile_glsl("ok", OK)
    assert cache.valid_spirv(blob)
    assert len(list(fresh_cache.glob("*.spv"))) == 1


def test_compile_error_shows_message_and_numbered_lines(fresh_cache):
    bad = OK.replace("+= 1.0;", "+= 1.0 +;")
    with pytest.raises(CompileError) as e:
        compiler.compile_glsl("bad", bad)
    msg = str(e.value)
    assert "bad" in msg and "syntax error" in msg
    assert ">>    4 | void main()" in msg          # the offending line, numbered and marked


def test_no_temp_files_in_working_directory(fresh_cache, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    compiler.compile_glsl("ok2", OK.replace("1.0", "2.0"))
    with pytest.raises(CompileError):
        compiler.compile_glsl("bad2", OK.replace("1.0;", ";;;("))
    assert list(work.iterdir()) == []


def test_corrupted_cache_entry_is_rebuilt(fresh_cache, capsys):
    blob = compiler.compile_glsl("ok", OK)
    (entry,) = fresh_cache.glob("*.spv")
    data = bytearray(entry.read_bytes())
    data[60] ^= 0xFF                               # flip a byte inside the SPIR-V
    entry.write_bytes(bytes(data))
    compiler.forget_compiled()                     # as a new process would: from the disk cache
    again = compiler.compile_glsl("ok", OK)
    assert again == blob
    assert "corrupted" in capsys.readouterr().err
    assert entry.read_bytes() != bytes(data)       # rewritten with a good entry


def test_cache_key_depends_on_source_and_defines(fresh_cache):
    compiler.compile_glsl("ok", OK)
    compiler.compile_glsl("ok", OK, defines={"FOO": 1})
    assert len(list(fresh_cache.glob("*.spv"))) == 2


def test_includes_are_expanded(tmp_path):
    # nested includes from a folder of the test's own (never the source tree), each inlined once
    (tmp_path / "outer.glsl").write_text('// outer\n#include "inner.glsl"\n')
    (tmp_path / "inner.glsl").write_text("// inner\n")
    src = '#version 450\n#include "outer.glsl"\n#include "inner.glsl"\n'
    out = compiler.expand(src, {"X": 3}, include_dir=str(tmp_path))
    assert out.split("\n")[:4] == ["#version 450", "#define X 3", "// outer", "// inner"]
    assert out.count("// inner") == 1


def test_backend_found():
    be = find_backend()
    assert be is not None and be.identity
