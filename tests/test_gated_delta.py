"""The gated delta rule (ops/gated_delta.py) against golden/gated_delta.py in float64.

The reference's three forms check each other first (the chunked form against the step-by-step
loop; the loop's hand-derived backward against central differences), then the device's chunked
form (its backward: autograd through the chunk ops and the triangular solve's closed form) and
its step-by-step form against them."""
import numpy as np
import pytest
from conftest import check_op, fd

import vkdsl
from vkdsl.autograd import grad
from vkdsl.ops import gated_delta as gdr
from vkdsl_golden import gated_delta as ref


def draw(rng, B, T, H, dk, dv, state=True, aligned=False):
    """Normalized q and k (as the layer gives them), decays in (-1, 0), write strengths in (0, 1)."""
    k = rng.standard_normal((B, T, H, dk))
    if aligned:                 # every key nearly the same direction: (I + A) far from the identity
        k = k[:, :1] + 0.05 * k
    arrays = [ref.l2norm(rng.standard_normal((B, T, H, dk))), ref.l2norm(k),
              rng.standard_normal((B, T, H, dv)), -rng.uniform(0.01, 1.0, (B, T, H)),
              rng.uniform(0.05, 0.95, (B, T, H)),
              rng.standard_normal((B, H, dk, dv)) if state else None]
    return arrays


@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
def test_reference_chunked_form_is_the_loop(rng, chunk):
    *xs, s0 = draw(rng, 2, 11, 3, 4, 5)
    o1, s1 = ref.recurrent(*xs, state=s0)
    o2, s2 = ref.chunked(*xs, chunk=chunk, state=s0)
    np.testing.assert_allclose(o2, o1, rtol=0, atol=1e-12)
    np.testing.assert_allclose(s2, s1, rtol=0, atol=1e-12)


def test_reference_backward_is_central_differences(rng):
    B, T, H, dk, dv = 1, 6, 2, 3, 4
    xs = draw(rng, B, T, H, dk, dv)
    o, s = ref.recurrent(*xs[:5], state=xs[5])
    go, gs = rng.standard_normal(o.shape), rng.standard_normal(s.shape)

    def loss(*a):
        out, last = ref.recurrent(*a[:5], state=a[5])
        return np.array(float((out * go).sum() + (last * gs).sum()))
    got = ref.recurrent_backward(*xs[:5], go, state=xs[5], gstate=gs)
    for i, g in enumerate(got):
        want = fd(loss, xs, i, np.ones(()))
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-7, err_msg=f"input {i}")


def _device(fn, xs, go, gs, **kw):
    leaves = [None if a is None else vkdsl.tensor(a.astype(np.float32), requires_grad=True) for a in xs]
    o, s = fn(*leaves[:5], state=leaves[5], **kw)
    loss = (o * vkdsl.tensor(go.astype(np.float32))).sum() + (s * vkdsl.tensor(gs.astype(np.float32))).sum()
    grads = grad(loss, [t for t in leaves if t is not None])
    return o.numpy(), s.numpy(), [g.numpy() for g in grads]


@pytest.mark.parametrize("T,chunk,state", [(37, 8, True), (37, 16, False), (130, 64, True), (5, 64, True)])
def test_chunked_on_the_device_matches_the_reference(rng, T, chunk, state):
    """Forward and every gradient (q, k, v, g, beta and the initial state) against the float64
    loop and its hand-derived backward; T no multiple of the chunk appends empty steps."""
    xs = draw(rng, 2, T, 3, 8, 6, state=state)
    o1, s1 = ref.recurrent(*xs[:5], state=xs[5])
    go, gs = rng.standard_normal(o1.shape), rng.standard_normal(s1.shape)
    want = ref.recurrent_backward(*xs[:5], go, state=xs[5], gstate=gs)
    o, s, grads = _device(gdr.chunked, xs, go, gs, chunk=chunk)
    # fp32 over T steps of a state whose entries stay O(1): errors ~1e-7 relative per step
    np.testing.assert_allclose(o, o1, rtol=0, atol=2e-6 * np.abs(o1).max())
    np.testing.assert_allclose(s, s1, rtol=0, atol=2e-6 * np.abs(s1).max())
    for i, (g, w) in enumerate(zip(grads, [w for w, x in zip(want, xs) if x is not None])):
        np.testing.assert_allclose(g, w, rtol=0, atol=5e-6 * np.abs(w).max(), err_msg=f"gradient {i}")


def test_aligned_keys_stay_accurate(rng):
    """Keys within a few degrees of each other make (I + A) far from the identity (its inverse's
    power series would cancel catastrophically); forward substitution keeps fp32 accuracy."""
    xs = draw(rng, 1, 128, 2, 16, 8, aligned=True)
    o1, s1 = ref.recurrent(*xs[:5], state=xs[5])
    go, gs = np.ones(o1.shape), np.zeros(s1.shape)
    o, s, _ = _device(gdr.chunked, xs, go, gs, chunk=64)
    np.testing.assert_allclose(o, o1, rtol=0, atol=1e-5 * np.abs(o1).max())


def test_recurrent_on_the_device_matches_the_reference(rng):
    xs = draw(rng, 2, 9, 3, 8, 6)
    o1, s1 = ref.recurrent(*xs[:5], state=xs[5])
    go, gs = rng.standard_normal(o1.shape), rng.standard_normal(s1.shape)
    o, s, grads = _device(gdr.recurrent, xs, go, gs)
    np.testing.assert_allclose(o, o1, rtol=0, atol=1e-6 * np.abs(o1).max())
    np.testing.assert_allclose(s, s1, rtol=0, atol=1e-6 * np.abs(s1).max())
    want = ref.recurrent_backward(*xs[:5], go, state=xs[5], gstate=gs)
    for i, (g, w) in enumerate(zip(grads, want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=5e-6 * np.abs(w).max(), err_msg=f"gradient {i}")


@pytest.mark.parametrize("n", [1, 7, 64])
def test_triangular_solve_and_its_gradient(rng, n):
    a = np.tril(rng.standard_normal((3, 2, n, n)) * 0.3, -1).astype(np.float32)

    def inverse(x):
        return np.linalg.inv(np.eye(n) + np.tril(x, -1))
    check_op(gdr.tri_inverse, inverse, [a], limit=1e-12, grad_of=(0,) if n <= 7 else (), grad_limit=1e-9)


def test_bad_shapes_are_named():
    t = vkdsl.tensor(np.zeros((1, 4, 2, 3), np.float32))
    g = vkdsl.tensor(np.zeros((1, 4, 2), np.float32))
    with pytest.raises(vkdsl.ShapeError, match=r"g \(1, 4, 3\)"):
        gdr.chunked(t, t, t, vkdsl.tensor(np.zeros((1, 4, 3), np.float32)), g)
    with pytest.raises(ValueError, match="chunk must be in 1..64"):
        gdr.chunked(t, t, t, g, g, chunk=65)
    with pytest.raises(vkdsl.ShapeError, match="0 < n <= 64"):
        gdr.tri_inverse(vkdsl.tensor(np.zeros((65, 65), np.float32)))


@pytest.mark.parametrize("T,chunk,cuts", [(37, 8, (5, 8, 9, 30)), (130, 64, (64, 70)), (20, 64, (1, 2, 19))])
def test_packed_sequences_are_independent(rng, T, chunk, cuts):
    """Several sequences in one row (segments: each token's sequence id, as packed training rows
    give them): each one's outputs and gradients are what it gets alone -- the loop and its
    hand-derived backward run per sequence. Cuts at and beside chunk boundaries, length-1 sequences."""
    xs = draw(rng, 2, T, 3, 8, 6, state=False)[:5]
    bounds = [0, *cuts, T]
    seg = np.zeros((2, T), np.int32)
    for a, b in zip(bounds[:-1], bounds[1:]):
        seg[:, a:b] = a                                  # the id: the sequence's first position
    o_want = np.zeros(xs[2].shape)
    go = rng.standard_normal(o_want.shape)
    g_want = [np.zeros(x.shape) for x in xs]
    for a, b in zip(bounds[:-1], bounds[1:]):
        part = [x[:, a:b] for x in xs]
        o_want[:, a:b] = ref.recurrent(*part)[0]
        for gw, g in zip(g_want, ref.recurrent_backward(*part, go[:, a:b])[:5]):
            gw[:, a:b] = g
    np.testing.assert_allclose(ref.recurrent(*xs, segments=seg)[0], o_want, rtol=0, atol=1e-12)
    leaves = [vkdsl.tensor(x.astype(np.float32), requires_grad=True) for x in xs]
    o, state = gdr.chunked(*leaves, chunk=chunk, segments=vkdsl.tensor(seg))
    assert state is None
    grads = grad((o * vkdsl.tensor(go.astype(np.float32))).sum(), leaves)
    np.testing.assert_allclose(o.numpy(), o_want, rtol=0, atol=2e-6 * np.abs(o_want).max())
    for i, (g, w) in enumerate(zip(grads, g_want)):
        np.testing.assert_allclose(g.numpy(), w, rtol=0, atol=5e-6 * np.abs(w).max(), err_msg=f"gradient {i}")
