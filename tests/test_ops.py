"""Ops through the one helper (conftest.check_op): forward NMSE against float64 numpy, sentinel
guards, gradients against finite differences. Odd sizes (1, 3, 7, 33) catch tail bugs."""
import numpy as np
import pytest

from conftest import check_op
from vkdsl.ops import losses, nn


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (7, 33)], ids=lambda s: "x".join(map(str, s)))
def test_softmax(rng, shape):
    check_op(nn.softmax, np_softmax, [f32(rng, *shape, scale=3)], 1e-12, grad_of=[0])


@pytest.mark.parametrize("shape", [(3, 7), (5, 64)], ids=lambda s: "x".join(map(str, s)))
def test_rmsnorm(rng, shape):
    ref = lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w
    check_op(lambda x, w: nn.rmsnorm(x, w), ref, [f32(rng, *shape), f32(rng, shape[-1])], 1e-12, grad_of=[0, 1])


def test_silu_swiglu(rng):
    sig = lambda x: 1 / (1 + np.exp(-x))
    check_op(lambda g, u: nn.swiglu(g, u), lambda g, u: g * sig(g) * u, [f32(rng, 7, 33), f32(rng, 7, 33)],
             1e-12, grad_of=[0, 1])


@pytest.mark.parametrize("mkn", [(1, 1, 1), (3, 7, 33), (33, 5, 17)], ids=lambda s: "x".join(map(str, s)))
def test_matmul(rng, mkn):
    m, k, n = mkn
    check_op(lambda a, b: a @ b, lambda a, b: a @ b, [f32(rng, m, k), f32(rng, k, n)], 1e-12, grad_of=[0, 1])


def test_reductions_and_views(rng):
    check_op(lambda x: (x.permute(1, 0) * 2).sum(-1), lambda x: (x.T * 2).sum(-1), [f32(rng, 7, 33)], 1e-12,
             grad_of=[0])
    check_op(lambda x: x.max(-1).reshape(7, 1) + x.permute(1, 0).sum(0).reshape(7, 1),
             lambda x: x.max(-1)[:, None] + x.sum(-1)[:, None], [f32(rng, 7, 33)], 1e-12)


def test_cross_entropy_ignores_masked_rows(rng):
    logits = f32(rng, 7, 11, scale=2)
    labels = np.array([1, -100, 0, 10, -100, 3, 5], np.int32)

    def ref(z, y):
        keep = y != -100
        lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
        return np.array((lse[keep] - z[keep, y[keep]]).mean())
    check_op(lambda z, y: losses.cross_entropy(z, y)[0], ref, [logits, labels], 1e-12, grad_of=[0])


def test_a_wrong_reference_fails(rng):
    # the helper can fail: a reference off by one part in a thousand is caught
    with pytest.raises(AssertionError, match="forward NMSE"):
        check_op(nn.softmax, lambda x: np_softmax(x) * 1.001, [f32(rng, 3, 7)], 1e-12)


def test_lora_scale_matches_the_papers():
    # LoRA (Hu et al. 2021): s = alpha / r; rsLoRA (Kalajdzievski 2023): s = alpha / sqrt(r)
    from vkdsl.ops.lora import lora_scale
    assert lora_scale(16.0, 4) == 4.0 and lora_scale(16.0, 4, rslora=True) == 8.0
    assert lora_scale(8.0, 64, rslora=True) == 1.0
