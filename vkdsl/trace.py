"""vkdsl.trace: capture a Python function of tensors once, replay it many times.

The first call with a given set of input shapes runs the function on placeholder tensors,
schedules the graph, compiles its kernels, allocates its buffers and records one command
buffer. Later calls upload the inputs, submit, wait and read the outputs."""
from __future__ import annotations

import gc
import itertools
import time
import weakref

import numpy as np

from . import precision
from .graph import DTYPES
from .realize import Program, capturing
from .slots import buffer_slots
from .runtime import default_device
from .runtime.context import RECLAIM
from .runtime.memory import key_stable_size
from .schedule import plan as schedule
from .tensor import Tensor


def _flatten(out):
    if isinstance(out, Tensor):
        return [out], lambda xs: xs[0]
    if isinstance(out, (tuple, list)):
        return list(out), lambda xs: type(out)(xs)
    if isinstance(out, dict):
        keys = list(out)
        return [out[k] for k in keys], lambda xs: dict(zip(keys, xs))
    if out is None:
        return [], lambda xs: None
    raise TypeError(f"a traced function must return tensors (or a tuple/list/dict of them), got "
                    f"{type(out)}")


# programs built by every Traced in this process, and the seconds spent building them (trace,
# schedule, compile, allocate, record): a run reports it, so first-call cost is never hidden
BUILT = {"programs": 0, "seconds": 0.0}
# every Traced alive, and a clock of program use: an allocation that does not fit the device's
# budget first releases the least recently used programs of any of them (runtime.context.RECLAIM;
# a program of another shape is a cache that holds memory only while nothing needs it)
_LIVE = weakref.WeakSet()
_CLOCK = itertools.count()


def release_least_recent() -> bool:
    """Release the least recently used program of any Traced, so its buffers leave the device;
    False when there is none."""
    held = [(t.used.get(k, 0), id(t), t, k) for t in list(_LIVE) for k in t.programs]
    if not held:
        return False
    _, _, t, k = min(held, key=lambda h: h[:2])
    t.programs.pop(k)[0].release()
    t.used.pop(k, None)
    gc.collect()                              # a program's buffers go with its last reference
    return True


RECLAIM.append(release_least_recent)


class Traced:
    def __init__(self, fn, device=None, guard_bytes: int | None = None, keep: int = 0):
        """keep > 0: hold at most this many programs (one per input shapes), releasing the least
        recently used before building another; 0 keeps every one (a program holds its buffers, so
        a function called at many shapes would hold the sum of their memory)."""
        self.fn, self.device, self.guard_bytes, self.keep = fn, device, guard_bytes, keep
        self.programs = {}
        self.used = {}                           # key -> _CLOCK at its last use
        _LIVE.add(self)

    def _key(self, arrays):
        # the matmul precision is baked into the traced graph, so it selects the program too
        return (precision.current(),) + tuple((a.shape, a.dtype.str) for a in arrays)

    def compile(self, *arrays):
        arrays = [_as_input(a, i) for i, a in enumerate(arrays)]
        key = self._key(arrays)
        if key in self.programs and any(probe() != value for probe, value in self.programs[key][2]):
            self.programs.pop(key)[0].release()        # what it captured changed: build it again
        if key in self.programs:
            self.programs[key] = self.programs.pop(key)      # most recently used last
        else:
            while self.keep and len(self.programs) >= self.keep:
                self.programs.pop(next(iter(self.programs)))[0].release()
            t0 = time.perf_counter()
            holders = [Tensor("input", arg=i, shape=a.shape, dtype=DTYPES[a.dtype])
                       for i, a in enumerate(arrays)]
            with capturing() as cap:
                out = self.fn(*holders)
            outs, rebuild = _flatten(out)
            for o in outs:
                if not isinstance(o, Tensor):
                    raise TypeError(f"traced function returned {type(o)}, expected Tensor")
            prog = Program(outs, holders, cap.assigns, device=self.device,
                           label=getattr(self.fn, "__name__", "trace"),
                           guard_bytes=self.guard_bytes)
            self.programs[key] = (prog, rebuild, cap.guards)
            BUILT["programs"] += 1
            BUILT["seconds"] += time.perf_counter() - t0
        self.used[key] = next(_CLOCK)
        return self.programs[key], arrays

    def plan(self, *arrays) -> dict:
        """Device bytes the program for these inputs would hold, decided without building it (the
        function is traced and scheduled; nothing is compiled or allocated): inputs, outputs,
        temporaries after reuse (slots.buffer_slots, what Program allocates), the staging twins
        of a device without unified memory, and their total (a driver may round each allocation up
        to its alignment)."""
        arrays = [_as_input(a, i) for i, a in enumerate(arrays)]
        holders = [Tensor("input", arg=i, shape=a.shape, dtype=DTYPES[a.dtype])
                   for i, a in enumerate(arrays)]
        with capturing() as cap:
            outs, _ = _flatten(self.fn(*holders))
        steps, _ = schedule(outs, cap.assigns)
        _, slots = buffer_slots(steps, outs)
        size = key_stable_size                      # what runtime.Buffer allocates for n bytes
        out = {"inputs": sum(size(a.nbytes) for a in arrays),
               "outputs": sum(size(n) for n, k in slots if k == "output"),
               "temporaries": sum(size(n) for n, k in slots if k == "temp")}
        unified = (self.device or default_device()).unified_memory
        out["staging"] = 0 if unified else out["inputs"] + out["outputs"]
        out["total"] = sum(out.values())
        return out

    def __call__(self, *arrays):
        (prog, rebuild, _), arrays = self.compile(*arrays)
        return rebuild(prog.run(arrays))

    def program(self, *arrays) -> Program:
        return self.compile(*arrays)[0][0]


def _as_input(a, i):
    a = np.asarray(a)
    # np.ascontiguousarray makes 0-d arrays 1-d: keep the caller's shape
    if a.dtype.kind == "f":
        return np.ascontiguousarray(a, dtype=np.float32).reshape(a.shape)
    if a.dtype.kind in "iub":
        if a.size and (a.min() < -2**31 or a.max() >= 2**31):
            raise ValueError(f"input {i}: integer values outside int32")
        return np.ascontiguousarray(a, dtype=np.int32).reshape(a.shape)
    raise TypeError(f"input {i}: expected a float or integer array, got dtype {a.dtype}")


def trace(fn=None, *, device=None, guard_bytes: int | None = None, keep: int = 0):
    """Decorator: @vkdsl.trace def step(x, y): ...; step(np_x, np_y) -> numpy results.
    guard_bytes: sentinel words past each output (see Program.guards_intact; default: none, or
    realize.guarded's). keep: see Traced."""
    if fn is None:
        return lambda f: Traced(f, device, guard_bytes, keep)
    return Traced(fn, device, guard_bytes, keep)
