"""Shared by the golden tests: the stored cases, their pytest ids, tolerances' helpers."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from vkdsl_golden import generate as G
from vkdsl_golden.store import DATA_ROOT, iter_cases

GOLDEN_DIR = Path(G.__file__).resolve().parent
V1 = DATA_ROOT / "v1"
f64 = np.float64
rng0 = np.random.default_rng


PHASE1_OPS = {"neg", "exp", "log", "sqrt", "rsqrt", "tanh", "add", "sub", "mul", "div",
              "maximum", "cmplt", "where", "sum", "max", "mean", "matmul", "permute", "gather",
              "fused_chain", "softmax", "log_softmax"}
PHASE2_OPS = {"cross_entropy", "lora_linear", "rmsnorm", "rope", "silu", "swiglu", "attention",
              "kl", "tmkl", "dpo", "adamw", "clip_grad_norm", "int4_roundtrip", "nf4_roundtrip",
              "dequant_q8_0", "dequant_q4_0", "dequant_q4_1", "dequant_f16", "dequant_q4_k", "dequant_q5_k",
              "dequant_q6_k", "matmul_f16in", "qmatmul_f16in", "half", "gated_delta", "tri_inverse", "matmul_block",
              "qgather", "qlora_linear", "qlinear"}


def _case(root, name):
    return next(c for c in iter_cases(root=root) if c["name"] == name)


def cases(op=None):
    """Stored cases, optionally of one op."""
    return [c for c in iter_cases() if op is None or c["op"] == op]


def ids(c):
    """pytest id of a case parameter: its name."""
    return c["name"]


def _close(got, want, rel=1e-14):
    want = np.asarray(want, f64)
    np.testing.assert_allclose(got, want, rtol=rel, atol=0)



def _loss(fn, g):
    """Scalar L = sum(out * g), summed exactly."""
    out = np.asarray(fn(), f64)
    return math.fsum((out * g).ravel().tolist())


def fd_check(fn, x, analytic, g, rel=1e-6):
    """Central differences of sum(fn() * g) w.r.t. every element of x (mutated in place)."""
    fd = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        h = 1e-6 * max(1.0, abs(x[i]))
        old = x[i]
        x[i] = old + h
        lp = _loss(fn, g)
        x[i] = old - h
        lm = _loss(fn, g)
        x[i] = old
        fd[i] = (lp - lm) / (2 * h)
    scale = max(np.max(np.abs(analytic)), np.max(np.abs(fd)))
    assert scale > 0
    err = np.max(np.abs(fd - analytic))
    assert err <= rel * scale, f"max |fd - analytic| = {err:.3e}, scale {scale:.3e}"
