"""GLSL -> SPIR-V: backends, errors with numbered source, the disk cache, bundles."""

import gzip
import json
import shutil

import pytest

from vkdsl import compiler
from vkdsl.compiler import bundle as B
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


def test_prefetch_compiles_a_programs_kernels_at_once(fresh_cache):
    # distinct kernels compiled on all cores: each the compiler's own bytes, then served from memory
    srcs = [OK.replace("1.0", f"{i}.5") for i in range(6)]
    compiler.prefetch([(f"k{i}", s, None) for i, s in enumerate(srcs)])
    assert len(list(fresh_cache.glob("*.spv"))) == 6
    for entry in fresh_cache.glob("*.spv"):
        entry.unlink()
    for i, s in enumerate(srcs):
        assert compiler.compile_glsl(f"k{i}", s) == compiler.backend().compile(s, f"k{i}")
    assert list(fresh_cache.glob("*.spv")) == []


# =======================================================================================
# the SPIR-V shipped with the package (vkdsl/spirv)
# =======================================================================================

def _from_compiler(name, src):
    return compiler.backend().compile(src, name)


def test_shipped_spirv_is_what_this_compiler_makes_of_its_sources():
    # every 40th kernel (the suite's share); `pytest -m campaign` recompiles all of them
    built = B.read_index(compiler.SHIPPED)["built"]
    assert built.get("compiler") == compiler.backend().identity, (
        f"vkdsl/spirv was built by {built.get('compiler')!r}, this machine compiles with "
        f"{compiler.backend().identity!r}: rebuild it as README's 'Shipped SPIR-V' says")
    keys = sorted(B.read_index(compiler.SHIPPED)["kernels"])[::40]
    assert len(keys) >= 10 and B.check(compiler.SHIPPED, _from_compiler, keys) == []


@pytest.mark.campaign
def test_every_shipped_kernel_is_what_this_compiler_makes():
    assert B.check(compiler.SHIPPED, _from_compiler) == []


def test_a_swapped_shipped_kernel_is_found(tmp_path):
    # the defect a stale or hand-edited bundle would carry: a valid .spv under another kernel's key
    root = tmp_path / "spirv"
    shutil.copytree(compiler.SHIPPED, root)
    index = json.loads((root / "index.json").read_text())
    a, b = sorted(index["kernels"])[:2]
    ea, eb = index["kernels"][a], index["kernels"][b]
    (root / ea["file"]).write_bytes((root / eb["file"]).read_bytes())
    ea["sha256"] = eb["sha256"]
    (root / "index.json").write_text(json.dumps(index))
    assert B.check(str(root), _from_compiler, [a, b]) == [
        f"{ea['file']}: differs from what the compiler makes of {ea['source']}"]


def test_builtin_kernels_need_no_compiler(fresh_cache, monkeypatch):
    # a fresh install: empty cache, no user bundle; every hand-written variant comes from vkdsl/spirv
    from vkdsl import handwritten, ops  # noqa: F401  (ops registers its kernel families)
    from vkdsl.runtime.context import default_device
    monkeypatch.delenv("VKDSL_SPIRV_BUNDLE", raising=False)
    before = dict(compiler.origin)
    handwritten.builtin_variants(default_device())
    stale = compiler.origin["compiler"] - before["compiler"] + compiler.origin["cache"] - before["cache"]
    assert stale == 0, (f"{stale} hand-written kernel variants are not in vkdsl/spirv (a kernel source changed?): "
                        f"rebuild it as README's 'Shipped SPIR-V' says")
    assert compiler.origin["shipped"] > before["shipped"]


def test_planners_pick_what_their_family_registers(dev):
    # a bundle holds each family's enumeration; a planner choosing outside it would compile on a
    # fresh install. At the default tile (a tuned tile is recorded by the job that uses it).
    from vkdsl import handwritten
    from vkdsl.matmul import plan_matmul
    from vkdsl.ops import quant as Q
    names = {v.name for family in handwritten.FAMILIES.values() for v in family(dev)}
    assert {"matmul", "quantized weights", "attention", "delta rule"} <= set(handwritten.FAMILIES)
    tile = handwritten.DEFAULT_TILE
    picked = [plan_matmul(dev, M=m, N=n, K=k, ta=ta, tb=tb, tile=tile).name
              for m, n, k in ((64, 96, 128), (5, 7, 3), (256, 576, 1536))
              for ta, tb in ((False, False), (False, True), (True, False))]
    picked += [Q.plan_qmatmul(dev, f, M=m, N=576, K=1536, form=form, tile=tile).name
               for f in ("q4_1", "q8_0", "q6_k") for form in ("nt", "nn") for m in (1, 64)]
    assert set(picked) <= names, sorted(set(picked) - names)


def test_damaged_shipped_spirv_is_ignored_in_one_line(fresh_cache, tmp_path, monkeypatch, capsys):
    root = tmp_path / "spirv"
    shutil.copytree(compiler.SHIPPED, root)
    monkeypatch.setattr(compiler, "SHIPPED", str(root))
    monkeypatch.setattr(compiler, "_shipped_ok", True)
    monkeypatch.delenv("VKDSL_SPIRV_BUNDLE", raising=False)
    entry = next(iter(B.read_index(str(root))["kernels"].values()))
    src = gzip.decompress((root / entry["source"]).read_bytes()).decode()
    spv = bytearray((root / entry["file"]).read_bytes())
    spv[40] ^= 0xFF
    (root / entry["file"]).write_bytes(bytes(spv))
    assert compiler.compile_glsl(entry["name"], src) == _from_compiler(entry["name"], src)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ignoring the shipped SPIR-V" in err[0] and entry["file"] in err[0]
