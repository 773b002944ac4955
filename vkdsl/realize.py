"""Programs: a schedule turned into kernels, buffers and one recorded command buffer.

Eager results (.numpy()) build a program, run it once and turn the computed nodes into
realized leaves. vkdsl.trace keeps the program and replays it: upload inputs, one submit,
wait, read outputs -- no Python work per dispatch."""
from __future__ import annotations

import contextlib
import math
import threading

import numpy as np

from . import render
from .compiler import compile_glsl, prefetch
from .graph import NP_DTYPE, reshape_base
from .handwritten import default_variant, fold_grid, texel_limit
from .matmul import plan_matmul, record_matmul
from .runtime import Buffer, Part, Recording, default_device, get_kernel
from .schedule import plan
from .slots import buffer_slots, value_bytes


class Capture:
    """What a traced function does besides returning tensors: its assigns, replayed each call."""

    def __init__(self):
        self.assigns = []
        self.guards = []           # (probe, value at trace time): see depends_on


_state = threading.local()


def depends_on(probe):
    """Inside a traced function: the program being built is valid only while probe() returns what it
    returns now (vkdsl.trace rebuilds it otherwise). E.g. a model's table of adapter objects, which
    the program captured by identity: swapping an adapter must not replay the old one."""
    cap = getattr(_state, "capture", None)
    if cap is not None:
        cap.guards.append((probe, probe()))


@contextlib.contextmanager
def capturing():
    """Within the block, Tensor.assign records into the yielded Capture instead of running."""
    cap, prev = Capture(), getattr(_state, "capture", None)
    _state.capture = cap
    try:
        yield cap
    finally:
        _state.capture = prev


def upload(a: np.ndarray, device=None, name=None) -> Buffer:
    dev = device or default_device()
    pending = getattr(_state, "pending", None)
    if pending is not None:
        pending.append(PendingUpload(a, dev, name))
        return pending[-1]
    buf = Buffer(dev, a.nbytes, label=name or "tensor")
    if a.size:
        buf.write(a)
    return buf


class PendingUpload:
    """A leaf's buffer whose allocation waits (made under deferred_uploads): its size is known, so
    graphs over it trace, schedule and plan (Traced.plan) with nothing on the device; the first
    use of anything else (a binding, a read) uploads it, as does upload_all."""

    def __init__(self, a: np.ndarray, device, name):
        self._a, self._device, self._name, self._buf = a, device, name, None
        self.nbytes = a.nbytes

    def resolve(self) -> Buffer:
        if self._buf is None:
            self._buf = Buffer(self._device, self.nbytes, label=self._name or "tensor")
            if self._a.size:
                self._buf.write(self._a)
            self._a = None                       # the host copy goes as the device one comes
        return self._buf

    @property
    def uploaded(self) -> bool:
        return self._buf is not None

    def __getattr__(self, name):
        return getattr(self.resolve(), name)


@contextlib.contextmanager
def deferred_uploads():
    """Within the block, tensors made from host arrays keep their bytes on the host (the yielded
    list of PendingUpload): a model is built, and its programs planned, before any of its weights
    take device memory. upload_all(list) puts them on the device."""
    prev, _state.pending = getattr(_state, "pending", None), []
    try:
        yield _state.pending
    finally:
        _state.pending = prev


def upload_all(pending: list) -> int:
    """Upload every buffer still pending; returns the bytes uploaded."""
    todo = [p for p in pending if not p.uploaded]
    for p in todo:
        p.resolve()
    return sum(p.nbytes for p in todo)


def _rendered(dev, step):
    if not dev.limits.storage16 and any(t.dtype == "float16" for t in (step.node, *step.inputs)):
        raise ValueError(f"{render.kernel_name(step)}: float16 tensors need 16-bit storage "
                         f"(storageBuffer16BitAccess), which {dev.info.describe()} lacks; keep "
                         f"them float32")
    # subgroup reductions on GPUs only: on lavapipe they measured slower than the shared-memory
    # tree (SFT step 4 x 64 on SmolLM2: 10.3-12.4 s vs 9.3-9.9 s)
    lvp = default_variant(dev) == "lvp"
    return render.render_step(step, subgroups=dev.limits.subgroup_arithmetic and not lvp,
                              texel_limit=texel_limit(dev), serial=lvp)


def generated_kernel(dev, step, r=None):
    """(pipeline, workgroups) of a generated step (r: its rendering, when done already): the
    renderer says the geometry."""
    r = r or _rendered(dev, step)
    k = get_kernel(dev, r.name, compile_glsl(r.name, r.source), 1 + len(step.inputs), 0, r.local,
                   r.texels)
    return k, fold_grid(dev, r.n_groups)


def compile_ahead(dev, steps) -> dict:
    """Compile a program's generated kernels on all cores before recording takes them one by one
    -> {id(step): its rendering}, for the recording to reuse."""
    gen = [s for s in steps if s.kind not in ("matmul", "custom")
           and not (s.kind == "assign" and len(s.inputs) == 1 and s.inputs[0] is s.node)]
    if len(gen) < 2:
        return {}
    try:
        rendered = {id(s): _rendered(dev, s) for s in gen}
    except ValueError:
        return {}                        # recording raises it again, at the step it belongs to
    prefetch([(r.name, r.source, None) for r in rendered.values()])
    return rendered


def step_name(step) -> str:
    """A step's kernel class, for profiles: matmul shape, custom op name or generated kernel
    name."""
    if step.kind == "matmul":
        return f"matmul {step.node.shape}"
    if step.kind == "custom":
        return f"{step.node.arg.name} {step.node.shape}"
    return render.kernel_name(step)                # the name without rendering the source


def record_step(rec, step, buffer_of, rendered: dict | None = None):
    """Record one scheduled step into rec: the one place that knows how each kind is dispatched
    (rendered: generated steps' renderings by id, from compile_ahead)."""
    out = buffer_of(step.target) if step.kind == "assign" else buffer_of(step.node)
    if step.kind == "matmul":
        _record_matmul(rec, step.node, out, *[buffer_of(x) for x in step.node.src])
    elif step.kind == "custom":
        step.node.arg.record(rec, out, [buffer_of(x) for x in step.node.src])
    elif step.kind == "assign" and len(step.inputs) == 1 and step.inputs[0] is step.node:
        rec.copy(buffer_of(step.node), out, value_bytes(step.node))
    else:
        k, groups = generated_kernel(rec.device, step, (rendered or {}).get(id(step)))
        rec.dispatch(k, [out] + [buffer_of(x) for x in step.inputs], groups)


def _record_matmul(rec, node, out, abuf, bbuf):
    ta, tb, nb, ba, bb, precision = node.arg
    a = node.src[0]
    M, N = node.shape[-2:]
    K = a.shape[-2] if ta else a.shape[-1]
    p = plan_matmul(rec.device, M=M, N=N, K=K, batch=nb, ta=ta, tb=tb,
                    batch_stride_a=M * K if ba > 1 else 0, batch_stride_b=K * N if bb > 1 else 0,
                    precision=precision)
    record_matmul(rec, p, out, abuf, bbuf)


GUARD_WORD = np.uint32(0x7FC0DEAD)    # a NaN pattern no kernel writes by accident


@contextlib.contextmanager
def guarded(nbytes: int = 256):
    """Programs built within the block get nbytes of sentinel words past each output and raise
    OverrunError when a run finds them overwritten (vkdsl verify runs every case so)."""
    prev, _state.guard = getattr(_state, "guard", 0), int(nbytes)
    try:
        yield
    finally:
        _state.guard = prev


class OverrunError(RuntimeError):
    """A kernel wrote past the end of its output buffer."""


class Program:
    """outputs: tensors to read back; inputs: placeholder tensors (op 'input') filled per run.
    guard_bytes > 0 gives each output buffer that many bytes of sentinel words past its end, and
    guards_intact() says whether any kernel wrote there (tests catch out-of-bounds writes)."""

    def __init__(self, outputs, inputs=(), assigns=(), device=None, label="program",
                 guard_bytes: int | None = None):
        self.dev = dev = device or default_device()
        guard = getattr(_state, "guard", 0) if guard_bytes is None else guard_bytes
        self.guard_bytes = -(-int(guard) // 4) * 4
        self.outputs, self.inputs, self.label = list(outputs), list(inputs), label
        steps, mat = plan(self.outputs, list(assigns))
        self.steps = steps
        self.bufs: dict[int, Buffer] = {}
        self._keep = []  # tensors whose ids key self.bufs stay alive with the program
        unified = dev.unified_memory
        # Inputs: host-visible on unified devices; else device-local plus a staging twin.
        self.in_stage = []
        for t in self.inputs:
            self._own(t, Buffer(dev, value_bytes(t), label=f"input{t.arg}"))
            self.in_stage.append(None if unified
                                 else Buffer(dev, value_bytes(t), host=True, label="stage-in"))
        # Computed nodes: one buffer per slot of buffer_slots (outputs their own, temporaries
        # reused).
        slot_of, slots = buffer_slots(steps, self.outputs)
        made = []
        for nb, kind in slots:
            buf = Buffer(dev, nb + (self.guard_bytes if kind == "output" else 0), label=kind)
            if kind == "output" and self.guard_bytes:
                buf.write(np.full(self.guard_bytes // 4, GUARD_WORD), offset=nb)
            made.append(buf)
        for s in steps:
            if s.kind != "assign":
                buf = made[slot_of[id(s.node)]]
                self._own(s.node, buf if buf.nbytes == value_bytes(s.node)
                          else Part(buf, value_bytes(s.node)))
        # (buffer, value bytes, step) of each guarded output: its sentinel words follow the value
        self._guarded = [(made[slot_of[id(s.node)]], value_bytes(s.node), step_name(s))
                         for s in steps if self.guard_bytes and s.kind != "assign"
                         and slots[slot_of[id(s.node)]][1] == "output"]
        self.out_stage = [None if unified
                          else Buffer(dev, max(value_bytes(o), 4), host=True, label="stage-out")
                          for o in self.outputs]
        self._record()

    def buffers(self) -> list:
        """The distinct device buffers the program allocated for its inputs and values (a slot
        shared by several values once; staging twins not included)."""
        return list({id(b): b for b in (getattr(b, "buffer", b)
                                        for b in self.bufs.values())}.values())

    @property
    def device_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())

    def _own(self, t, buf):
        self.bufs[id(t)] = buf
        self._keep.append(t)

    def buffer_of(self, t) -> Buffer:
        while True:
            if t.op == "buffer":
                return t.buffer
            if id(t) in self.bufs:
                return self.bufs[id(t)]
            if t.op == "reshape":
                t = t.src[0]
                continue
            raise RuntimeError(f"internal: no buffer for {t}")

    def _record(self):
        dev = self.dev
        rendered = compile_ahead(dev, self.steps)
        rec = Recording(dev, n_sets=len(self.steps) * 4 + 4, label=self.label)
        for t, st in zip(self.inputs, self.in_stage):
            if st is not None:
                rec.copy(st, self.buffer_of(t), value_bytes(t))
        for s in self.steps:
            record_step(rec, s, self.buffer_of, rendered)
        for o, st in zip(self.outputs, self.out_stage):
            if st is not None:
                rec.copy(self.buffer_of(o), st, value_bytes(o))
        self.recording = rec.finish()

    def run(self, arrays=()):
        for t, a, st in zip(self.inputs, arrays, self.in_stage):
            dst = st or self.buffer_of(t)
            if a.size:
                dst.view(NP_DTYPE[t.dtype], a.size)[:] = a.reshape(-1)
        self.recording.submit_wait()
        if self.guard_bytes and (over := self.overruns()):
            raise OverrunError(f"{self.label}: {', '.join(over)} wrote past the end of its "
                               f"output")
        res = []
        for o, st in zip(self.outputs, self.out_stage):
            src = st or self.buffer_of(o)
            n = math.prod(o.shape)
            res.append(src.view(NP_DTYPE[o.dtype], n).copy().reshape(o.shape) if n else
                       np.zeros(o.shape, NP_DTYPE[o.dtype]))
        return res

    def guards_intact(self) -> bool:
        """True when no output's sentinel words (guard_bytes past its end) were overwritten."""
        return not self.overruns()

    def overruns(self) -> list[str]:
        """The steps whose outputs' sentinel words were overwritten."""
        return [name for buf, nb, name in self._guarded
                if not np.all(buf.read(np.uint32, (nb + self.guard_bytes) // 4)[nb // 4:]
                              == GUARD_WORD)]

    def release(self):
        self.recording.release()


def _as_leaf(t, buf):
    # a realized tensor that depended on parameters keeps a mark: its graph is gone, and a later
    # grad() through it must say so instead of returning zeros (vkdsl.autograd.grad)
    t.op, t.src, t.arg, t.buffer = "buffer", (), ("realized" if t.requires_grad else None), buf


def realize(tensors):
    """Compute tensors now; each becomes a realized leaf holding its buffer."""
    todo = [t for t in tensors if t.op != "buffer"]
    if todo:
        prog = Program(todo, label="eager")
        prog.run()
        for t in todo:
            buf = prog.buffer_of(t)
            _as_leaf(t, buf if buf.label == "output" else _copy_out(prog, t))
        prog.release()
    return [_read(t) for t in tensors]


def _copy_out(prog, t):
    return upload(prog.run()[prog.outputs.index(t)])


def _read(t):
    n = math.prod(t.shape)
    return (t.buffer.read(NP_DTYPE[t.dtype], n).reshape(t.shape) if n
            else np.zeros(t.shape, NP_DTYPE[t.dtype]))


def assign(target, value):
    ctx = getattr(_state, "capture", None)
    if ctx is not None:
        ctx.assigns.append((target, value))
        return
    prog = Program([], assigns=[(target, value)], label="assign")
    prog.run()
    prog.release()
