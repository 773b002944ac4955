"""Output: a progress line per step, the log file, quiet and JSON-lines modes."""
from __future__ import annotations

import json
import sys
import time


class Reporter:
    def __init__(self, log_path=None, quiet=False, jsonl=False):
        self.log = open(log_path, "a", encoding="utf-8") if log_path else None
        self.quiet, self.jsonl = quiet, jsonl
        self.t0 = None
        self.tokens = 0

    def say(self, text):
        """Human text: stdout unless quiet/jsonl; always the log."""
        if self.log:
            self.log.write(text + "\n")
            self.log.flush()
        if not (self.quiet or self.jsonl):
            print(text, flush=True)

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
        line = (f"step {step}/{total}  loss {rec['loss']:.4f}  tmkl {rec['tmkl']:.4f}  lr {rec['lr']:.2e}  "
                f"|g| {rec['grad_norm']:.3f}  {rec['seq_tokens'] / max(rec['time'], 1e-9):.0f} tok/s  "
                f"ETA {int(eta // 60)}m{int(eta % 60):02d}s")
        if self.log:
            self.log.write(line + "\n")
            self.log.flush()
        self.event("step", step=step, **{k: v for k, v in rec.items() if k != "raw_grads"})
        if not (self.quiet or self.jsonl):
            print(line, flush=True)
