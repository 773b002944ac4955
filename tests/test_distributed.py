"""Data-parallel training over Open MPI (train.distributed), real mpirun, two processes sharing
lavapipe: the adapter equals the one a single process trains on the same global batches, only rank
0 writes the run folder, and a killed rank ends the job within seconds with the rank named."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fixtures.train_data import tiny_cfg, tiny_setup
from vkdsl.train import checkpoint
from vkdsl.train.trainer import run

TRAIN = str(Path(sys.executable).parent / "vkdsl-train")


def _mpirun(np_, args, **kw):
    exe = shutil.which("mpirun")
    if exe is None:
        pytest.fail("mpirun not found: ./setup.sh --test (or --mpi) installs Open MPI and mpi4py")
    env = {**os.environ, "LP_NUM_THREADS": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    return subprocess.Popen([exe, "--allow-run-as-root", "--oversubscribe", "-np", str(np_), TRAIN, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


def _toml(path, cfg, **over):
    keys = ("model", "train_file", "heldout_file", "preservation_file", "labels", "max_len", "bucket", "rank",
            "alpha", "lr", "warmup", "steps", "batch_size", "grad_accum", "eval_every", "checkpoint_every",
            "eval_batch", "tmkl", "objective", "verify", "seed", "data_seed")
    vals = {k: getattr(cfg, k) for k in keys} | over

    def lit(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(lit(x) for x in v) + "]"
        return repr(v)
    path.write_text("".join(f"{k} = {lit(v)}\n" for k, v in vals.items()))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    return tmp, tiny_setup(tmp)


def test_two_ranks_train_the_single_process_adapter(setup):
    tmp, s = setup
    # one process: 2 micro-batches of 1 row per step; two ranks: 1 row each, the same 2 rows a step
    one = tiny_cfg(s, batch_size=1, grad_accum=2, steps=4, objective="sft", out=str(tmp / "one"), eval_batch=2)
    single = run(one, one.out)
    p = _mpirun(2, ["--config", _toml(tmp / "two.toml", one, grad_accum=1), "--out", str(tmp / "two")])
    out, err = p.communicate(timeout=600)
    assert p.returncode in (0, 2), err[-3000:]           # 2: a gate of the tiny run failed, not the run
    assert "2 processes over MPI" in err and "rank 1: [" in err, err[-3000:]
    a, b = np.load(tmp / "one" / "adapter.npz"), np.load(tmp / "two" / "adapter.npz")
    assert sorted(a.files) == sorted(b.files)
    worst = max(float(np.max(np.abs(a[k] - b[k])) / max(float(np.max(np.abs(a[k]))), 1e-30)) for k in a.files)
    print(f"two ranks vs one process: max relative difference {worst:.3e}")
    assert worst <= 1e-5, f"max relative difference {worst:.3e}"
    assert float(np.max(np.abs(a[a.files[1]]))) > 0           # trained: B moved off zero
    # the same objective each step (AdamW and clipping would hide a gradient counted twice; the loss does not)
    steps = {d: [e for e in map(json.loads, (tmp / d / "metrics.jsonl").read_text().splitlines())
                 if e.get("event") == "step"] for d in ("one", "two")}
    assert len(steps["one"]) == len(steps["two"]) == 4
    for a_, b_ in zip(steps["one"], steps["two"]):
        assert b_["loss"] == pytest.approx(a_["loss"], rel=1e-6) and b_["grad_norm"] == pytest.approx(a_["grad_norm"],
                                                                                                     rel=1e-5)
    # evaluation is shared out by batches (2 rows each here) and gathered: the same evidence
    evs = [json.loads(x) for x in (tmp / "two" / "metrics.jsonl").read_text().splitlines()]
    final = [e for e in evs if e.get("event") == "eval"][-1]
    for k in ("heldout_loss", "heldout_acc", "preservation_loss", "format_valid"):
        assert final[k] == pytest.approx(single.final[k], rel=1e-5, abs=1e-7), k
    m = json.loads((tmp / "two" / "adapter" / "vkdsl_manifest.json").read_text())
    assert m["processes"]["ranks"] == 2 and len(m["processes"]["devices"]) == 2


def test_a_killed_rank_ends_the_job_naming_it(setup):
    tmp, s = setup
    cfg = tiny_cfg(s, batch_size=1, steps=100000, objective="sft", checkpoint_every=2)
    p = _mpirun(2, ["--config", _toml(tmp / "long.toml", cfg), "--out", str(tmp / "long")])
    metrics = tmp / "long" / "metrics.jsonl"
    t0 = time.time()
    while not (metrics.is_file() and metrics.read_text().count('"step"') >= 3):
        assert p.poll() is None and time.time() - t0 < 300, "the job did not start training"
        time.sleep(0.2)
    victim = _rank_pid(p.pid, 1)
    os.kill(victim, signal.SIGKILL)
    t_kill = time.time()
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("the job still ran 60 s after rank 1 was killed")
    assert p.returncode != 0
    assert time.time() - t_kill < 60
    assert "rank 1" in err, err[-3000:]
    saved = checkpoint.saved_step(tmp / "long")              # rank 0's last checkpoint is whole
    assert saved is not None and saved >= 2 and saved % 2 == 0


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of the process mpirun started as `rank` (its OMPI_COMM_WORLD_RANK)."""
    stat = ""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env and b"OMPI_COMM_WORLD_SIZE=2" in env \
                and "vkdsl-train" in " ".join((d / "cmdline").read_text().split("\0")):
            return int(d.name)
    raise AssertionError(f"no process of rank {rank} under mpirun {launcher} ({stat[:40]})")
