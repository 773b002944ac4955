"""Elementary functions built only from IEEE-exact operations (+ - * /, rint, frexp, ldexp).

Why: numpy's exp/log/tanh/power/logaddexp dispatch to CPU-specific SIMD code (AVX2, AVX-512,
SVML) whose last float64 bit differs between machines, so golden files regenerated on
another CPU would not be byte-identical. Every step here is a single correctly rounded
IEEE operation, so the results are the same bits on every platform.
Accuracy: a few float64 ulps (tests check them against Python's math module), far below
anything a float32 device result can resolve.
"""
from __future__ import annotations

import math

import numpy as np

# Cody-Waite split of ln 2 and pi/2 (fdlibm constants): the high parts have trailing zero
# bits, so k * high is exact for the k that occur here.
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e+00
PIO2_1 = 1.57079632673412561417e+00
PIO2_2 = 6.07710050630396597660e-11
PIO2_2T = 2.02226624879595063154e-21
TWO_OVER_PI = 6.36619772367581382433e-01
SQRT_HALF = 0.70710678118654752440

_INV_FACT = [1.0 / math.factorial(k) for k in range(0, 24)]   # correctly rounded 1/k!


def _f64(x) -> np.ndarray:
    """float64 ndarray copy-free cast."""
    return np.asarray(x, dtype=np.float64)


def _horner(r: np.ndarray, coefs) -> np.ndarray:
    """sum_k coefs[k] * r**k by Horner's rule (coefs from low to high degree)."""
    acc = np.full_like(r, coefs[-1])
    for c in reversed(coefs[:-1]):
        acc = acc * r + c
    return acc


def _reduce_ln2(x: np.ndarray):
    """x = k ln2 + r with |r| <= ln2/2 (k as int64, x already finite and clipped)."""
    k = np.rint(x * INV_LN2)
    r = (x - k * LN2_HI) - k * LN2_LO
    return k.astype(np.int64), r


def _expm1_small(r: np.ndarray) -> np.ndarray:
    """expm1(r) for |r| <= 0.35: r * (1 + r/2! + r^2/3! + ...), relative accuracy kept for tiny
    r."""
    return r * _horner(r, _INV_FACT[1:18])


def exp(x) -> np.ndarray:
    """e**x; exp(-inf) = 0, overflow gives inf."""
    x = _f64(x)
    xc = np.clip(np.where(np.isnan(x), 0.0, x), -746.0, 710.0)
    k, r = _reduce_ln2(xc)
    with np.errstate(over="ignore"):
        out = np.ldexp(1.0 + _expm1_small(r), k)
    return np.where(np.isnan(x), np.nan, out)


def expm1(x) -> np.ndarray:
    """e**x - 1, accurate for tiny |x| too."""
    x = _f64(x)
    xc = np.clip(np.where(np.isnan(x), 0.0, x), -746.0, 710.0)
    k, r = _reduce_ln2(xc)
    em = _expm1_small(r)
    # 2^k (1 + em) - 1 = 2^k em + (2^k - 1); the second term is exact for k <= 53
    with np.errstate(over="ignore", invalid="ignore"):
        big = np.ldexp(em, k) + (np.ldexp(1.0, k) - 1.0)
    out = np.where(k == 0, em, big)
    return np.where(np.isnan(x), np.nan, out)


def log(x) -> np.ndarray:
    """Natural log; log(0) = -inf, log(inf) = inf, negative -> nan."""
    x = _f64(x)
    ok = np.isfinite(x) & (x > 0)
    m, e = np.frexp(np.where(ok, x, 1.0))          # x = m 2^e, m in [0.5, 1)
    low = m < SQRT_HALF
    m = np.where(low, m * 2.0, m)                   # m in [sqrt(1/2), sqrt(2))
    e = np.where(low, e - 1, e).astype(np.float64)
    f = m - 1.0                                     # exact (Sterbenz)
    s = f / (2.0 + f)                               # log(m) = 2 atanh(s), |s| < 0.172
    z = s * s
    tail = z * _horner(z, [1.0 / (2 * j + 3) for j in range(12)])   # z/3 + z^2/5 + ...
    out = e * LN2_HI + ((f - s * (f - 2.0 * tail)) + e * LN2_LO)   # 2s(1+tail) = f - s(f - 2 tail)
    out = np.where(ok, out, np.nan)
    out = np.where(x == 0, -np.inf, out)
    return np.where(x == np.inf, np.inf, out)


def log1p(y) -> np.ndarray:
    """log(1 + y) accurate for tiny y (Goldberg: log(u) * y / (u - 1), u = 1 + y)."""
    y = _f64(y)
    u = 1.0 + y
    d = u - 1.0
    with np.errstate(invalid="ignore", divide="ignore"):
        out = log(u) * (y / np.where(d == 0, 1.0, d))
    return np.where(d == 0, y, out)


def tanh(x) -> np.ndarray:
    """tanh via expm1: t / (t + 2), t = expm1(2|x|); exactly +-1 beyond |x| = 20."""
    x = _f64(x)
    a = np.minimum(np.abs(x), 20.0)
    t = expm1(2.0 * a)
    y = np.where(np.abs(x) >= 20.0, 1.0, t / (t + 2.0))
    return np.where(np.isnan(x), np.nan, np.copysign(y, x))


def softplus(x) -> np.ndarray:
    """log(1 + e**x) without overflow: max(x, 0) + log1p(e**-|x|)."""
    x = _f64(x)
    return np.maximum(x, 0.0) + log1p(exp(-np.abs(x)))


def sigmoid(x) -> np.ndarray:
    """1 / (1 + e**-x) from e = exp(-|x|) <= 1: 1/(1+e) for x >= 0, e/(1+e) below (no overflow)."""
    x = _f64(x)
    e = exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _sincos_reduced(a: np.ndarray):
    """(sin r, cos r, quadrant) with a = k pi/2 + r, |r| <= pi/4 (fine for |a| < 2^19)."""
    k = np.rint(a * TWO_OVER_PI)
    r = ((a - k * PIO2_1) - k * PIO2_2) - k * PIO2_2T
    z = r * r
    s = r * _horner(z, [(-1) ** j * _INV_FACT[2 * j + 1] for j in range(11)])
    c = _horner(z, [(-1) ** j * _INV_FACT[2 * j] for j in range(11)])
    return s, c, (k.astype(np.int64) % 4)


def sin(a) -> np.ndarray:
    """sin(a) for moderate |a| (rope angles)."""
    a = _f64(a)
    if np.any(np.abs(a) >= 2.0 ** 19):
        raise ValueError("sin: |angle| too large for this reduction")
    s, c, q = _sincos_reduced(a)
    return np.choose(q, [s, c, -s, -c])


def cos(a) -> np.ndarray:
    """cos(a) for moderate |a| (rope angles)."""
    a = _f64(a)
    if np.any(np.abs(a) >= 2.0 ** 19):
        raise ValueError("cos: |angle| too large for this reduction")
    s, c, q = _sincos_reduced(a)
    return np.choose(q, [c, -s, -c, s])


def pow_pos(base: float, y) -> np.ndarray:
    """base ** y for base > 0, as exp(y * log(base))."""
    return exp(_f64(y) * log(np.float64(base)))
