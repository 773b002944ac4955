"""The kill campaign: run a small training job (tiny model, SFT then DPO, export), SIGKILL it at
seeded random moments, including inside every kind of file write, resume it, and compare the
final adapter with an uninterrupted run's. Every outcome must be `identical` (bit for bit) or
`refused` (a clear one-line message); `DIFFERENT` or `crashed` fails the campaign.

    .venv/bin/python tests/kills.py                 # 50 kills (default), a table of outcomes
    .venv/bin/python tests/kills.py --kills 8 --seed 3

Kills inside writes: a prelude wraps os.replace in the job's process and kills it just before
or just after the N-th replace (the two sides of every atomic write). Timed kills land anywhere."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

PRELUDE = """
import os, signal, sys
N, PHASE = {n}, {phase!r}
_count, _replace = [0], os.replace
def _replace_and_maybe_die(src, dst, **kw):
    _count[0] += 1
    if _count[0] == N and PHASE == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    _replace(src, dst, **kw)
    if _count[0] == N and PHASE == "after":
        os.kill(os.getpid(), signal.SIGKILL)
if N:
    os.replace = _replace_and_maybe_die
from vkdsl.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


def job_args(data: dict, out: Path) -> list[str]:
    return ["--model", data["model"], "--train-file", data["train"], "--heldout-file", data["held"],
            "--preservation-file", data["pres"], "--labels", "low,medium,high", "--max-len", "64", "--bucket", "16",
            "--rank", "4", "--alpha", "8", "--lr", "0.01", "--warmup", "1", "--steps", "6", "--checkpoint-every", "1",
            "--batch-size", "4", "--eval-every", "0", "--tmkl", "0.1", "--no-verify", "--quiet",
            "--dpo-train-file", data["prefs"], "--dpo-heldout-file", data["prefs"], "--dpo-steps", "2",
            "--out", str(out)]


def launch(args, n=0, phase="", timeout=300):
    return subprocess.run([sys.executable, "-c", PRELUDE.format(n=n, phase=phase), *args], capture_output=True,
                          text=True, timeout=timeout)


def final_adapter(run_dir: Path):
    """The exported adapter's tensors (after DPO) and the SFT adapter, or None if not written."""
    from safetensors.numpy import load_file
    peft, npz = run_dir / "adapter" / "adapter_model.safetensors", run_dir / "adapter.npz"
    if not (peft.is_file() and npz.is_file()):
        return None
    with np.load(npz) as z:
        sft = {k: z[k] for k in z.files}
    return load_file(str(peft)), sft


def same(a, b) -> bool:
    return a is not None and b is not None and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def make_data(root: Path) -> dict:
    from fixtures.train_data import tiny_setup
    tm, tr, he, pr = tiny_setup(root)
    rows = [json.loads(x) for x in open(tr)]
    prefs = root / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": r["prompt"], "chosen": r["completion"],
                                         "rejected": "low" if r["completion"] != "low" else "high"}) + "\n"
                             for r in rows))
    return {"model": str(tm.gguf_path), "train": tr, "held": he, "pres": pr, "prefs": str(prefs)}


def one_kill(data, root: Path, i: int, rng, reference, writes: int, full_s: float) -> tuple[str, str]:
    out = root / f"k{i}"
    if i % 2 == 0:                          # inside a write: before or after the N-th os.replace
        n, phase = int(rng.integers(1, writes + 1)), ("before", "after")[int(rng.integers(0, 2))]
        how = f"replace #{n} {phase}"
        launch(job_args(data, out), n, phase)
    else:                                    # at a random moment
        delay = float(rng.uniform(0.5, full_s))
        how = f"at {delay:.1f}s"
        p = subprocess.Popen([sys.executable, "-c", PRELUDE.format(n=0, phase=""), *job_args(data, out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
    # before config.json a fresh start: the folder may hold the killed start's train.log
    resume = ["--resume", str(out)] if (out / "config.json").is_file() else job_args(data, out) + ["--overwrite"]
    r = launch(resume + (["--quiet"] if "--resume" in resume else []))
    got = final_adapter(out)
    if r.returncode in (0, 3) and same(got, reference):
        return "identical", how
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    if r.returncode == 1 and "error:" in last and "Traceback" not in r.stderr:
        return "refused", f"{how}: {last}"
    if r.returncode in (0, 3):
        return "DIFFERENT", how
    return "crashed", f"{how}: exit {r.returncode}: {r.stderr.strip()[-300:]}"


def campaign(kills: int, seed: int, out=print) -> Counter:
    with tempfile.TemporaryDirectory(prefix="vkdsl-kills-") as tmp:
        root = Path(tmp)
        data = make_data(root / "data")
        # the uninterrupted run, counting its atomic replaces: the write points to kill inside
        counting = (PRELUDE.replace("if N:", "if True:").format(n=-1, phase="")
                    .replace("sys.exit(main(sys.argv[1:]))",
                             "code = main(sys.argv[1:]); print('REPLACES', _count[0]); sys.exit(code)"))
        t0 = time.perf_counter()
        ref_run = subprocess.run([sys.executable, "-c", counting, *job_args(data, root / "reference")],
                                 capture_output=True, text=True, timeout=300)
        full_s = time.perf_counter() - t0
        if ref_run.returncode not in (0, 3):
            raise SystemExit(f"the uninterrupted run failed: {ref_run.stderr[-500:]}")
        reference = final_adapter(root / "reference")
        writes = int(ref_run.stdout.split("REPLACES")[-1])
        out(f"uninterrupted run: {full_s:.1f}s, {writes} atomic replaces")
        rng = np.random.default_rng(seed)
        tally = Counter()
        for i in range(kills):
            outcome, how = one_kill(data, root, i, rng, reference, writes, full_s)
            tally[outcome] += 1
            out(f"{i:3d} {outcome:10s} {how}")
        return tally


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    tally = campaign(args.kills, args.seed)
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items())))
    return 0 if set(tally) <= {"identical", "refused"} else 1


if __name__ == "__main__":
    sys.exit(main())
