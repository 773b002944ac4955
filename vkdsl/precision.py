"""Matmul precision: fp32 (the default: fp32 inputs and accumulation) or fp16 (inputs rounded to
fp16, products and sums in fp32 — what tensor cores and cooperative matrices compute).

The precision is read when a matmul is traced and kept in its node, so a program's kernels do not
change under it later, and a matmul's gradients use the precision of the forward they belong to:

    with vkdsl.matmul_precision("fp16"):
        y = x @ w                       # realized by an fp16-input kernel (vkdsl.matmul)

$VKDSL_PRECISION sets the process default; vkdsl-train's `precision` setting and `vkdsl bench
matmul --precision` choose for their own run.
Both the fp32-weight matmul and the quantized-weight ones follow it; elementwise ops, reductions
and attention's fused kernels are fp32 under both."""
from __future__ import annotations

import contextlib
import os

PRECISIONS = ("fp32", "fp16")
_stack: list[str] = []


class PrecisionError(ValueError):
    pass


def check(p: str, what: str = "precision") -> str:
    if p not in PRECISIONS:
        raise PrecisionError(f"{what} {p!r} is not known; expected one of {', '.join(PRECISIONS)}")
    return p


def current() -> str:
    """The precision a matmul traced now gets: the innermost matmul_precision(), else
    $VKDSL_PRECISION."""
    if _stack:
        return _stack[-1]
    return check(os.environ.get("VKDSL_PRECISION", "").strip() or "fp32", "VKDSL_PRECISION")


@contextlib.contextmanager
def matmul_precision(p: str):
    _stack.append(check(p))
    try:
        yield
    finally:
        _stack.pop()
