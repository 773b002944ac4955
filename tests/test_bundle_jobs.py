"""Embedded and offline: `vkdsl compile --bundle DIR --for COMMAND` records every kernel a job uses
(the fused kernels tracing generates for its shapes included), and the job then runs from the
bundle on a machine with no shader compiler, with the same result bit for bit; a job the bundle
was not built for stops with one line naming the kernel and the command that adds it."""
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from fixtures.cli import run

# a campaign (pytest -m campaign, CI's step after the suite); the suite's bundle check is
# test_cli.py's test_bundle_runs_without_any_shader_compiler
pytestmark = pytest.mark.campaign

TRAIN = str(Path(sys.executable).parent / "vkdsl-train")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The default vkdsl-train job, shortened (one step of SFT, 8 held-out rows, 2 passages), and
    `vkdsl generate` on the default model, recorded into one bundle."""
    from vkdsl.train.config import DATA
    tmp = tmp_path_factory.mktemp("bundle-job")
    held, pres = tmp / "held8.jsonl", tmp / "pres2.jsonl"
    held.write_text("".join((DATA / "routing_heldout.jsonl").read_text().splitlines(True)[:8]))
    pres.write_text("".join((DATA / "preservation.jsonl").read_text().splitlines(True)[:2]))
    train = ["vkdsl-train", "--steps", "1", "--warmup", "0", "--objective", "sft", "--heldout-file", str(held),
             "--preservation-file", str(pres), "--format-examples", "0", "--stability-rows", "0", "--no-verify",
             "--quiet"]
    gen = ["vkdsl", "generate", "--prompt", "The capital of France is", "--max-new-tokens", "4"]
    bundle = tmp / "bundle"
    import shlex
    out = run(["compile", "--bundle", str(bundle), "--for", shlex.join(train + ["--out", str(tmp / "with")]),
               "--for", shlex.join(gen)], timeout=900).stdout
    assert "recorded" in out, out
    return tmp, bundle, train, gen, out


def _offline(tmp, bundle):
    """No compiler anywhere: none forced, none on PATH, an empty SPIR-V cache."""
    return dict(os.environ, VKDSL_COMPILER="none", VKDSL_SPIRV_BUNDLE=str(bundle), VKDSL_SPIRV_SHIPPED="0",
                VKDSL_CACHE_DIR=str(tmp / "empty-cache"), PATH=os.path.dirname(sys.executable))


def test_the_bundle_names_what_it_was_built_for(job):
    tmp, bundle, train, gen, recorded = job
    index = json.loads((bundle / "index.json").read_text())
    built = index["built"]
    assert built["vkdsl"] and "llvmpipe" in built["device"] and len(built["jobs"]) == 2
    for entry in index["kernels"].values():                 # every file named is there and whole
        assert (bundle / entry["file"]).stat().st_size > 20
    names = {e["name"] for e in index["kernels"].values()}
    assert any(n.startswith("reduce_") for n in names)        # shape-specialized kernels tracing generated


def test_a_recorded_training_job_runs_from_the_bundle_identically(job):
    tmp, bundle, train, gen, recorded = job
    import subprocess
    p = subprocess.run([TRAIN, *train[1:], "--out", str(tmp / "without")], capture_output=True, text=True,
                       env=_offline(tmp, bundle), timeout=600)
    assert p.returncode in (0, 3), p.stderr[-3000:]        # 3: a gate of the one-step run failed, not the run
    a, b = np.load(tmp / "with" / "adapter.npz"), np.load(tmp / "without" / "adapter.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        assert np.array_equal(a[k], b[k]), k                # the same SPIR-V on the same device: bit for bit
    assert (tmp / "without" / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp / "empty-cache").exists() or not any((tmp / "empty-cache").iterdir())


def test_generate_and_verify_run_from_the_bundle(job):
    tmp, bundle, train, gen, recorded = job
    offline = run(gen[1:], env=_offline(tmp, bundle)).stdout
    assert offline.strip() and offline in recorded         # the text the recorded run printed
    p = run(["verify"], env=_offline(tmp, bundle))
    assert " FAIL" not in p.stdout and "pass" in p.stdout.lower()


def test_a_job_the_bundle_was_not_built_for_is_one_line_naming_the_fix(job):
    tmp, bundle, train, gen, recorded = job
    import subprocess
    other = [TRAIN, *train[1:], "--batch-size", "3", "--out", str(tmp / "other")]
    p = subprocess.run(other, capture_output=True, text=True, env=_offline(tmp, bundle), timeout=600)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("vkdsl-train: error: kernel '") and f"is not in SPIR-V bundle {bundle}" in line, line
    assert f"vkdsl compile --bundle {bundle} --for 'vkdsl-train " in line and "--batch-size 3" in line, line


def test_a_malformed_for_is_refused_before_any_work(tmp_path):
    p = run(["compile", "--bundle", str(tmp_path / "b"), "--for", "python -c 1"], check=False)
    assert p.returncode != 0 and "expected a vkdsl or vkdsl-train command line" in p.stderr
    assert not (tmp_path / "b").exists()
