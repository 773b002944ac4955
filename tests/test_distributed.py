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

from fixtures.train_data import tiny_cfg, tiny_setup, write_jsonl
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


@pytest.fixture(scope="module")
def killed(setup):
    """A two-rank run with rank 1 SIGKILLed after its third step: (folder, mpirun's exit status,
    its stderr, seconds from the kill to the job's end)."""
    tmp, s = setup
    cfg = tiny_cfg(s, batch_size=1, steps=100000, objective="sft", checkpoint_every=2)
    p = _mpirun(2, ["--config", _toml(tmp / "long.toml", cfg), "--out", str(tmp / "long")])
    metrics = tmp / "long" / "metrics.jsonl"
    t0 = time.time()
    while not (metrics.is_file() and metrics.read_text().count('"step"') >= 3):
        assert p.poll() is None and time.time() - t0 < 300, "the job did not start training"
        time.sleep(0.2)
    os.kill(_rank_pid(p.pid, 1), signal.SIGKILL)
    t_kill = time.time()
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("the job still ran 60 s after rank 1 was killed")
    return tmp / "long", p.returncode, err, time.time() - t_kill


def test_a_killed_rank_ends_the_job_naming_it(killed):
    folder, code, err, seconds = killed
    assert code != 0 and seconds < 60
    assert "rank 1" in err, err[-3000:]
    saved = checkpoint.saved_step(folder)                    # rank 0's last checkpoint is whole
    assert saved is not None and saved >= 2 and saved % 2 == 0


def test_two_ranks_resume_the_killed_run_as_one_process_would(killed, tmp_path):
    """Both ranks resume from rank 0's checkpoint (and its cached base evaluation, which only rank
    0 can see: it is broadcast, or the ranks would part ways in their collectives)."""
    folder, *_ = killed
    saved = checkpoint.saved_step(folder)
    alone = tmp_path / "alone"
    shutil.copytree(folder, alone)
    over = {"steps": saved + 2}
    p = _mpirun(2, ["--resume", str(folder), "--steps", str(saved + 2)])
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("the resumed two-rank run did not finish in 120 s")
    assert p.returncode in (0, 2), err[-3000:]
    said = out + err
    assert "resumed from" in said and "base evaluation reused" in said, said[-3000:]
    from vkdsl.cli.train import settings
    cfg, _ = settings(None, str(alone), {**over, "grad_accum": 2})   # one process, the same global batch
    run(cfg, alone, resume=alone)
    a, b = np.load(alone / "adapter.npz"), np.load(folder / "adapter.npz")
    worst = max(float(np.max(np.abs(a[k] - b[k])) / max(float(np.max(np.abs(a[k]))), 1e-30)) for k in a.files)
    print(f"resumed: two ranks vs one process, max relative difference {worst:.3e}")
    assert worst <= 1e-5, f"max relative difference {worst:.3e}"


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


def _mpmd(*parts):
    """mpirun with one command line per rank (MPMD): parts = (env, args) per rank."""
    cmd = [shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe"]
    for i, (env, args) in enumerate(parts):
        cmd += ([":"] if i else []) + ["-np", "1"] + [x for k, v in env.items() for x in ("-x", f"{k}={v}")]
        cmd += [TRAIN, *args]
    env = {**os.environ, "LP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_an_error_on_one_rank_ends_the_job_naming_it(setup):
    """Rank 1 alone cannot open its device; rank 0 is already waiting for it in a collective."""
    tmp, s = setup
    args = ["--config", _toml(tmp / "err.toml", tiny_cfg(s, steps=2)), "--out", str(tmp / "err")]
    t0 = time.time()
    p = _mpmd(({}, args), ({"VKDSL_DEVICE": "99"}, args))
    assert p.returncode != 0 and time.time() - t0 < 60
    line = next((x for x in p.stderr.splitlines() if x.startswith("vkdsl-train: error")), None)
    assert line is not None and line.startswith("vkdsl-train: error on rank 1 of 2 (ending the job): device index 99"), \
        p.stderr[-3000:]


def test_ranks_given_other_settings_are_refused(setup):
    tmp, s = setup
    toml = _toml(tmp / "same.toml", tiny_cfg(s, steps=2))
    p = _mpmd(({}, ["--config", toml, "--out", str(tmp / "diff")]),
              ({}, ["--config", toml, "--out", str(tmp / "diff"), "--lr", "0.5"]))
    assert p.returncode != 0
    assert "rank(s) [1] were started with other settings than rank 0" in p.stderr, p.stderr[-3000:]


def test_two_ranks_train_dpo_as_one_process_with_their_global_batch(setup):
    """DPO: dpo_batch 1 on each of two ranks == dpo_batch 2 in one process (the reference log-probs
    and the evidence are scored in shards and gathered)."""
    tmp, s = setup
    prefs = [{"prompt": f"the dog {i} is", "chosen": " the fox" + " runs" * (i % 3),
              "rejected": " a capital" + " of France" * (i % 2)} for i in range(6)]
    train_p = write_jsonl(tmp / "prefs.jsonl", prefs[:4])
    held_p = write_jsonl(tmp / "prefs_held.jsonl", prefs[4:])
    cfg = tiny_cfg(s, objective="dpo")
    extra = dict(dpo_train_file=train_p, dpo_heldout_file=held_p, dpo_steps=3, dpo_lr=0.005)
    from vkdsl.cli.train import main
    code = main(["--config", _toml(tmp / "dpo1.toml", cfg, dpo_batch=2, **extra), "--out", str(tmp / "dpo1")])
    assert code in (0, 2)
    p = _mpirun(2, ["--config", _toml(tmp / "dpo2.toml", cfg, dpo_batch=1, **extra), "--out", str(tmp / "dpo2")])
    out, err = p.communicate(timeout=300)
    assert p.returncode in (0, 2), err[-3000:]
    from safetensors.numpy import load_file
    a, b = (load_file(tmp / d / "adapter" / "adapter_model.safetensors") for d in ("dpo1", "dpo2"))
    assert sorted(a) == sorted(b)
    worst = max(float(np.max(np.abs(a[k] - b[k])) / max(float(np.max(np.abs(a[k]))), 1e-30)) for k in a)
    print(f"DPO, two ranks vs one process: max relative difference {worst:.3e}")
    assert worst <= 1e-5, f"max relative difference {worst:.3e}"
    assert any(float(np.max(np.abs(a[k]))) > 0 for k in a if "lora_B" in k)        # DPO moved the adapter
    recs = {d: [e for e in map(json.loads, (tmp / d / "metrics.jsonl").read_text().splitlines())
                if e.get("event") in ("dpo_step", "dpo_evidence")] for d in ("dpo1", "dpo2")}
    steps = [[e for e in recs[d] if e["event"] == "dpo_step"] for d in ("dpo1", "dpo2")]
    assert len(steps[0]) == len(steps[1]) == 3
    for x, y in zip(*steps):
        assert y["dpo_loss"] == pytest.approx(x["dpo_loss"], rel=1e-5) and "allreduce_s" in y
    ev = [next(e for e in recs[d] if e["event"] == "dpo_evidence")["dpo_heldout"] for d in ("dpo1", "dpo2")]
    for k in ("pair_accuracy", "margin_improvement", "chosen_drift", "rejected_drift"):
        assert ev[1][k] == pytest.approx(ev[0][k], rel=1e-4, abs=1e-6), k
