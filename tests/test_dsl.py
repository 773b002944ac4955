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


def _cpu_form_cases(rng):
    """(lazy result, float64 reference, exact?) covering every read form of a generated kernel."""
    a, row, col = (rng.standard_normal(s).astype(np.float32) for s in [(8, 256), (256,), (8, 1)])
    sq = rng.standard_normal((16, 16)).astype(np.float32)
    ids = rng.integers(-300, 300, (8, 256)).astype(np.int32)
    odd = rng.integers(-300, 300, (5, 7)).astype(np.int32)
    x = rng.standard_normal((96, 300)).astype(np.float32)
    x[3, 299], x[4, 0], x[5] = np.nan, np.nan, -np.inf
    A, I, X = T(a), T(ids), T(x)
    a64, x64 = a.astype(np.float64), x.astype(np.float64)
    return [
        # vec4 reads (a, row, ids as ivec4), a scalar read (col)
        ((A * T(row) + T(col)) * (I < 10), (a64 * row + col) * (ids < 10), False),
        (T(sq) + T(sq).permute(1, 0), sq.astype(np.float64) + sq.T, False),  # read both ways
        (T(odd) < 4, (odd < 4).astype(np.float64), True),                    # int32 scalar reads
        (I.permute(1, 0).contiguous(), ids.T, True),                         # ... into int32
        (X.sum(-1), x64.sum(-1), False), (X.max(-1), x.max(-1), True),      # a tree per output
        (X[:5].sum(-1), x64[:5].sum(-1), False),                             # too few: workgroups
        (X[:, :50].sum(-1), x64[:, :50].sum(-1), False),                     # short rows: a loop
        (T(np.ascontiguousarray(x.T)).sum(0), x64.sum(1), False),           # a strided tree
        (((A - 1.0) * A).mean(-1), ((a64 - 1.0) * a64).mean(-1), False),     # fused prologue
    ]


@pytest.mark.parametrize("texel_limit,serial", [(1 << 27, True), (1 << 27, False), (0, True),
                                                (1024, True)])
def test_cpu_driver_forms_give_the_storage_kernels_bits(rng, monkeypatch, texel_limit, serial):
    """The CPU-driver forms of the generated kernels (render_step: inputs read as texel buffers,
    r32 for scalar reads and rgba32 for vec4 reads, an input read both ways or beyond the limit
    kept a storage buffer; a reduction's workgroup tree run inside one invocation per output) give
    the bits of the storage, shared-memory forms, and both match float64 numpy (NaN and -inf rows
    included)."""
    from vkdsl import realize, render
    seen = []

    def run(limit, ser):
        def rendered(dev, step):
            seen.append(render.render_step(step, texel_limit=limit, serial=ser))
            return seen[-1]
        monkeypatch.setattr(realize, "_rendered", rendered)
        return [t.numpy() for t, _, _ in _cpu_form_cases(np.random.default_rng(5))]
    base = run(0, False)
    seen.clear()
    got = run(texel_limit, serial)
    for (_, ref, exact), b, g in zip(_cpu_form_cases(np.random.default_rng(5)), base, got):
        assert np.array_equal(b.view(np.uint32), g.view(np.uint32))
        if exact:
            np.testing.assert_array_equal(g, ref)
        else:
            assert nmse(g, ref) < 1e-12
    forms = {f for r in seen for _, f in r.texels}
    big = texel_limit > 2048
    assert forms == ({"r32f", "rgba32f", "r32ui"} | ({"rgba32ui"} if big else set())
                     if texel_limit else set())
    # a, row, col, ids; beyond the limit a and ids stay storage buffers in the same kernel
    first = next(r for r in seen if r.name == "elementwise_8x256")
    assert len(first.texels) == (4 if big else 2 if texel_limit else 0)
    trees = [r for r in seen if r.name.startswith("reduce") and "part[" in r.source]
    assert sum("barrier" not in r.source for r in trees) == (3 if serial else 0)


def test_generated_kernels_read_texels_on_cpu_drivers(rng):
    """The device's own choice (handwritten.texel_limit) reaches the pipelines: on the CPU-driver
    family a generated kernel binds its inputs as texel buffers, elsewhere as storage buffers."""
    from vkdsl.handwritten import texel_limit
    from vkdsl.runtime import default_device
    dev = default_device()
    a = rng.standard_normal((3, 388)).astype(np.float32)
    np.testing.assert_array_equal((T(a) * T(a)).numpy(), a * a)
    k = [k for k in dev.kernels.values() if getattr(k, "name", "") == "elementwise_3x388"]
    assert k and all(bool(x.texels) == (texel_limit(dev) > 0) for x in k)


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


def test_an_expanded_mask_is_recomputed_by_each_reader_not_stored(rng):
    """A one-hot of labels (rows x vocabulary from one label per row) read by two kernels is
    recomputed in each instead of written and read back; a mask no larger than what it reads, and
    an expansion that does arithmetic (its rounding could differ between kernels), are stored."""
    R, V = 6, 40
    labels = rng.integers(0, V, R).astype(np.int32)
    labels[2] = -100
    z = rng.standard_normal((R, V)).astype(np.float32)
    lab, logits = T(labels), T(z)
    hot = lab.reshape(R, 1).eq(Tensor.arange(V))
    picked, rest = (logits * hot).sum(-1), (logits - hot * 3.0).max(-1)
    steps, mat = plan([picked, rest], [])
    assert id(hot) not in mat
    assert [s.kind for s in steps] == ["reduce", "reduce"]
    want = (z.astype(np.float64) * (labels[:, None] == np.arange(V)))
    np.testing.assert_array_equal(picked.numpy(), want.sum(-1).astype(np.float32))
    assert nmse(rest.numpy(), (z - 3.0 * (labels[:, None] == np.arange(V))).max(-1)) < 1e-14
    same_size = logits > 0.0
    _, mat = plan([(logits * same_size).sum(-1), same_size.where(logits, 0.0).max(-1)], [])
    assert id(same_size) in mat
    scaled = hot * Tensor.arange(V)
    _, mat = plan([(logits * scaled).sum(-1), (logits + scaled).max(-1)], [])
    assert id(scaled) in mat


def test_a_chain_of_views_is_one_read_and_a_broadcast_is_computed_once(rng):
    """RoPE reads each rotated half through a reshape and a pad: one reader each, so the whole
    rotation is one kernel (it was three when every view in a chain counted as a reader). A value
    broadcast to its reader stays stored: computed once, not once per element it is read at."""
    from vkdsl.ops import nn
    from vkdsl_golden import reference_train as RT
    x = rng.standard_normal((16, 3, 8)).astype(np.float32)
    pos = np.arange(16)
    cos, sin = (T(a) for a in nn.rope_tables(pos, 8, 10000.0))
    y = nn.rope(T(x), cos, sin)
    steps, _ = plan([y], [])
    assert [s.kind for s in steps] == ["elementwise"]
    assert nmse(y.numpy(), RT.rope(x, pos, 10000.0)) < 1e-12
    a, b = T(rng.standard_normal((6, 1))), T(rng.standard_normal((6, 50)))
    r = (a * 2.0).exp()
    steps, mat = plan([b * r], [])
    assert id(r) in mat and [s.kind for s in steps] == ["elementwise", "elementwise"]
