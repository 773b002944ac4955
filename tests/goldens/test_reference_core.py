"""The core ops' references against independent computations (math, fsum loops, einsum)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from vkdsl_golden import reference as R
from vkdsl_golden.store import load_case

from golden_common import (_case, _close, cases, f64, ids)


# =======================================================================================
# phase 1 references vs independent computations
# =======================================================================================

MATH1 = {"neg": lambda v: -v, "exp": math.exp, "log": math.log, "sqrt": math.sqrt,
         "rsqrt": lambda v: 1.0 / math.sqrt(v), "tanh": math.tanh}
PY2 = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
       "div": lambda a, b: a / b, "maximum": max, "cmplt": lambda a, b: 1.0 if a < b else 0.0}


@pytest.mark.parametrize("c", [c for c in cases() if c["op"] in MATH1], ids=ids)
def test_unary_vs_math(c):
    a = load_case(c)
    want = np.vectorize(MATH1[c["op"]], otypes=[f64])(a["in0"].astype(f64))
    _close(a["out"], want, 4e-16 if c["op"] in ("neg", "sqrt") else 1e-15)


@pytest.mark.parametrize("c", [c for c in cases() if c["op"] in PY2 or c["op"] == "where"], ids=ids)
def test_binary_where_vs_python_scalars(c):
    a = load_case(c)
    ins = np.broadcast_arrays(*[a[k].astype(f64) for k in c["inputs"]])
    if c["op"] == "where":
        fn = lambda cnd, x, y: x if cnd != 0 else y  # noqa: E731
    else:
        fn = PY2[c["op"]]
    want = np.array([fn(*map(float, t)) for t in zip(*(x.ravel() for x in ins))]).reshape(ins[0].shape)
    assert a["out"].shape == want.shape
    assert np.array_equal(a["out"], want)   # +,-,*,/ in float64 are exactly the IEEE ops


def test_cmplt_has_no_ties_and_ulp_case_is_exact():
    for c in cases("cmplt"):
        a = load_case(c)
        assert not np.any(np.broadcast_arrays(a["in0"], a["in1"])[0] == np.broadcast_arrays(a["in0"], a["in1"])[1])
    a = load_case(_case(None, "cmplt[1023+1023,ulp]"))
    assert np.array_equal(a["out"], (a["in1"] > a["in0"]).astype(f64))
    assert 0.3 < a["out"].mean() < 0.7


@pytest.mark.parametrize("c", [c for c in cases() if c["op"] in ("sum", "max", "mean")], ids=ids)
def test_reductions_vs_fsum_loops(c):
    a = load_case(c)
    x = np.moveaxis(a["in0"].astype(f64), c["params"]["axis"], -1)
    rows = x.reshape(-1, x.shape[-1])
    fn = {"sum": math.fsum, "max": max, "mean": lambda r: math.fsum(r) / len(r)}[c["op"]]
    want = np.array([fn(list(r)) for r in rows]).reshape(x.shape[:-1])
    assert np.array_equal(a["out"], want)


def test_reductions_vs_numpy_and_divide_exactness():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 6, 7))
    for ax in range(3):
        _close(R.reduce_sum(x, ax), np.sum(x, ax), 1e-12)
        _close(R.reduce_mean(x, ax), np.mean(x, ax), 1e-12)
        assert np.array_equal(R.reduce_max(x, ax), np.max(x, ax))
    # fsum is exact where naive float64 summation is not
    assert float(R.exact_sum(np.array([1e16, 1.0, -1e16]))) == 1.0


@pytest.mark.parametrize("c", cases("matmul") + cases("matmul_f16in"), ids=ids)
def test_matmul_vs_einsum(c):
    a = load_case(c)
    A, B = a["in0"].astype(f64), a["in1"].astype(f64)
    if c["op"] == "matmul_f16in":            # the golden of fp16 inputs: numpy's rounding, then exact
        A, B = (x.astype(np.float32).astype(np.float16).astype(f64) for x in (a["in0"], a["in1"]))
        assert np.abs(A - a["in0"]).max() > 0           # the rounding changed something
    p = c["params"]
    sa = "bkm" if p["ta"] else "bmk"
    sb = "bnk" if p["tb"] else "bkn"
    if not p.get("batch"):
        sa, sb = sa[1:], sb[1:]
    spec = f"{sa},{sb}->{'b' if p.get('batch') else ''}mn"
    want = np.einsum(spec, A, B)
    bound = np.einsum(spec, np.abs(A), np.abs(B)) * 1e-13   # einsum's own rounding
    assert a["out"].shape == want.shape
    assert np.all(np.abs(a["out"] - want) <= bound + 1e-300)


def test_matmul_transposes_are_layouts_not_values():
    rng = np.random.default_rng(1)
    A, B = rng.standard_normal((3, 5)), rng.standard_normal((5, 4))
    ref = R.matmul(A, B)
    assert np.array_equal(R.matmul(A.T.copy(), B, ta=True), ref)
    assert np.array_equal(R.matmul(A, B.T.copy(), tb=True), ref)
    assert np.array_equal(R.matmul(A.T.copy(), B.T.copy(), ta=True, tb=True), ref)


@pytest.mark.parametrize("c", cases("permute") + cases("gather"), ids=ids)
def test_permute_and_gather_by_index_loops(c):
    a = load_case(c)
    x = a["in0"].astype(f64)
    if c["op"] == "permute":
        axes = c["params"]["axes"]
        assert a["out"].shape == tuple(x.shape[i] for i in axes)
        for idx in np.ndindex(a["out"].shape):
            src = [0] * x.ndim
            for i, ax in enumerate(axes):
                src[ax] = idx[i]
            assert a["out"][idx] == x[tuple(src)]
    else:
        for r, i in enumerate(a["in1"]):
            assert np.array_equal(a["out"][r], x[int(i)])


def test_fused_chain_vs_math():
    c = _case(None, "fused_chain[33x1023+1023+33x1]")
    a = load_case(c)
    A, B, C = np.broadcast_arrays(*(a[k].astype(f64) for k in c["inputs"]))
    want = [math.tanh(x * y + z) - math.exp(-x) for x, y, z in zip(A.ravel(), B.ravel(), C.ravel())]
    np.testing.assert_allclose(a["out"].ravel(), want, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("c", cases("softmax") + cases("log_softmax"), ids=ids)
def test_softmax_properties(c):
    a = load_case(c)
    x = a["in0"].astype(f64)
    p = a["out"] if c["op"] == "softmax" else np.exp(a["out"])
    assert np.all(np.abs([math.fsum(r) - 1.0 for r in p]) < 1e-14)     # rows sum to 1
    assert np.all(p[np.isneginf(x)] == 0.0)
    if c["op"] == "log_softmax":
        assert np.array_equal(np.isneginf(a["out"]), np.isneginf(x))
    # independent per-row: p_j = 1 / sum_k exp(x_k - x_j), exact sums
    for r in range(min(x.shape[0], 3)):
        row = x[r]
        fin = np.isfinite(row)
        j = int(np.argmax(row))
        want = 1.0 / math.fsum(math.exp(v - row[j]) for v in row[fin])
        _close(p[r, j], want, 1e-13)
