"""The run's verify pass: the golden rows of the kernels a vkdsl-train run uses, checked on its
device before any step trains. It runs in a process of its own beside loading and the base
evaluation: on a new machine most of its time is the driver turning each kernel into machine code
on one thread (lavapipe: ~60 s of a cold run on a 2-core host), which the run's own work overlaps.
Nothing trains before it has passed (VerifyPass.join). Under MPI it runs first, in each rank's
own process (apart=False), as a rank starts no processes of its own."""
from __future__ import annotations

import multiprocessing
import time

VERIFY_MATCH = ("matmul", "qlinear", "dequant", "rmsnorm", "rope", "attention", "gather", "swiglu",
                "cross", "tmkl", "lora")
FP16_ROWS = ("matmul_f16in", "qmatmul_f16in")


def verify_cases(precision: str, tokens: int = 1 << 30, formats=None, root=None) -> list:
    """The golden cases of the kernels a run uses: the fp16 matmul rows only at precision fp16, the
    attention rows no longer than the run's sequences (`tokens`), the rows of a packed weight
    format only for the formats the run's model keeps (`formats`; None: every format). root: the
    golden folder (None: the installed goldens)."""
    from .verify import case_pairs

    def used(case, arrays, note):
        if case.op == "attention":
            return arrays["in0"].shape[0] <= max(tokens, 512)
        return precision == "fp16" or case.op not in FP16_ROWS
    return [c for m in VERIFY_MATCH for c in case_pairs(match=m, formats=formats, root=root)
            if used(*c)]


def verify_rows(precision, tokens, formats, root=None) -> list:
    """The pass's rows (vkdsl.verify.Row), on the device the environment picks."""
    from vkdsl.cases import verify
    return verify(verify_cases(precision, tokens, formats, root), repeat_warm=False)[0]


def _child(send, precision, tokens, formats, root):
    """The pass in its own process: its rows, or one line saying why there are none."""
    try:
        from vkdsl.runtime.pipeline_cache import PipelineCache
        from .common import open_device
        t0 = time.perf_counter()
        dev = open_device(None, announce=False)
        dev.pipeline_cache = PipelineCache(dev, part="verify")  # the run's process saves its own
        rows = verify_rows(precision, tokens, formats, root)
        dev.pipeline_cache.save(dev)                # a process of multiprocessing runs no atexit
        result = ("rows", rows, time.perf_counter() - t0)
    except BaseException as e:              # the parent reports it; a traceback here helps no one
        result = ("error", f"{type(e).__name__}: {e}", 0.0)
    try:
        send.send(result)
    except OSError:                         # the run is gone (killed, or stopped on an error)
        pass
    finally:
        send.close()


class VerifyPass:
    """The verify pass, started now; join() waits for it, prints its line, and stops the run when
    a row failed. apart=False runs it here and now (what join then reports)."""

    def __init__(self, precision, tokens, formats, root=None, apart=True):
        self.proc, self.rows, self.where = None, None, ", beside loading and the base evaluation"
        if not apart:
            t0 = time.perf_counter()
            rows = verify_rows(precision, tokens, formats, root)
            self.rows, self.where = ("rows", rows, time.perf_counter() - t0), ""
            return
        ctx = multiprocessing.get_context("spawn")     # a fresh interpreter: no Vulkan state shared
        self.recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_child, args=(send, precision, tokens, formats, root),
                                daemon=True, name="vkdsl-verify")
        self.proc.start()
        send.close()

    def join(self, rep):
        from vkdsl.train.loop import TrainingStopped
        if self.rows is None:
            try:
                self.rows = self.recv.recv()
            except EOFError:                # the process ended without a word (killed, crashed)
                self.proc.join()
                self.rows = ("error", f"its process ended with exit code {self.proc.exitcode} "
                                      f"and no rows", 0.0)
            self.proc.join()
        kind, rows, seconds = self.rows
        if kind == "error":
            raise TrainingStopped(f"verify failed: {rows}; nothing was trained")
        bad = [r for r in rows if not r.passed]
        rep.say(f"verify: {len(rows) - len(bad)}/{len(rows)} kernel checks pass on this device "
                f"({seconds:.1f}s{self.where})")
        if bad:
            named = "; ".join(f"{r.op} {r.name}: {r.note or r.error}" for r in bad[:5])
            raise TrainingStopped(f"verify failed: {named}; nothing was trained")

    def cancel(self):
        """The run ended before join (an error): the pass has nothing left to guard."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()
