"""The vkdsl command as a user runs it: devices, verify, bench, compile --bundle and running
from a bundle on a machine with no shader compiler."""
import json
import os
import re
import sys


from fixtures.cli import run


def test_devices_json_lists_limits():
    rows = [json.loads(l) for l in run(["devices", "--json"]).stdout.splitlines()]
    assert rows and sum(r["default"] for r in rows) == 1
    for r in rows:
        assert r["max_storage_buffer_range"] > 0 and r["subgroup_size"] >= 1 and r["heaps"]


def test_missing_device_is_an_error_listing_devices():
    p = run(["verify", "--device", "no-such-gpu"], check=False)
    assert p.returncode != 0 and "devices present" in p.stderr


def test_verify_json_rows_pass():
    out = run(["verify", "--json", "--no-warm", "--match", "["]).stdout.splitlines()

    def strict(c):
        raise AssertionError(f"verify --json wrote {c}, which JSON has no literal for")
    rows = [json.loads(line, parse_constant=strict) for line in out]
    summary = rows.pop()
    assert summary["summary"] and summary["failed"] == 0 and summary["rows"] == len(rows) > 200
    ops = {r["op"] for r in rows}
    for op in ["add", "exp", "sum", "matmul", "gather", "softmax", "cross_entropy", "attention", "tmkl", "dpo"]:
        assert op in ops
    for r in rows:
        assert r["passed"] and r["reason"]
        # the GPU-block rows are the only ones lavapipe (the lvp family) leaves out, and never pass silently
        assert r["error"] <= r["limit"] if r["applicable"] else (r["op"] == "matmul_block" and r["error"] is None)
    assert summary["not_applicable"] == sum(r["op"] == "matmul_block" for r in rows) == 9


def test_verify_fails_on_a_corrupted_golden(tmp_path):
    """`vkdsl verify` on a golden copy with one flipped bit: a non-zero exit naming the file, never a pass."""
    from vkdsl_golden import store
    dst = tmp_path / "v1"
    dst.mkdir()
    for f in store.data_dir(1).iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    victim = next(dst.glob("exp_*.npz"))
    data = bytearray(victim.read_bytes())
    data[-20] ^= 1
    victim.write_bytes(bytes(data))
    p = run(["verify", "--golden", str(tmp_path), "--match", "exp["], check=False)
    assert p.returncode != 0
    assert victim.name in p.stderr and "sha256 mismatch" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    # the untouched copy of the same cases passes
    assert run(["verify", "--golden", str(tmp_path), "--match", "log["]).returncode == 0


def test_bench_replay_json():
    r = json.loads(run(["bench", "replay", "--json"]).stdout)
    assert r["dispatches"] == 1000 and r["max_abs_error"] < 1e-4 and r["ratio"] > 0


def test_bench_matmul_json_small():
    rows = [json.loads(l) for l in run(["bench", "matmul", "--json", "--sizes", "64,128"]).stdout.splitlines()]
    assert [r["size"] for r in rows] == [64, 128]
    assert all(r["device_gflops"] > 0 and r["numpy_gflops"] > 0 for r in rows)


def test_bundle_runs_without_any_shader_compiler(tmp_path):
    bundle = tmp_path / "bundle"
    out = run(["compile", "--bundle", str(bundle)]).stdout
    assert "wrote" in out and (bundle / "index.json").is_file()
    env = dict(os.environ, VKDSL_COMPILER="none", VKDSL_SPIRV_BUNDLE=str(bundle), VKDSL_SPIRV_SHIPPED="0",
               VKDSL_CACHE_DIR=str(tmp_path / "empty-cache"),
               PATH=os.path.dirname(sys.executable))          # no glslc / glslangValidator on PATH
    p = run(["verify", "--match", "matmul"], env=env)
    assert "FAIL" not in p.stdout
    run(["demo"], env=env)
    assert not (tmp_path / "empty-cache").exists() or not any((tmp_path / "empty-cache").iterdir())
    # and without the bundle the same machine cannot build kernels: a clear error, not a crash
    env.pop("VKDSL_SPIRV_BUNDLE")
    p = run(["demo"], env=env, check=False)
    assert p.returncode != 0 and "no shader compiler is available" in p.stderr


def test_a_fresh_install_verifies_with_the_shipped_spirv_alone(tmp_path):
    # no compiler, no bundle, an empty cache: the kernels verify and demo use ship with the package
    env = dict(os.environ, VKDSL_COMPILER="none", VKDSL_CACHE_DIR=str(tmp_path / "empty-cache"),
               PATH=os.path.dirname(sys.executable))
    env.pop("VKDSL_SPIRV_BUNDLE", None)
    p = run(["verify", "--match", "softmax"], env=env)
    assert re.search(r"\b(\d+)/\1 rows passed", p.stdout) and "FAIL" not in p.stdout
    run(["demo"], env=env)
