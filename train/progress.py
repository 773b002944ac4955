"""Output: progress per step (a tqdm bar with ETA and throughput on a terminal, plain lines
otherwise), the log file, quiet and JSON-lines modes."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm


class Records:
    """The one writer of a run folder's metrics.jsonl: the run's history (step, eval, dpo_step,
    dpo_evidence, resume records) that report.html and `vkdsl report` read."""

    def __init__(self, run_dir):
        self.path = Path(run_dir) / "metrics.jsonl"

    def append(self, kind, **rec):
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": kind, **rec}) + "\n")

    def mark_resume(self, step: int):
        """Drop the records of steps after the checkpoint (they run again) and mark the resume,
        in one atomic replace."""
        from .checkpoint import atomic_write
        keep = []
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue                       # a line cut by the kill
                if rec.get("step", 0) <= step:
                    keep.append(line)
        keep.append(json.dumps({"event": "resume", "step": step}))
        atomic_write(self.path, ("\n".join(keep) + "\n").encode())


class Reporter:
    def __init__(self, log_path=None, quiet=False, jsonl=False, tty=None):
        self.log = open(log_path, "a", encoding="utf-8") if log_path else None
        self.quiet, self.jsonl = quiet, jsonl
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.t0, self.bar = None, None
        self.tokens = 0

    def _print(self, text):
        if self.bar is not None:
            self.bar.write(text)             # above the bar, which redraws below
        else:
            print(text, flush=True)

    def say(self, text):
        """Human text: stdout unless quiet/jsonl; always the log."""
        if self.log:
            self.log.write(text + "\n")
            self.log.flush()
        if not (self.quiet or self.jsonl):
            self._print(text)

    def outcome(self, text):
        """What a run found (its gates, its folder): printed under --quiet too, not with --jsonl
        (its events carry them); always the log."""
        if self.log:
            self.log.write(text + "\n")
            self.log.flush()
        if not self.jsonl:
            self._print(text)

    def event(self, kind, **rec):
        if self.jsonl:
            print(json.dumps({"event": kind, **rec}), flush=True)

    def progress(self, step, total, rec):
        if self.t0 is None:
            self.t0, self.first = time.perf_counter(), step
        self.tokens += rec["tokens"]
        el = time.perf_counter() - self.t0
        done = step - self.first + 1
        eta = el / done * (total - step)
        tok_s = rec["seq_tokens"] / max(rec["time"], 1e-9)
        line = (f"step {step}/{total}  loss {rec['loss']:.4f}  tmkl {rec['tmkl']:.4f}  lr {rec['lr']:.2e}  "
                f"|g| {rec['grad_norm']:.3f}  {tok_s:.0f} tok/s  ETA {int(eta // 60)}m{int(eta % 60):02d}s")
        if self.log:
            self.log.write(line + "\n")
            self.log.flush()
        self.event("step", step=step, **{k: v for k, v in rec.items() if k != "raw_grads"})
        if self.quiet or self.jsonl:
            return
        if not self.tty:
            print(line, flush=True)
            return
        if self.bar is None:
            self.bar = tqdm(total=total, initial=step - 1, unit="step", dynamic_ncols=True, file=sys.stdout)
        self.bar.set_postfix_str(f"loss {rec['loss']:.4f} tmkl {rec['tmkl']:.4f} lr {rec['lr']:.2e} "
                                 f"|g| {rec['grad_norm']:.3f} {tok_s:.0f} tok/s", refresh=False)
        self.bar.update(1)
        if step >= total:
            self.close()

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
