"""Output: progress per step (a tqdm bar with ETA and throughput on a terminal, plain lines
otherwise), the log file, quiet and JSON-lines modes."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
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
        line = (f"step {step}/{total}  loss {rec['loss']:.4f}  tmkl {rec['tmkl']:.4f}  lr "
                f"{rec['lr']:.2e}  |g| {rec['grad_norm']:.3f}  {tok_s:.0f} tok/s  ETA "
                f"{int(eta // 60)}m{int(eta % 60):02d}s")
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
            self.bar = tqdm(total=total, initial=step - 1, unit="step", dynamic_ncols=True,
                            file=sys.stdout)
        self.bar.set_postfix_str(f"loss {rec['loss']:.4f} tmkl {rec['tmkl']:.4f} lr "
                                 f"{rec['lr']:.2e} |g| {rec['grad_norm']:.3f} {tok_s:.0f} tok/s",
                                 refresh=False)
        self.bar.update(1)
        if step >= total:
            self.close()

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def evidence_table(ev) -> str:
    """An evaluation (train.evidence.Evidence) as the lines the run prints."""
    L = [f"evidence at step {ev.step}:",
         "  train loss (last step)       "
         + ("-" if ev.train_loss is None else f"{ev.train_loss:.4f}"),
         f"  held-out loss                {ev.heldout_loss:.4f}  (base {ev.heldout_loss_base:.4f})"]
    if ev.heldout_acc is not None:
        lo, hi = ev.heldout_acc_ci
        L.append(f"  held-out accuracy            {ev.heldout_acc:.3f}  Wilson 95% [{lo:.3f}, "
                 f"{hi:.3f}]  ({ev.heldout_correct}/{ev.heldout_n}; base "
                 f"{ev.heldout_acc_base:.3f})")
    L.append(f"  preservation delta           {ev.preservation_delta:+.4f} nats/token vs base "
             f"({ev.preservation_loss:.4f} vs {ev.preservation_loss_base:.4f})")
    cal = ev.calibration
    if cal:
        L.append(f"  calibration (ECE, 10 bins)   {cal['ece']:.3f} over {cal['n']} rows; bins (n: "
                 f"accuracy/confidence) "
                 + " ".join(f"{b['n']}:{b['accuracy']:.2f}/{b['confidence']:.2f}"
                            for b in cal["bins"] if b["n"]))
    if ev.format_valid is not None:
        L.append(f"  format (greedy = one label + end-of-turn) {ev.format_valid:.3f} of "
                 f"{ev.format_n} prompts")
        for f in ev.format_failures:
            L.append(f"    e.g. {f['row']}: expected {f['expected']!r}, generated "
                     f"{f['generated']!r}")
    sl = ev.slices
    if sl:
        for c, v in sl["categories"].items():
            acc = "" if v["accuracy"] is None else f"  accuracy {v['accuracy']:.3f} ({v['n']} rows)"
            L.append(f"  held-out [{c}]{' ' * max(1, 18 - len(c))}loss {v['loss']:.4f}{acc}"
                     + ("  <- worst slice" if c == sl["worst"] else ""))
    else:
        for c, v in ev.category_loss.items():
            L.append(f"  held-out loss [{c}]{' ' * max(1, 13 - len(c))}{v:.4f}")
    st = ev.stability_checkpoint
    if st and st["agreement"] is not None:
        L.append(f"  stability: decisions agree with "
                 f"{'the base' if st['step'] == 'base' else 'step ' + str(st['step'])} on "
                 f"{st['agreement']:.3f} of rows")
    fp = ev.stability_fp32
    if fp and fp["agreement"] is not None:
        L.append(f"  stability: packed base vs fp32-dequantized base, same adapter: "
                 f"{fp['agreement']:.3f} of {fp['rows']} decisions agree")
    L.append(f"  adapter checksum             {ev.checksum} "
             f"({'changed' if ev.checksum_changed else 'UNCHANGED'} since init)")
    if ev.merge_max_diff is not None:
        L.append(f"  merged vs separate           max diff {ev.merge_max_diff:.2e}, argmax "
                 f"agreement {ev.merge_argmax:.3f} ({ev.merge_module})")
    for n, s in list(ev.spectrum.items())[:4]:
        L.append(f"  {n:<20} sv {', '.join(f'{x:.3g}' for x in s['sv'])}  stable rank "
                 f"{s['stable_rank']:.2f}")
    if len(ev.spectrum) > 4:
        srs = [s["stable_rank"] for s in ev.spectrum.values()]
        L.append(f"  ({len(srs)} modules: stable rank min {min(srs):.2f} / mean {np.mean(srs):.2f} "
                 f"/ max {max(srs):.2f})")
    return "\n".join(L)
