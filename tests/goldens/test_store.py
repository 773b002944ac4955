"""The stored golden data and manifest, the loader's error paths, the generator's determinism."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vkdsl_golden import generate as G
from vkdsl_golden.dispatch import BACKWARD_OPS, OPS, evaluate
from vkdsl_golden.store import (GoldenError, check_all, iter_cases, load_case, load_manifest,
                                sha256_file)

from golden_common import (GOLDEN_DIR, PHASE1_OPS, PHASE2_OPS, V1, _case, cases, f64)





# =======================================================================================
# stored data and manifest
# =======================================================================================

def test_stored_files_match_manifest():
    man = load_manifest()
    assert man["version"] == 1 and man["generator"] == "golden/generate.py"
    assert check_all() == len(man["cases"]) > 150
    on_disk = {p.name for p in V1.glob("*.npz")}
    assert on_disk == {c["file"] for c in man["cases"]}, "stray or missing npz files"
    for c in man["cases"]:
        assert sha256_file(V1 / c["file"]) == c["sha256"]
        assert c["file"] == G.file_name(c["name"])


def test_case_contents_and_dtypes():
    for c in iter_cases():
        a = load_case(c)
        for k in c["inputs"]:
            assert a[k].dtype in (np.float32, np.int32, np.uint8), (c["name"], k, a[k].dtype)
        assert a["out"].dtype == np.float64, c["name"]
        grads = [k for k in c["outputs"] if k.startswith("grad_")]
        if c["op"] in BACKWARD_OPS:
            assert c["upstream"] == "gout" and a["gout"].shape == a["out"].shape
            assert a["gout"].dtype == np.float32 and grads
            for k in grads:
                src = "in" + k[len("grad_in"):]
                assert a[k].shape == a[src].shape and a[k].dtype == np.float64
        else:
            assert c["upstream"] is None and not grads


def test_every_op_has_cases_and_phase1_sizes():
    by_op = {}
    for c in iter_cases():
        by_op.setdefault(c["op"], []).append(c)
    assert set(by_op) == PHASE1_OPS | PHASE2_OPS
    for op in PHASE1_OPS:
        dims = set()
        for c in by_op[op]:
            for a in (v for k, v in load_case(c).items() if k.startswith("in")):
                dims.update(a.shape)
        assert {1, 3, 7, 33, 1023} <= dims, (op, sorted(dims))


def test_names_encode_op_and_shapes():
    for c in iter_cases():
        assert re.fullmatch(re.escape(c["op"]) + r"\[[^\]]+\]", c["name"]), c["name"]
    names = {c["name"] for c in cases()}
    for want in ["add[33x1023+1023]", "sum[33x1023,axis=1]", "matmul[tn,33x1023x7]",
                 "add[33x1+33x1023]", "add[0d+1023]", "add[3x1x7+1x33x7]",
                 "matmul[nn,batch=3,33x7x5]", "softmax[1x49152]", "log_softmax[7x33,-inf]"]:
        assert want in names


# =======================================================================================
# loader error paths: every GoldenError names the file, what was expected and found
# =======================================================================================

@pytest.fixture
def data_copy(tmp_path):
    """A writable copy of the v1 data; returns the root to pass to the loader."""
    shutil.copytree(V1, tmp_path / "v1")
    return tmp_path


def test_corrupted_file_raises_naming_it(data_copy):
    c = _case(data_copy, "add[7x33+7x33]")
    path = Path(c["path"])
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01                        # one flipped bit inside the array data
    path.write_bytes(bytes(raw))
    with pytest.raises(GoldenError) as e:
        load_case(c)
    msg = str(e.value)
    assert c["file"] in msg and c["sha256"] in msg and hashlib.sha256(raw).hexdigest() in msg
    assert "expected" in msg and "found" in msg
    # the packaged original is untouched and still loads
    assert load_case(_case(None, "add[7x33+7x33]"))["in0"].shape == (7, 33)


def test_missing_file_raises_naming_it(data_copy):
    c = _case(data_copy, "sum[7,axis=0]")
    Path(c["path"]).unlink()
    with pytest.raises(GoldenError, match=re.escape(c["file"]) + ".*missing"):
        load_case(c)


def test_root_argument_without_path_key(data_copy):
    c = _case(data_copy, "neg[3]")
    bare = {k: v for k, v in c.items() if k != "path"}
    assert np.array_equal(load_case(bare, root=data_copy)["out"], -load_case(c)["in0"].astype(f64))
    (data_copy / "v1" / c["file"]).write_bytes(b"not an npz")
    with pytest.raises(GoldenError, match=re.escape(c["file"])):
        load_case(bare, root=data_copy)


def _rewrite_manifest(root, fn):
    path = root / "v1" / "manifest.json"
    man = json.loads(path.read_text())
    fn(man)
    path.write_text(json.dumps(man))
    return path


@pytest.mark.parametrize("mutate, pattern", [
    (lambda m: m["cases"][0].pop("sha256"), r"expected key 'sha256'"),
    (lambda m: m["cases"][0].update(sha256="abc"), r"expected a 64-hex-digit sha256, found 'abc'"),
    (lambda m: m["cases"][0].update(file="../evil.npz"), r"expected a plain \.npz file name"),
    (lambda m: m.update(version=2), r"expected version 1, found 2"),
    (lambda m: m["cases"].append(dict(m["cases"][0])), r"expected unique names"),
    (lambda m: m["cases"][0].update(params=[1]), r"expected 'params' of type"),
    (lambda m: m.pop("cases"), r"expected an object with a 'cases' list"),
])
def test_malformed_manifest_raises_naming_it(data_copy, mutate, pattern):
    path = _rewrite_manifest(data_copy, mutate)
    with pytest.raises(GoldenError, match=pattern) as e:
        load_manifest(root=data_copy)
    assert str(path) in str(e.value)


def test_manifest_not_json_or_missing(data_copy, tmp_path):
    path = data_copy / "v1" / "manifest.json"
    path.write_text("{not json")
    with pytest.raises(GoldenError, match=re.escape(str(path)) + ".*expected JSON"):
        load_manifest(root=data_copy)
    with pytest.raises(GoldenError, match="manifest.json: missing file"):
        load_manifest(root=tmp_path / "nowhere")


def test_wrong_arrays_in_file_raise(data_copy):
    c = _case(data_copy, "neg[3]")
    path = Path(c["path"])
    data = G.npz_bytes({"in0": np.zeros(3, np.float32)})           # no "out"
    path.write_bytes(data)
    c = {**c, "sha256": hashlib.sha256(data).hexdigest()}
    with pytest.raises(GoldenError, match=re.escape(c["file"]) + r".*expected arrays \['in0', 'out'\], found \['in0'\]"):
        load_case(c)


# =======================================================================================
# generator determinism, both entry points
# =======================================================================================

def _shas(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# The two long-context attention cases take ~55 s of the generator's ~60 s (T x T float64 sums in
# a fixed order): the suite regenerates every other case, the campaign (CI's next step) all of them.
LONG = ("attention[4096x", "attention[2048x")


def test_generator_is_deterministic_and_matches_stored(tmp_path):
    """The generator, in a fresh process, writes every case but the long ones byte for byte as the
    stored files (written by earlier runs: the same bytes across runs and processes, so
    deterministic), and their manifest entries (names, shapes, sha256) as stored."""
    code = ("import sys; from vkdsl_golden.generate import generate; "
            f"generate(sys.argv[1], skip={LONG!r})")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], check=True, capture_output=True,
                   cwd=tmp_path)
    cases = load_manifest()["cases"]
    kept = [c for c in cases if not any(x in c["name"] for x in LONG)]
    assert len(kept) == len(cases) - len(LONG)
    assert load_manifest(root=tmp_path / "b")["cases"] == kept
    b, stored = _shas(tmp_path / "b" / "v1"), _shas(V1)
    want = {c["file"]: stored[c["file"]] for c in kept}
    del b["manifest.json"]
    diff = sorted(k for k in set(want) | set(b) if want.get(k) != b.get(k))
    assert not diff, ("regenerated files differ from golden/data/v1 (stale data? or a platform "
                      f"whose libm differs in the last float64 bit): {diff[:10]}")


@pytest.mark.campaign
def test_the_generator_script_writes_every_case_as_stored(tmp_path):
    """The generator script, every case included (the long attention ones too), byte for byte."""
    subprocess.run([sys.executable, str(GOLDEN_DIR / "generate.py"), "--root", str(tmp_path / "b")],
                   check=True, capture_output=True, cwd=tmp_path)
    b, stored = _shas(tmp_path / "b" / "v1"), _shas(V1)
    diff = sorted(k for k in stored if stored[k] != b.get(k)) + sorted(set(b) - set(stored))
    assert not diff, ("regenerated files differ from golden/data/v1 (stale data? or a platform "
                      f"whose libm differs in the last float64 bit): {diff[:10]}")


def test_module_entry_point_check_mode(tmp_path):
    r = subprocess.run([sys.executable, "-m", "vkdsl_golden.generate", "--check", "--match", "softmax["],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "up to date" in r.stdout, r.stdout + r.stderr
    # a stored entry that differs from what the generator makes now is found and named
    (tmp_path / "v1").mkdir()
    man = json.loads((V1 / "manifest.json").read_text())
    hit = next(c for c in man["cases"] if c["name"].startswith("softmax["))
    hit["sha256"] = "0" * 64
    (tmp_path / "v1" / "manifest.json").write_text(json.dumps(man))
    r = subprocess.run([sys.executable, "-m", "vkdsl_golden.generate", "--check", "--match", "softmax[",
                        "--root", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 1 and f"golden data differs: ['{hit['name']}']" in r.stdout, r.stdout + r.stderr


def test_golden_never_imports_vkdsl_core():
    import ast
    for py in GOLDEN_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.Import):
                assert not any(n.name.split(".")[0] == "vkdsl" for n in node.names), py.name
            elif isinstance(node, ast.ImportFrom):
                # absolute vkdsl imports, or relative ones climbing out of golden/, are banned
                assert node.level <= 1 and (node.level or not (node.module or "").startswith("vkdsl")), \
                    (py.name, node.module, node.level)
    # in a fresh interpreter, importing the package and its generator loads neither the Vulkan
    # binding nor any vkdsl module
    code = ("import sys, vkdsl_golden, vkdsl_golden.generate, vkdsl_golden.store, vkdsl_golden.llama_ref; "
            "bad = [m for m in sys.modules if m in ('vulkan', 'vkdsl', 'cffi') or m.startswith('vkdsl.')]; "
            "print(bad); assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_every_op_recomputes_from_stored_inputs():
    """The dispatcher the device side calls reproduces stored outputs bit for bit from the stored inputs:
    each op's first case (every case's bytes are the generator's: test_generator_is_deterministic...)."""
    seen = set()
    for c in iter_cases():
        if c["op"] in seen:
            continue
        seen.add(c["op"])
        a = load_case(c)
        res = evaluate(c["op"], [a[k] for k in c["inputs"]], c["params"], a.get("gout"))
        assert list(res) == c["outputs"], c["name"]
        for k, v in res.items():
            assert np.array_equal(v, a[k], equal_nan=True), (c["name"], k)
    assert seen == set(OPS) == PHASE1_OPS | PHASE2_OPS
