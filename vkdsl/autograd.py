"""Reverse-mode autodiff over the lazy graph: one gradient rule per primitive, in one table.

grad(loss, params) walks only nodes that require a gradient, so a frozen weight never gets a
gradient tensor (let alone a buffer), while input gradients through frozen layers still flow
to earlier trainable tensors. The result is a lazy graph like any other: trace it."""
from __future__ import annotations

import contextlib
import contextvars

from .custom import CustomOp, custom
from .graph import base_of, walk
from .precision import matmul_precision
from .schedule import materialized
from .tensor import ShapeError, Tensor

# Each rule: (node, upstream gradient g, *sources) -> one gradient per source (None = no gradient).
# `out` is the node itself (some rules reuse the forward value).


def _unexpand(g: Tensor, shape) -> Tensor:
    """Sum g over the axes that broadcasting expanded, back to `shape`."""
    if g.shape == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    axes = (list(range(lead))
            + [lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1])
    return g.sum(axis=axes, keepdim=True).reshape(shape) if axes else g.reshape(shape)


def _inverse(axes):
    inv = [0] * len(axes)
    for i, a in enumerate(axes):
        inv[a] = i
    return tuple(inv)


def _matmul_grads(out, g, a, b):
    ta, tb = out.arg.ta, out.arg.tb
    A = a.transpose(-1, -2) if ta else a          # the logical operands of out = A @ B
    B = b.transpose(-1, -2) if tb else b
    ga = gb = None
    # A source stored transposed gets its gradient in its own layout ((g B^T)^T = B g^T), not as a
    # transposed view: what consumes it (the sum of a tensor's gradients) then reads it contiguous.
    # The same products summed in the same order, so the same bits.
    with matmul_precision(out.arg.precision):     # gradients at the forward's precision
        if a.requires_grad:
            ga = (_batch_sum(B @ g.transpose(-1, -2), a) if ta
                  else _batch_sum(g @ B.transpose(-1, -2), A))
        if b.requires_grad:
            gb = (_batch_sum(g.transpose(-1, -2) @ A, b) if tb
                  else _batch_sum(A.transpose(-1, -2) @ g, B))
    return ga, gb


def _batch_sum(d, X):
    """Reduce a batched gradient over the batch axes its operand X was broadcast along."""
    return d if d.shape == X.shape else _unexpand(d, X.shape)


def _reduce_grad(out, g, x):
    kind, axis = out.arg
    ge = g.expand(x.shape)
    if kind == "sum":
        return (ge,)
    # max: the gradient goes to the entries equal to the max (tests stay away from ties)
    return (ge * x.eq(out.expand(x.shape)),)


def _slice_grad(out, g, x):
    return (g.pad(tuple((a, s - a - n) for a, s, n in zip(out.arg, x.shape, out.shape))),)


def _pad_grad(out, g, x):
    return (g[tuple(slice(a, a + s) for (a, _), s in zip(out.arg, x.shape))],)


GRADIENTS = {
    "add": lambda o, g, a, b: (g, g),
    "sub": lambda o, g, a, b: (g, -g),
    "mul": lambda o, g, a, b: (g * b, g * a),
    "div": lambda o, g, a, b: (g / b, -g * o / b),
    "max": lambda o, g, a, b: (g * (1.0 - (a < b)), g * (a < b)),
    "neg": lambda o, g, a: (-g,),
    "exp": lambda o, g, a: (g * o,),
    "log": lambda o, g, a: (g / a,),
    "sqrt": lambda o, g, a: (g * 0.5 / o,),
    "rsqrt": lambda o, g, a: (g * -0.5 * o * o * o,),
    "tanh": lambda o, g, a: (g * (1.0 - o * o),),
    "recip": lambda o, g, a: (-g * o * o,),
    "sin": lambda o, g, a: (g * a.cos(),),
    "cos": lambda o, g, a: (-g * a.sin(),),
    "cmplt": lambda o, g, a, b: (None, None),
    "cmpeq": lambda o, g, a, b: (None, None),
    "where": lambda o, g, c, x, y: (None, c.where(g, 0.0), c.where(0.0, g)),
    "contiguous": lambda o, g, a: (g,),
    "cast": lambda o, g, a: (g,),  # rounding to fp16 passes the gradient straight through
    "reshape": lambda o, g, a: (g.reshape(a.shape),),
    "permute": lambda o, g, a: (g.permute(_inverse(o.arg)),),
    "expand": lambda o, g, a: (_unexpand(g, a.shape),),
    "slice": _slice_grad,
    "pad": _pad_grad,
    "reduce": _reduce_grad,
    "matmul": _matmul_grads,
    "gather": lambda o, g, table, idx: (scatter_add(g, idx, table.shape[0]), None),
}

_SAVED = contextvars.ContextVar("vkdsl_saved_activations", default="float32")


@contextlib.contextmanager
def saved_activations(dtype: str):
    """Gradients taken inside keep the forward values their rules read (the activations) in storage
    of this dtype. "float16": each kept value is copied, rounded to fp16, as soon as it is computed
    (a stash, placed by the schedule right after it), and the backward reads that copy widened, so
    the fp32 original dies with its last forward reader: half the bytes kept between the forward and
    the backward, arithmetic in fp32 throughout. The forward's own values are unchanged; the
    gradients are those at the fp16-rounded activations."""
    if dtype not in ("float32", "float16"):
        raise ValueError(f"saved activations: float32 or float16, got {dtype!r}")
    token = _SAVED.set(dtype)
    try:
        yield
    finally:
        _SAVED.reset(token)


# rules whose reads of the forward go through the stash (sources, and the output where the rule
# reads
# its value); the others (comparisons, max, where) would compare an fp16 copy with an fp32 value
_READS_SOURCES = frozenset({"mul", "div", "matmul", "exp", "log", "sqrt", "rsqrt", "tanh", "recip",
                            "sin", "cos"})
_READS_OUTPUT = _READS_SOURCES - {"matmul", "mul", "log", "sin", "cos"}


class _Kept:
    """How one grad() call's rules read forward values: as they are, or (float16) through one
    stash per value. A value is stashed only where the schedule would store it anyway (a kernel's
    output, an operand of a hand-written kernel, a value several kernels read) and it is no
    per-row statistic (last axis 1): fused expressions are recomputed in the backward, not kept."""

    def __init__(self, loss):
        self.on = _SAVED.get() == "float16"
        self.copies = {}
        if self.on:
            self.stored = materialized(walk([loss]))

    def __call__(self, s: Tensor) -> Tensor:
        if not self.on or s.dtype != "float32" or not s.shape or s.shape[-1] == 1:
            return s
        b = base_of(s)
        if b.op in ("buffer", "input") or id(b) not in self.stored:
            return s
        if id(s) not in self.copies:
            stash = Tensor("cast", (s,), "stash", shape=s.shape, dtype="float16",
                           requires_grad=s.requires_grad)
            self.copies[id(s)] = stash.float()
        return self.copies[id(s)]


def with_gradient(out: Tensor, sources, rule) -> Tensor:
    """Give `out` (any graph computed from `sources`) an explicit backward: rule(g, *sources) -> one
    gradient per source. The backward then reads the sources only, so out's intermediate nodes have
    no reader after the forward and are fused away instead of kept (SwiGLU keeps gate and up, not
    the five tensors its composite rules would read)."""
    out.backward = (tuple(sources), rule)
    return out


class _After(CustomOp):
    """The value of its first source, available only once every other source is computed: a copy
    that makes the schedule compute those sources in the forward pass."""
    name = "after"

    def record(self, rec, out, srcs):
        rec.copy(srcs[0], out, out.nbytes)


def rowwise(fn, x: Tensor, *consts: Tensor):
    """y = fn(x, *consts), shape (R,), where y[r] depends on row x[r] alone and the consts need no
    gradient (labels, a frozen head's weights, cached base logits). The gradient rows
    J = d(sum y)/dx are computed in the same pass as y, so the backward is g[:, None] * J and fn's
    intermediates die in the forward: an LM head's (R, vocab) logits and softmax are never kept
    for the backward (the head + loss fusion of the training step). fn may return (y, *aux):
    per-row values for reporting, returned beside y and not meant to be differentiated."""
    if any(c.requires_grad for c in consts):
        raise ValueError("rowwise: only x may need a gradient")
    res = fn(x, *consts)
    y, aux = (res[0], tuple(res[1:])) if isinstance(res, tuple) else (res, ())
    if y.shape != x.shape[:1]:
        raise ShapeError(f"rowwise: fn gave {y.shape}, expected one value per row of x {x.shape}")
    if x.requires_grad:
        with saved_activations("float32"):          # J is computed with y: nothing is kept
            J = grad(y.sum(), [x], local=True)[0]
        # J, y and the report rows wait for one another: whichever a program reads first (the
        # backward
        # J, or a loss to report), all are computed together and fn's intermediates (a chunk's
        # logits) die there, not held until a later reader
        Jw = custom(_After(), [J, y, *aux], J.shape, requires_grad=False)
        y = with_gradient(custom(_After(), [y, J], y.shape), (x,),
                          lambda g, x: (g.reshape(-1, *(1,) * (x.ndim - 1)) * Jw,))
        aux = tuple(custom(_After(), [a, J], a.shape, a.dtype, requires_grad=False) for a in aux)
    return (y,) + aux if isinstance(res, tuple) else y


def checkpoint(fn, x: Tensor, params=()):
    """y = fn(x), keeping none of fn's intermediates for the backward: the backward computes fn
    again from x (activation checkpointing) and differentiates that copy. params: the trainable
    tensors fn reads (a layer's adapters), whose gradients come from the recomputation. The copy
    reads x through an `after` node that waits for y's upstream gradient, so the schedule runs it
    in the backward pass, just before it is needed, instead of beside the forward."""
    y = fn(x)
    wrt = [x] * x.requires_grad + [p for p in params if p.requires_grad]
    if not wrt:
        return y

    def rule(g, x, *ps):
        xr = custom(_After(), [x, g], x.shape, requires_grad=x.requires_grad)
        grads = iter(grad(fn(xr), [xr] * x.requires_grad + [p for p in ps if p.requires_grad],
                          upstream=g, local=True))
        return tuple(next(grads) if s.requires_grad else None for s in (x, *ps))
    return with_gradient(y, (x, *params), rule)


def _sources(t):
    return t.backward[0] if t.backward is not None else t.src


def _topo(root, stop=frozenset()):
    order, seen = [], set()
    stack = [(root, False)]
    while stack:
        t, done = stack.pop()
        if done:
            order.append(t)
            continue
        if id(t) in seen or not t.requires_grad:
            continue
        seen.add(id(t))
        stack.append((t, True))
        if id(t) not in stop:
            stack.extend((s, False) for s in _sources(t) if s.requires_grad)
    return order


def grad(loss: Tensor, params, upstream: Tensor | None = None, local: bool = False) -> list[Tensor]:
    """Gradients of loss (a scalar, or sum(loss * upstream)) w.r.t. params, as lazy tensors.
    local: do not walk below the params (a custom op's backward asking about its own inputs,
    which are independent of one another; the outer grad carries on from there)."""
    if upstream is None and loss.size != 1:
        raise ValueError(f"grad needs a scalar loss (or an upstream gradient), got shape "
                         f"{loss.shape}")
    for p in params:
        if not p.requires_grad:
            raise ValueError(f"grad: {p} does not require a gradient (frozen tensors get none)")
    grads = {id(loss): upstream if upstream is not None else Tensor.const(1.0, loss.shape)}
    wanted, found = frozenset(id(p) for p in params), {}
    kept = _Kept(loss)
    for t in reversed(_topo(loss, wanted if local else frozenset())):
        g = grads.pop(id(t), None)
        if g is not None and id(t) in wanted:
            found[id(t)] = g            # params may be inner nodes too (a custom op's inputs)
        elif g is not None and t.op == "buffer" and t.arg == "realized":
            raise ValueError(f"grad: {t} on the way from the loss to the parameters was read "
                             f"(numpy()) before grad, which drops the graph below it; take the "
                             f"gradients first")
        if g is None or not _sources(t) or (local and id(t) in wanted):
            continue
        if t.backward is not None:
            srcs, explicit = t.backward
            pairs = zip(srcs, explicit(g, *map(kept, srcs)))
        elif t.op == "custom":          # its backward reads its output as a value too
            pairs = zip(t.src, t.arg.backward(kept(t), g, *map(kept, t.src)))
        else:
            rule = GRADIENTS.get(t.op)
            if rule is None:
                raise NotImplementedError(f"no gradient rule for op {t.op}")
            out = kept(t) if t.op in _READS_OUTPUT else t
            pairs = zip(t.src, rule(out, g, *(map(kept, t.src) if t.op in _READS_SOURCES
                                              else t.src)))
        for s, gs in pairs:
            if gs is None or not s.requires_grad:
                continue
            if gs.shape != s.shape:
                raise RuntimeError(f"internal: gradient rule for {t.op} gave {gs.shape} for a "
                                   f"{s.shape} source")
            grads[id(s)] = grads[id(s)] + gs if id(s) in grads else gs
    return [found.get(id(p), Tensor.zeros(p.shape)) for p in params]


def scatter_add(g: Tensor, idx: Tensor, n_rows: int) -> Tensor:
    """out[v] = sum of g rows whose index is v: the embedding gradient, as a one-hot matmul
    (exact in fp32 for the small tables it is used on; the trainer keeps embeddings frozen)."""
    onehot = idx.reshape(-1, 1).eq(Tensor.arange(n_rows))        # (n, V)
    return onehot.transpose(-1, -2).contiguous() @ g.reshape(-1, g.shape[-1])
