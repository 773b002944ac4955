"""Under the Khronos validation layer with synchronization validation (VKDSL_VALIDATION=sync):
a planted hazard is reported (so the layer and sync validation are really on), and `vkdsl verify`
plus a short training run with a DPO step produce no validation message at all."""
import json
import os
import subprocess
import sys

import pytest

from fixtures.train_data import tiny_setup

MESSAGES = ("VUID-", "SYNC-HAZARD", "Validation Error", "Validation Warning", "UNASSIGNED-")
CANARY = """
from vkdsl.runtime import Buffer, Recording, open_device
dev = open_device()
a, b = Buffer(dev, 256), Buffer(dev, 256)
Recording._hazard = lambda self, reads, writes: None       # barriers off: copy b <- a, then a <- b
rec = Recording(dev, 2)
rec.copy(a, b, 256)
rec.copy(b, a, 256)
rec.submit_wait()
"""


def run(args, **kw):
    env = {**os.environ, "VKDSL_VALIDATION": "sync"}
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600, **kw)
    return p, p.stdout + p.stderr


def messages(text):
    return [line for line in text.splitlines() if any(m in line for m in MESSAGES)]


def test_the_layer_and_synchronization_validation_are_on():
    p, out = run(["-c", CANARY])
    assert p.returncode == 0, out
    assert any("SYNC-HAZARD-READ-AFTER-WRITE" in line for line in messages(out)), \
        "the planted hazard was not reported: validation is not really enabled\n" + out[-2000:]


def test_verify_is_clean():
    p, out = run(["-m", "vkdsl.cli", "verify"])
    assert p.returncode == 0 and "rows passed" in out, out[-2000:]
    assert messages(out) == []


def test_training_and_a_dpo_step_are_clean(tmp_path):
    tm, tr, he, pr = tiny_setup(tmp_path / "data")
    rows = [json.loads(x) for x in open(tr)]
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": r["prompt"], "chosen": r["completion"],
                                         "rejected": "low" if r["completion"] != "low" else "high"}) + "\n"
                             for r in rows))
    p, out = run(["-m", "vkdsl.cli", "train", "--model", str(tm.gguf_path), "--train-file", tr,
                  "--heldout-file", he, "--preservation-file", pr, "--labels", "low,medium,high",
                  "--max-len", "64", "--bucket", "16", "--rank", "4", "--steps", "2", "--warmup", "1",
                  "--tmkl", "0.1", "--no-verify", "--quiet", "--out", str(tmp_path / "run"),
                  "--dpo-train-file", str(prefs), "--dpo-heldout-file", str(prefs), "--dpo-steps", "1"])
    assert p.returncode in (0, 3), out[-2000:]                  # 3: a gate failed, the run completed
    assert (tmp_path / "run" / "adapter.gguf").is_file()
    assert messages(out) == []


@pytest.mark.parametrize("value", ["yes"])
def test_an_unknown_validation_mode_is_an_error(value):
    p = subprocess.run([sys.executable, "-m", "vkdsl.cli", "devices"], capture_output=True, text=True,
                       env={**os.environ, "VKDSL_VALIDATION": value}, timeout=120)
    assert p.returncode == 1 and "VKDSL_VALIDATION='yes': expected 0, 1 or sync" in p.stderr
