"""Programs: a schedule turned into kernels, buffers and one recorded command buffer.

Eager results (.numpy()) build a program, run it once and turn the computed nodes into
realized leaves. vkdsl.trace keeps the program and replays it: upload inputs, one submit,
wait, read outputs -- no Python work per dispatch."""
from __future__ import annotations

import math
import threading

import numpy as np

from . import render
from .compiler import compile_glsl
from .runtime import Buffer, Recording, default_device, get_kernel
from .schedule import plan
from .tensor import Tensor

_local = threading.local()
NP_DTYPE = {"float32": np.float32, "int32": np.int32}
REDUCE_GROUP = 64          # workgroup size of a reduction that gives each output a workgroup


def _nbytes(t):
    return math.prod(t.shape) * 4


def upload(a: np.ndarray, device=None, name=None) -> Buffer:
    dev = device or default_device()
    buf = Buffer(dev, a.nbytes, label=name or "tensor")
    if a.size:
        buf.write(a)
    return buf


def _grid(n_groups, dev):
    """Spread a 1-d workgroup count over x and y when it exceeds the per-axis limit."""
    lim = dev.limits.max_workgroup_count[0]
    if n_groups <= lim:
        return (n_groups, 1, 1)
    gx = lim
    return (gx, -(-n_groups // gx), 1)


def _generated_kernel(dev, step, buffers_of):
    t = step.node
    if step.kind == "reduce":
        R = t.src[0].shape[t.arg[1]]
        group = REDUCE_GROUP if R >= 128 else 1
        src = render.reduction(t, step.inputs, group)
        n = math.prod(t.shape)
        local = (group, 1, 1) if group > 1 else (64, 1, 1)
        groups = _grid(n, dev) if group > 1 else _grid(-(-n // 64), dev)
    elif step.kind == "gather":
        table, idx = t.src
        src = render.gather(table.shape, math.prod(idx.shape))
        local, groups = (64, 1, 1), _grid(-(-math.prod(t.shape) // 64), dev)
    else:
        src = render.elementwise(t, step.inputs)
        local, groups = (64, 1, 1), _grid(-(-math.prod(t.shape) // 64), dev)
    name = f"{step.kind}_{'x'.join(map(str, t.shape)) or 'scalar'}"
    k = get_kernel(dev, name, compile_glsl(name, src), 1 + len(step.inputs), 0, local)
    return k, groups


class Program:
    """outputs: tensors to read back; inputs: placeholder tensors (op 'input') filled per run."""

    def __init__(self, outputs, inputs=(), assigns=(), device=None, label="program"):
        self.dev = dev = device or default_device()
        self.outputs, self.inputs, self.label = list(outputs), list(inputs), label
        steps, mat = plan(self.outputs, list(assigns))
        self.steps = steps
        self.bufs: dict[int, Buffer] = {}
        self._keep = []                 # tensors whose ids key self.bufs stay alive with the program
        unified = dev.unified_memory
        # Inputs: host-visible on unified devices; else device-local plus a staging twin.
        self.in_stage = []
        for t in self.inputs:
            self._own(t, Buffer(dev, _nbytes(t), label=f"input{t.arg}"))
            self.in_stage.append(None if unified else Buffer(dev, _nbytes(t), host=True, label="stage-in"))
        # Outputs, and the nodes that outputs alias through reshapes, keep dedicated buffers.
        out_ids = {id(o) for o in self.outputs} | {id(_reshape_base(o)) for o in self.outputs}
        last_use = {}
        for i, s in enumerate(steps):
            for x in s.inputs:
                last_use[id(_reshape_base(x))] = i
        free: dict[int, list[Buffer]] = {}
        self.total_bytes = 0
        for i, s in enumerate(steps):
            if s.kind == "assign":
                continue
            t = s.node
            nb = _nbytes(t)
            if id(t) in out_ids:
                buf = Buffer(dev, nb, label="output")
            else:
                pool = free.get(nb)
                buf = pool.pop() if pool else Buffer(dev, nb, label="temp")
            self._own(t, buf)
            for x in s.inputs:          # release buffers whose last reader is this step
                key = id(_reshape_base(x))
                if last_use.get(key) == i and key not in out_ids and key in self.bufs and \
                        self._is_temp(key):
                    free.setdefault(self.bufs[key].nbytes, []).append(self.bufs[key])
        self.out_stage = [None if unified else Buffer(dev, max(_nbytes(o), 4), host=True, label="stage-out")
                          for o in self.outputs]
        self._record()

    def _own(self, t, buf):
        self.bufs[id(t)] = buf
        self._keep.append(t)

    def _is_temp(self, key):
        return self.bufs[key].label == "temp"

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
        rec = Recording(dev, n_sets=len(self.steps) * 4 + 4, label=self.label)
        for t, st in zip(self.inputs, self.in_stage):
            if st is not None:
                rec.copy(st, self.buffer_of(t), _nbytes(t))
        for s in self.steps:
            out = self.buffer_of(s.target) if s.kind == "assign" else self.buffer_of(s.node)
            if s.kind in ("matmul", "custom"):
                srcs = [self.buffer_of(x) for x in s.node.src]
                if s.kind == "matmul":
                    _record_matmul(rec, s.node, out, *srcs)
                else:
                    s.node.arg.record(rec, out, srcs)
                continue
            if s.kind == "assign" and len(s.inputs) == 1 and s.inputs[0] is s.node:
                rec.copy(self.buffer_of(s.node), out, _nbytes(s.node))
                continue
            k, groups = _generated_kernel(dev, s, self.buffer_of)
            rec.dispatch(k, [out] + [self.buffer_of(x) for x in s.inputs], groups)
        for o, st in zip(self.outputs, self.out_stage):
            if st is not None:
                rec.copy(self.buffer_of(o), st, _nbytes(o))
        self.recording = rec.finish()

    def run(self, arrays=()):
        for t, a, st in zip(self.inputs, arrays, self.in_stage):
            dst = st or self.buffer_of(t)
            if a.size:
                dst.view(NP_DTYPE[t.dtype], a.size)[:] = a.reshape(-1)
        self.recording.submit_wait()
        res = []
        for o, st in zip(self.outputs, self.out_stage):
            src = st or self.buffer_of(o)
            n = math.prod(o.shape)
            res.append(src.view(NP_DTYPE[o.dtype], n).copy().reshape(o.shape) if n else
                       np.zeros(o.shape, NP_DTYPE[o.dtype]))
        return res

    def release(self):
        self.recording.release()


def _reshape_base(t):
    while t.op == "reshape":
        t = t.src[0]
    return t


def _record_matmul(rec, node, out, abuf, bbuf):
    ta, tb, nb, ba, bb = node.arg
    a, b = node.src
    M, N = node.shape[-2:]
    K = a.shape[-2] if ta else a.shape[-1]
    from .matmul import plan_matmul, record_matmul
    p = plan_matmul(rec.device, M=M, N=N, K=K, batch=nb, ta=ta, tb=tb,
                    batch_stride_a=M * K if ba > 1 else 0, batch_stride_b=K * N if bb > 1 else 0)
    record_matmul(rec, p, out, abuf, bbuf)


def _as_leaf(t, buf):
    t.op, t.src, t.arg, t.buffer = "buffer", (), None, buf


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
    return t.buffer.read(NP_DTYPE[t.dtype], n).reshape(t.shape) if n else np.zeros(t.shape, NP_DTYPE[t.dtype])


def assign(target, value):
    ctx = getattr(_local, "trace", None)
    if ctx is not None:
        ctx.assigns.append((target, value))
        return
    prog = Program([], assigns=[(target, value)], label="assign")
    prog.run()
    prog.release()
