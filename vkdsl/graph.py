"""The graph's vocabulary: the closed set of primitive ops, the matmul node's argument, and the
walks every later stage (autograd, schedule, render, realize) shares. Imports nothing of vkdsl,
so the core flows one way: tensor -> graph <- schedule <- realize."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

UNARY = ("neg", "exp", "log", "sqrt", "rsqrt", "tanh", "recip", "sin", "cos")
BINARY = ("add", "sub", "mul", "div", "max", "cmplt", "cmpeq")
VIEWS = ("reshape", "permute", "expand", "slice", "pad")
LEAVES = ("buffer", "input", "const", "iota")
KERNEL_OPS = ("reduce", "matmul", "gather", "custom")     # nodes computed by a kernel of their own
ELEMENTWISE = UNARY + BINARY + ("where", "contiguous", "cast")
DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.int32): "int32"}
# float16 is a storage type (Tensor.half): values are widened to fp32 as they are read, and
# arithmetic on them is fp32; only a cast makes one
NP_DTYPE = {"float32": np.float32, "int32": np.int32, "float16": np.float16}
ITEMSIZE = {"float32": 4, "int32": 4, "float16": 2}


class MatmulArg(NamedTuple):
    """A matmul node's argument: sources are stored transposed (ta, tb); `batch` output matrices;
    batch_a / batch_b matrices in each source (1 = one matrix shared across the batch)."""
    ta: bool
    tb: bool
    batch: int
    batch_a: int
    batch_b: int
    precision: str = "fp32"       # vkdsl.precision: fp32, or fp16 inputs with fp32 accumulation


def walk(roots):
    """Nodes reachable from roots in dependency order (sources first); stops at leaves."""
    order, seen = [], set()
    stack = [(r, False) for r in reversed(roots)]
    while stack:
        t, done = stack.pop()
        if done:
            order.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        if t.op not in ("buffer", "input"):
            stack.extend((s, False) for s in reversed(t.src))
    return order


def base_of(t):
    """Follow views down to the node that holds the data."""
    while t.op in VIEWS:
        t = t.src[0]
    return t


def reshape_base(t):
    """Follow reshapes only: a reshape of a buffer aliases that buffer."""
    while t.op == "reshape":
        t = t.src[0]
    return t
