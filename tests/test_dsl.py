"""The lazy tensor DSL against numpy float64: elementwise with broadcasting, fusion,
reductions, views, gather, matmul forms, bad input."""
import numpy as np
import pytest

import vkdsl
from vkdsl import ShapeError, Tensor
from vkdsl.schedule import plan

from conftest import nmse

T = vkdsl.tensor


def test_lazy_until_numpy(rng):
    a = T(rng.standard_normal((3, 4)))
    b = (a * 2 + 1).exp()
    assert b.op == "exp" and b.buffer is None         # nothing computed yet
    np.testing.assert_allclose(b.numpy(), np.exp(a.numpy().astype(np.float64) * 2 + 1), rtol=1e-6)
    assert b.op == "buffer"                           # realized into a leaf


def test_elementwise_chain_fuses_into_one_kernel(rng):
    a, b, c = (T(rng.standard_normal(s)) for s in [(33, 1023), (1023,), (33, 1)])
    out = (a * b + c).tanh() - (-a).exp()
    steps, _ = plan([out], [])
    assert [s.kind for s in steps] == ["elementwise"]
    ref = np.tanh(a.numpy() * b.numpy() + c.numpy()) - np.exp(-a.numpy().astype(np.float64))
    assert nmse(out.numpy(), ref) < 1e-12


def test_vector_elementwise_kernels(rng):
    """A last axis divisible by 4 renders 4 elements per invocation with vec4 loads of the leaves
    read at the output's own index (the output's shape, or a broadcast row); every other read
    (a broadcast column, a permuted or sliced or padded view) stays scalar inside the same kernel."""
    from vkdsl import render
    a, row, col = (rng.standard_normal(s).astype(np.float32) for s in [(6, 12), (12,), (6, 1)])
    p = rng.standard_normal((12, 6)).astype(np.float32)
    big = rng.standard_normal((6, 16)).astype(np.float32)
    A, R, C, P, G = T(a), T(row), T(col), T(p), T(big)
    out = ((A * R + C) - P.permute(1, 0)).maximum(G[:, 2:14] * 0.5) + (A > 0.3).where(R, -C) + \
        A.pad(((0, 0), (1, 0)))[:, :12]
    steps, _ = plan([out], [])
    assert steps[-1].kind == "elementwise" and render.vector_elementwise(steps[-1].node)
    src = render.render_step(steps[-1]).source
    assert "b1v[" in src and "b0v[g]" in src, "the vector path must be the one under test"
    a64 = a.astype(np.float64)
    shifted = np.pad(a64, ((0, 0), (1, 0)))[:, :12]
    ref = np.maximum(a64 * row + col - p.T, big[:, 2:14] * 0.5) + np.where(a64 > 0.3, row, -col) + shifted
    assert nmse(out.numpy(), ref) < 1e-13
    ids = T(rng.integers(-5, 300, (8, 4)).astype(np.int32))
    moved = ids.permute(1, 0).contiguous()                       # an int32 vector kernel
    np.testing.assert_array_equal(moved.numpy(), ids.numpy().T)
    n = T(rng.standard_normal((5, 7)).astype(np.float32))        # 7 columns: the scalar kernel
    assert not render.vector_elementwise((n * 2.0).contiguous())


@pytest.mark.parametrize("sa,sb", [((7,), (7,)), ((33, 1023), (1023,)), ((33, 1), (33, 1023)),
                                   ((), (3,)), ((3, 1, 7), (1, 33, 7))])
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "maximum"])
def test_binary_broadcast(rng, sa, sb, op):
    a, b = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32) + 3
    f = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "maximum": np.maximum}[op]
    got = getattr(Tensor, {"add": "__add__", "sub": "__sub__", "mul": "__mul__", "div": "__truediv__",
                           "maximum": "maximum"}[op])(T(a), T(b)).numpy()
    ref = f(a.astype(np.float64), b.astype(np.float64))
    assert got.shape == ref.shape
    assert nmse(got, ref) < 1e-13      # correctly rounded fp32 arithmetic


@pytest.mark.parametrize("shape,axis", [((1,), 0), ((1023,), 0), ((33, 1023), 0), ((33, 1023), 1),
                                        ((3, 7, 33), 1), ((2, 3, 4097), 2), ((5, 6), None)])
def test_reductions(rng, shape, axis):
    a = rng.standard_normal(shape).astype(np.float32)
    a64 = a.astype(np.float64)
    assert nmse(T(a).sum(axis).numpy(), a64.sum(axis)) < 1e-10      # fp32 accumulation of <= 4097 terms
    np.testing.assert_array_equal(T(a).max(axis).numpy(), a.max(axis))
    assert nmse(T(a).mean(axis).numpy(), a64.mean(axis)) < 1e-10


def test_reduce_keepdim_and_softmax_composition(rng):
    x = rng.standard_normal((33, 1023)).astype(np.float32) * 30
    X = T(x)
    e = (X - X.max(-1, keepdim=True)).exp()
    p = (e / e.sum(-1, keepdim=True)).numpy()
    z = x.astype(np.float64) - x.max(-1, keepdims=True)
    ref = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    assert nmse(p, ref) < 1e-10


def test_views(rng):
    a = rng.standard_normal((3, 7, 33)).astype(np.float32)
    A = T(a)
    np.testing.assert_array_equal(A.permute(2, 0, 1).numpy(), a.transpose(2, 0, 1))
    np.testing.assert_array_equal(A.reshape(21, 33).numpy(), a.reshape(21, 33))
    np.testing.assert_array_equal(A.permute(1, 0, 2).reshape(7, -1).numpy(), a.transpose(1, 0, 2).reshape(7, -1))
    np.testing.assert_array_equal(A[1:3, 2, 5:].numpy(), a[1:3, 2, 5:])
    np.testing.assert_array_equal((A.permute(2, 0, 1) * 2).numpy(), a.transpose(2, 0, 1) * 2)


def test_gather_rows_and_bad_index_is_nan_not_a_stray_read(rng):
    table = rng.standard_normal((50, 33)).astype(np.float32)
    idx = np.array([0, 49, 3, 3, 17], np.int32)
    np.testing.assert_array_equal(T(table).gather(T(idx)).numpy(), table[idx])
    out = T(table).gather(T(np.array([50], np.int32))).numpy()
    assert np.isnan(out).all()


@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (3, 7, 33), (33, 1023, 7), (64, 64, 64)])
@pytest.mark.parametrize("form", ["nn", "nt", "tn"])
def test_matmul_forms(rng, M, K, N, form):
    a = rng.standard_normal((K, M) if form == "tn" else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if form == "nt" else (K, N)).astype(np.float32)
    A, B = T(a), T(b)
    out = (A.T if form == "tn" else A) @ (B.T if form == "nt" else B)
    # transposes became flags; a skinny product (N < 32 <= ...) is computed as C^T = B^T A^T, a view
    flipped = N < 32 and M >= 2 * N
    mm = out.src[0] if flipped else out
    assert out.op == ("permute" if flipped else "matmul") and mm.op == "matmul"
    assert mm.arg[:2] == ((form != "nt", form != "tn") if flipped else (form == "tn", form == "nt"))
    ref = (a.T if form == "tn" else a).astype(np.float64) @ (b.T if form == "nt" else b)
    assert nmse(out.numpy(), ref) < 1e-10       # fp32 accumulation of K <= 1023 products


def test_batched_matmul_broadcast_weight(rng):
    x = rng.standard_normal((3, 33, 7)).astype(np.float32)
    w = rng.standard_normal((7, 5)).astype(np.float32)
    assert nmse((T(x) @ T(w)).numpy(), x.astype(np.float64) @ w) < 1e-12


def test_zero_size_tensors(rng):
    a = T(np.zeros((0, 5), np.float32))
    assert (a * 2).numpy().shape == (0, 5)
    np.testing.assert_array_equal(a.sum(0).numpy(), np.zeros(5))
    np.testing.assert_array_equal((T(np.ones((3, 0), np.float32)) @ T(np.ones((0, 4), np.float32))).numpy(),
                                  np.zeros((3, 4)))
    with pytest.raises(ShapeError, match="empty axis"):
        a.max(0)


def test_bad_input_errors(rng):
    a, b = T(np.ones((3, 4), np.float32)), T(np.ones((5, 4), np.float32))
    with pytest.raises(ShapeError, match=r"\(3, 4\) and \(5, 4\) do not broadcast"):
        a + b
    with pytest.raises(ShapeError, match="inner sizes differ"):
        a @ b
    with pytest.raises(TypeError, match="expected a float32 tensor for operand 2"):
        a + T(np.ones(4, np.int32))
    with pytest.raises(TypeError, match="float32 or int32"):
        T(np.array(["x"]))
    with pytest.raises(ShapeError, match="12 elements vs 10"):
        a.reshape(2, 5)


def test_non_contiguous_numpy_input(rng):
    a = rng.standard_normal((8, 6)).astype(np.float32)[:, ::2]      # strided view
    np.testing.assert_array_equal((T(a) * 1).numpy(), a)


def test_assign_updates_in_place(rng):
    w = T(np.arange(6, dtype=np.float32))
    w.assign(w * 2 + 1)
    np.testing.assert_array_equal(w.numpy(), np.arange(6) * 2 + 1)


def test_assign_through_a_view_of_itself(rng):
    # w <- w.T + 1 reads elements the same kernel writes: it must go through a temporary
    a = rng.standard_normal((5, 5)).astype(np.float32)
    w = T(a)
    w.assign(w.permute(1, 0) + 1)
    np.testing.assert_array_equal(w.numpy(), a.T + 1)


@pytest.mark.parametrize("R", [128, 1000, 49152])
def test_workgroup_reductions_against_float64_and_nan(rng, R):
    """Reductions with a workgroup per output: on a GPU (or a GPU profile) with subgroup
    arithmetic each subgroup combines first, else the shared-memory tree runs (lavapipe by
    default; tests/test_profiles.py runs these under the nvidia and minimal profiles too). max
    must propagate NaN as numpy does and -inf stay -inf, wherever in the row they sit."""
    from vkdsl import compiler
    from vkdsl.runtime import default_device
    x = rng.standard_normal((5, R)).astype(np.float32)
    x[1, R - 1] = np.nan                              # last lane of the last subgroup's stride
    x[2, 0] = np.nan
    x[3] = -np.inf
    x[4, R // 2] = 1e30
    mx, sm = T(x).max(axis=-1).numpy(), T(x).sum(axis=-1).numpy()
    ref = x.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(mx), [False, True, True, False, False])
    assert mx[0] == ref[0].max() and mx[3] == -np.inf and mx[4] == np.float32(1e30)
    assert abs(sm[0] - ref[0].sum()) <= 1e-5 * np.abs(ref[0]).sum()
    assert np.isnan(sm[1]) and np.isnan(sm[2]) and sm[3] == -np.inf
    srcs = [src for name, src in compiler.compiled_this_process.values() if name.startswith("reduce_5")]
    from vkdsl.handwritten import default_variant
    dev = default_device()
    uses = any("subgroupMax" in s for s in srcs)
    assert uses == (dev.limits.subgroup_arithmetic and default_variant(dev) == "gpu")
