"""Graph -> ordered kernel steps. Decides which nodes get a buffer (materialize), fuses the
rest into their consumers, and lists each step's inputs."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .graph import ELEMENTWISE, KERNEL_OPS, VIEWS, base_of, walk


@dataclass
class Step:
    kind: str                         # elementwise | reduce | gather | matmul | custom | assign
    node: object                      # the Tensor computed (for assign: the value expression)
    inputs: list = field(default_factory=list)   # materialized tensors read, in binding order
    target: object = None             # assign: the realized Tensor written


def plan(outputs: list, assigns: list[tuple]):
    """Returns (steps, materialized): steps in execution order; materialized = set of ids of
    nodes that own (or alias) a buffer."""
    roots = list(outputs) + [v for _, v in assigns]
    # last outputs first: a gradient program lists its parameters in layer order, and the last
    # layer's come ready first
    order = _stashes_early(walk(roots[::-1]))
    mat = materialized(order, outputs)
    targets = {id(tg) for tg, _ in assigns}
    steps = []
    for t in order:
        if id(t) not in mat or t.op in ("buffer", "input"):
            continue
        if t.op == "reshape" and id(base_of(t)) in mat and _only_reshapes(t):
            continue                               # aliases its source's buffer
        steps.append(Step(_kind(t), t, leaves_of(t, mat)))
    for target, value in assigns:
        reads = [l for l in leaves_of(value, mat) if id(l) in targets]
        direct = (id(value) not in mat and all(l is target for l in reads)
                  and _identity_reads(value, target))
        if not direct and id(value) not in mat:    # compute into a temporary before any write lands
            mat.add(id(value))
            steps.append(Step(_kind(value), value, leaves_of(value, mat)))
        steps.append(Step("assign", value, [value] if id(value) in mat else leaves_of(value, mat),
                          target))
    _check_assign_order(steps)
    return steps, mat


def materialized(order, outputs=()) -> set:
    """Ids of the nodes of `order` (sources first) that get a buffer: kernels' outputs and whatever
    a hand-written kernel reads, elementwise nodes read by several kernels, stashes, the outputs;
    every other elementwise node is fused into its readers."""
    uses, out_ids = {}, {id(t) for t in outputs}
    for t in order:
        # a view is read where its readers read it (an output view by its own copy), so a chain
        # of views is one use, not one per view; a broadcast stays a use of its own, so what is
        # broadcast is computed once, not once per element it is read at
        if t.op in VIEWS and t.op != "expand" and id(t) not in out_ids:
            continue
        for s in t.src:
            b = base_of(s)        # a view's consumers are its data node's consumers
            uses[id(b)] = uses.get(id(b), 0) + 1
    mat = {id(t) for t in order if t.op in ("buffer", "input", "contiguous") or t.op in KERNEL_OPS
           or is_stash(t)}
    mat |= {id(t) for t in outputs}
    for t in order:
        if t.op in ("matmul", "gather", "custom"):
            mat |= {id(s) for s in t.src}          # hand-written kernels read whole buffers
        if t.op in ELEMENTWISE and uses.get(id(t), 0) > 1 and not _is_mask(t, mat):
            mat.add(id(t))                         # computed once, read by several kernels
    _bound_fused_reads(order, mat)
    return mat


MASK_OPS = ("cmpeq", "cmplt", "where", "cast") + VIEWS + ("iota", "const")
EXPANSION = 16           # a mask this many times larger than what it reads is recomputed, not kept


def _is_mask(t, mat) -> bool:
    """Whether elementwise t is a mask (comparisons and selections, exact in any kernel) expanded
    from far smaller tensors, such as an LM head's one-hot labels (rows x vocabulary from one label
    per row): each reader recomputes it from those instead of reading a stored copy, and no pass
    writes it. A stored copy's write and reads cost more than the comparisons they replace."""
    reads, stack, seen = 0, [t], set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n is not t and (id(n) in mat or n.op in KERNEL_OPS):
            reads += math.prod(base_of(n).shape)
        elif n.op not in MASK_OPS:
            return False
        else:
            stack.extend(n.src)
    return reads * EXPANSION <= math.prod(t.shape)


MAX_FUSED_READS = 24     # buffers one generated kernel reads: llvmpipe binds at most 32 per shader


def _bound_fused_reads(order, mat):
    """Materialize partial expressions where a fused kernel would read more than MAX_FUSED_READS
    buffers (the chunked head's gradient rows, concatenated by pads and adds: one per chunk), so no
    generated kernel binds more buffers than a driver takes (past llvmpipe's 32 it crashed)."""
    fused = {}                          # buffers the expression rooted at a node reads when fused

    def cost(s):
        return 1 if id(s) in mat or s.op == "reduce" else fused.get(id(s), 0)
    for t in order:
        fused[id(t)] = sum(cost(s) for s in t.src)
        if t.op in KERNEL_OPS or fused[id(t)] <= MAX_FUSED_READS:
            continue
        for s in sorted(t.src, key=cost, reverse=True):     # the widest operands get buffers first
            if cost(s) > 1:
                mat.add(id(s))
                fused[id(t)] = sum(cost(x) for x in t.src)
                if fused[id(t)] <= MAX_FUSED_READS:
                    break


def is_stash(t) -> bool:
    """A forward value's fp16 copy that a backward reads (vkdsl.autograd.saved_activations)."""
    return t.op == "cast" and t.arg == "stash"


def _stashes_early(order):
    """Each stash right after its source, instead of where the backward first reads it: the fp32
    original then dies with its last forward reader, not in the backward. After the source itself,
    not its data's node: a view a hand-written kernel reads is a copy of its own, made where the
    view stands (a LoRA U = x A stored transposed, read by the fused product)."""
    early = {}
    for t in order:
        if is_stash(t):
            early.setdefault(id(t.src[0]), []).append(t)
    if not early:
        return order
    out = []
    for t in order:
        if not is_stash(t):
            out.append(t)
            out.extend(early.get(id(t), ()))
    return out


def _only_reshapes(t):
    while t.op == "reshape":
        t = t.src[0]
    return t.op not in VIEWS


def _kind(t):
    return t.op if t.op in KERNEL_OPS else "elementwise"


def leaves_of(t, mat: set) -> list:
    """Materialized tensors an elementwise expression rooted at t reads (t itself excluded)."""
    out, seen = [], set()

    def visit(n, top):
        if id(n) in seen:
            return
        seen.add(id(n))
        if not top and id(n) in mat:
            out.append(n)
            return
        if n.op == "reduce" and not top:
            out.append(n)
            return
        for s in n.src:
            visit(s, False)
    visit(t, True)
    return out


def _identity_reads(value, target):
    """True when no view lies between value and target: every read of target in the fused
    expression is at the element being written, so the write can happen in place."""
    nodes = walk([value])
    reaches = set()                     # nodes from which target can be reached
    for n in nodes:                     # sources come first
        if n is target or any(id(s) in reaches for s in n.src):
            reaches.add(id(n))
    return not any(n.op in VIEWS and id(n.src[0]) in reaches for n in nodes)


def _check_assign_order(steps):
    written = set()
    for s in steps:
        if s.kind == "assign":
            written.add(id(s.target))
        elif any(id(i) in written for i in s.inputs):
            raise RuntimeError("internal: a step reads a tensor after it was assigned")
