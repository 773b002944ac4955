"""Float64 numpy references for the core DSL ops (golden version 1).

Rules that make these trustworthy as references:
- numpy only; nothing from vkdsl's core is imported (a reference that shares code with
  what it checks cannot catch its bugs);
- every input is cast to float64 first, so float32 device inputs are upcast exactly;
- sums are computed with math.fsum (correctly rounded), so the result does not depend on
  summation order, BLAS kernels or thread counts: the only rounding left is the final one;
- exp/log/tanh come from golden.elementary (IEEE-exact steps only), not numpy's SIMD code,
  so regenerated files are byte-identical on every CPU.
"""
from __future__ import annotations

import math

import numpy as np

from . import elementary as E

__all__ = [
    "neg", "exp", "log", "sqrt", "rsqrt", "tanh",
    "add", "sub", "mul", "div", "maximum", "cmplt", "where",
    "reduce_sum", "reduce_max", "reduce_mean",
    "matmul", "matmul_f16in", "half", "permute", "gather", "fused_chain", "softmax", "log_softmax",
    "exact_sum", "UNARY", "BINARY", "REDUCE",
]


def _f64(x) -> np.ndarray:
    """Cast to a float64 ndarray (exact for float32/int32 inputs)."""
    return np.asarray(x, dtype=np.float64)


# ---------------------------------------------------------------------------------------
# exact summation (shared by reductions, matmul and softmax)
# ---------------------------------------------------------------------------------------

def exact_sum(x, axis=None, keepdims: bool = False) -> np.ndarray:
    """Correctly rounded float64 sum along `axis` (math.fsum per output element)."""
    x = _f64(x)
    if axis is None:
        out = np.asarray(math.fsum(x.ravel().tolist()))
        return out.reshape((1,) * x.ndim) if keepdims else out
    axis = axis % x.ndim
    moved = np.moveaxis(x, axis, -1)
    rows = moved.reshape(-1, moved.shape[-1]).tolist() if moved.size else []
    flat = np.array([math.fsum(r) for r in rows], dtype=np.float64)
    out = flat.reshape(moved.shape[:-1]) if moved.shape[-1] else np.zeros(moved.shape[:-1])
    return np.expand_dims(out, axis) if keepdims else out


# ---------------------------------------------------------------------------------------
# unary
# ---------------------------------------------------------------------------------------

def neg(x) -> np.ndarray:
    """-x."""
    return -_f64(x)


def exp(x) -> np.ndarray:
    """e**x."""
    return E.exp(_f64(x))


def log(x) -> np.ndarray:
    """Natural log (x > 0)."""
    return E.log(_f64(x))


def sqrt(x) -> np.ndarray:
    """Square root (x >= 0)."""
    return np.sqrt(_f64(x))


def rsqrt(x) -> np.ndarray:
    """1 / sqrt(x) (x > 0)."""
    return 1.0 / np.sqrt(_f64(x))


def tanh(x) -> np.ndarray:
    """Hyperbolic tangent."""
    return E.tanh(_f64(x))


# ---------------------------------------------------------------------------------------
# binary / ternary, numpy broadcasting
# ---------------------------------------------------------------------------------------

def add(a, b) -> np.ndarray:
    """a + b with numpy broadcasting."""
    return _f64(a) + _f64(b)


def sub(a, b) -> np.ndarray:
    """a - b with numpy broadcasting."""
    return _f64(a) - _f64(b)


def mul(a, b) -> np.ndarray:
    """a * b with numpy broadcasting."""
    return _f64(a) * _f64(b)


def div(a, b) -> np.ndarray:
    """a / b with numpy broadcasting (b away from 0)."""
    return _f64(a) / _f64(b)


def maximum(a, b) -> np.ndarray:
    """Elementwise max(a, b) with numpy broadcasting."""
    return np.maximum(_f64(a), _f64(b))


def cmplt(a, b) -> np.ndarray:
    """1.0 where a < b else 0.0, with numpy broadcasting."""
    return (_f64(a) < _f64(b)).astype(np.float64)


def where(cond, x, y) -> np.ndarray:
    """x where cond != 0 else y, with numpy broadcasting of all three."""
    return np.where(_f64(cond) != 0.0, _f64(x), _f64(y))


# ---------------------------------------------------------------------------------------
# reductions (the axis is removed, like numpy's keepdims=False)
# ---------------------------------------------------------------------------------------

def reduce_sum(x, axis: int) -> np.ndarray:
    """Sum along `axis`, correctly rounded."""
    return exact_sum(x, axis)


def reduce_max(x, axis: int) -> np.ndarray:
    """Max along `axis`."""
    return np.max(_f64(x), axis=axis)


def reduce_mean(x, axis: int) -> np.ndarray:
    """Mean along `axis` (exact sum, then one division)."""
    x = _f64(x)
    return exact_sum(x, axis) / x.shape[axis]


# ---------------------------------------------------------------------------------------
# matmul, layout ops
# ---------------------------------------------------------------------------------------

def _mm2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(M,K) @ (K,N) with every output a correctly rounded fsum of K products."""
    m, k = a.shape
    n = b.shape[1]
    out = np.empty((m, n), dtype=np.float64)
    if k == 0:
        out[:] = 0.0
        return out
    bt = b.T  # (N, K)
    for i in range(m):
        prods = (bt * a[i]).tolist()  # N lists of K products
        out[i] = [math.fsum(p) for p in prods]
    return out


def matmul(a, b, ta: bool = False, tb: bool = False, batch: bool = False) -> np.ndarray:
    """op(A) @ op(B); ta: a is stored (..., K, M); tb: b is stored (..., N, K); batch: leading
    dim."""
    a, b = _f64(a), _f64(b)
    if ta:
        a = np.swapaxes(a, -1, -2)
    if tb:
        b = np.swapaxes(b, -1, -2)
    if batch or a.ndim == 3:
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"batch mismatch {a.shape} vs {b.shape}")
        return np.stack([_mm2(a[i], b[i]) for i in range(a.shape[0])])
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dims differ: {a.shape} @ {b.shape}")
    return _mm2(a, b)


def matmul_f16in(a, b, ta: bool = False, tb: bool = False, batch: bool = False) -> np.ndarray:
    """matmul of the inputs rounded to fp16 (round to nearest even), summed exactly: the result an
    fp16-input, fp32-accumulation kernel approaches."""
    return matmul(np.asarray(a, np.float32).astype(np.float16),
                  np.asarray(b, np.float32).astype(np.float16), ta, tb, batch)


def half(x) -> np.ndarray:
    """fp32 -> fp16 by numpy (round to nearest even, overflow to inf), as float64."""
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def permute(x, axes) -> np.ndarray:
    """np.transpose(x, axes): out.shape[i] = x.shape[axes[i]]."""
    return np.ascontiguousarray(np.transpose(_f64(x), tuple(axes)))


def gather(table, idx) -> np.ndarray:
    """Embedding rows: table (V, D), idx int (n,) -> (n, D) = table[idx]."""
    idx = np.asarray(idx)
    t = _f64(table)
    if idx.size and (idx.min() < 0 or idx.max() >= t.shape[0]):
        raise ValueError(f"gather index out of range [0, {t.shape[0]})")
    return t[idx.astype(np.int64)]


def fused_chain(a, b, c) -> np.ndarray:
    """tanh(a*b + c) - exp(-a), broadcasting a, b, c."""
    a, b, c = _f64(a), _f64(b), _f64(c)
    return E.tanh(a * b + c) - E.exp(-a)


# ---------------------------------------------------------------------------------------
# softmax family (rows may contain -inf, never a whole row of it)
# ---------------------------------------------------------------------------------------

def _shifted(x, axis: int):
    """x - rowmax and the exact log-sum-exp of the shifted row."""
    x = _f64(x)
    mx = np.max(x, axis=axis, keepdims=True)
    if not np.all(np.isfinite(mx)):
        raise ValueError("softmax row with no finite entry")
    z = x - mx  # -inf stays -inf, exp(-inf) = 0
    lse = E.log(exact_sum(E.exp(z), axis, keepdims=True))
    return z, lse


def softmax(x, axis: int = -1) -> np.ndarray:
    """exp(x) / sum(exp(x)) along `axis`, computed stably."""
    z, lse = _shifted(x, axis)
    e = E.exp(z)
    return e / exact_sum(e, axis, keepdims=True)


def log_softmax(x, axis: int = -1) -> np.ndarray:
    """x - logsumexp(x) along `axis` (-inf entries stay -inf)."""
    z, lse = _shifted(x, axis)
    return z - lse


UNARY = {"neg": neg, "exp": exp, "log": log, "sqrt": sqrt, "rsqrt": rsqrt, "tanh": tanh}
BINARY = {"add": add, "sub": sub, "mul": mul, "div": div, "maximum": maximum, "cmplt": cmplt}
REDUCE = {"sum": reduce_sum, "max": reduce_max, "mean": reduce_mean}
