"""Every op with a backward rule: device autodiff (float32) against central finite differences
of the independent float64 numpy reference in golden/ (never sharing code with vkdsl).

Tolerance: the device computes in fp32, so gradients carry ~1e-6 relative rounding noise
amplified by the op's conditioning; we compare by NMSE < 1e-8 (i.e. ~1e-4 relative RMS)."""
import math

import numpy as np
import pytest

import vkdsl
from vkdsl.autograd import grad
from vkdsl_golden import reference as R
from vkdsl_golden import reference_train as RT
from vkdsl.ops import attention, losses, nn
from vkdsl.ops.lora import LoRA, lora_linear

from conftest import check_grads as check, f32, nmse

LIMIT = 1e-8


def test_elementwise_and_reduce_grads(rng):
    a, b = f32(rng, 3, 5), f32(rng, 5) + 3.0
    check(lambda x, y: ((x * y).tanh() / y + (x.exp() * 0.1).log()).sum(axis=0),
          lambda x, y: (np.tanh(x * y) / y + np.log(np.exp(x) * 0.1)).sum(0), [a, b], [0, 1], rng)
    # max away from ties: distinct values
    m = (np.arange(12, dtype=np.float32).reshape(3, 4) * 0.37) % 1.3
    check(lambda x: x.max(axis=1), lambda x: x.max(1), [m], [0], rng)
    check(lambda x: (x.sqrt() + x.rsqrt()).mean(axis=1), lambda x: (np.sqrt(x) + 1 / np.sqrt(x)).mean(1),
          [np.abs(a) + 0.5], [0], rng)


def test_view_grads(rng):
    a = f32(rng, 3, 4, 5)
    check(lambda x: x.permute(2, 0, 1)[1:4, :, 2:].reshape(3, -1) * 2.0,
          lambda x: x.transpose(2, 0, 1)[1:4, :, 2:].reshape(3, -1) * 2.0, [a], [0], rng)


@pytest.mark.parametrize("form", ["nn", "nt", "tn", "tt"])
def test_matmul_grads(rng, form):
    ta, tb = form[0] == "t", form[1] == "t"
    a = f32(rng, 5, 3) if ta else f32(rng, 3, 5)
    b = f32(rng, 4, 5) if tb else f32(rng, 5, 4)
    check(lambda x, y: (x.T if ta else x) @ (y.T if tb else y),
          lambda x, y: (x.T if ta else x) @ (y.T if tb else y), [a, b], [0, 1], rng)


def test_transposed_operand_gets_its_gradient_in_its_own_layout(rng):
    # x . A with few columns is computed as (A^T x^T)^T (vkdsl.tensor.matmul), so x is a source
    # stored transposed: its gradient must come out of a matmul in x's layout, not as a transposed
    # view that whatever sums it reads with a stride
    x64, a64 = f32(rng, 64, 48).astype(np.float64), f32(rng, 48, 4).astype(np.float64)
    x, a = vkdsl.tensor(x64.astype(np.float32), requires_grad=True), vkdsl.tensor(
        a64.astype(np.float32), requires_grad=True)
    u = x @ a
    assert u.op == "permute", "the narrow product is no longer computed transposed: retarget this"
    gx, ga = grad((u * u).sum(), [x, a])
    assert gx.op == "matmul", gx.op
    want_x, want_a = 2 * (x64 @ a64) @ a64.T, 2 * x64.T @ (x64 @ a64)
    assert np.abs(gx.numpy() - want_x).max() <= 1e-5 * np.abs(want_x).max()
    assert np.abs(ga.numpy() - want_a).max() <= 1e-5 * np.abs(want_a).max()


def test_batched_matmul_shared_weight_grads(rng):
    check(lambda x, w: x @ w, lambda x, w: x @ w, [f32(rng, 2, 3, 5), f32(rng, 5, 4)], [0, 1], rng)


def test_softmax_logsoftmax_grads(rng):
    x = f32(rng, 3, 7, scale=3)
    check(lambda t: nn.softmax(t), lambda t: R.softmax(t, -1), [x], [0], rng)
    check(lambda t: nn.log_softmax(t), lambda t: R.log_softmax(t, -1), [x], [0], rng)


@pytest.mark.parametrize("axis,keepdim", [(-1, False), (0, True)])
def test_logsumexp_gradient_is_the_softmax(rng, axis, keepdim):
    """The explicit rule against float64 softmax, with -inf entries (TMKL's removed targets) and
    logits of +-1e4; and the backward keeps no softmax: one (rows, vocabulary) tensor is written,
    the gradient itself."""
    x = f32(rng, 5, 9, scale=3)
    x[1, 3] = x[2, 0] = -np.inf
    x[3] *= 1e4
    g = rng.standard_normal(9 if axis == 0 else 5).astype(np.float32)
    t = vkdsl.tensor(x, requires_grad=True)
    out = nn.logsumexp(t, axis, keepdim)
    gt = vkdsl.tensor(g.reshape(out.shape))
    (dx,) = grad(out, [t], upstream=gt)
    x64 = x.astype(np.float64)
    lse = np.log(np.exp(x64 - x64.max(axis, keepdims=True)).sum(axis, keepdims=True)) + \
        x64.max(axis, keepdims=True)
    assert nmse(out.numpy().reshape(lse.shape), lse) < 1e-14
    want = g.reshape(lse.shape) * np.exp(x64 - lse)
    assert nmse(dx.numpy(), want) < 1e-13 and np.isfinite(dx.numpy()).all()
    assert dx.numpy()[1, 3] == 0.0 and dx.numpy()[2, 0] == 0.0
    from vkdsl.schedule import plan
    t2 = vkdsl.tensor(x, requires_grad=True)
    (d2,) = grad(nn.logsumexp(t2, -1).sum(), [t2])
    steps, _ = plan([d2], [])
    assert [s.kind for s in steps if s.node.shape == x.shape] == ["elementwise"]


def test_cross_entropy_grad(rng):
    x = f32(rng, 6, 11, scale=2)
    labels = np.array([3, -100, 0, 10, -100, 7], np.int32)
    lab = vkdsl.tensor(labels)
    check(lambda t: losses.cross_entropy(t, lab)[0], lambda t: RT.cross_entropy(t, labels)[0], [x], [0], rng,
          scalar=True)


def test_rmsnorm_rope_silu_swiglu_grads(rng):
    x, w = f32(rng, 4, 8), f32(rng, 8)
    check(lambda t, u: nn.rmsnorm(t, u, 1e-5), lambda t, u: RT.rmsnorm(t, u, 1e-5), [x, w], [0, 1], rng)
    q = f32(rng, 5, 3, 8)
    pos = np.arange(5)
    cos, sin = (vkdsl.tensor(a) for a in nn.rope_tables(pos, 8, 10000.0))
    check(lambda t: nn.rope(t, cos, sin), lambda t: RT.rope(t, pos, 10000.0), [q], [0], rng)
    check(lambda t: nn.silu(t), RT.silu, [x], [0], rng)
    check(lambda g, u: nn.swiglu(g, u), RT.swiglu, [x, w + x], [0, 1], rng)


def test_attention_gqa_grads(rng):
    """9 query heads over 3 kv heads, as in SmolLM2 (head dim kept small for the FD)."""
    T, Hq, Hkv, D = 5, 9, 3, 4
    q, k, v = f32(rng, T, Hq, D), f32(rng, T, Hkv, D), f32(rng, T, Hkv, D)
    check(lambda a, b, c: attention.attention(a.reshape(1, T, Hq, D), b.reshape(1, T, Hkv, D),
                                       c.reshape(1, T, Hkv, D)).reshape(T, Hq, D),
          RT.attention, [q, k, v], [0, 1, 2], rng)


def test_kl_tmkl_grads(rng):
    a, b = f32(rng, 5, 9, scale=2), f32(rng, 5, 9, scale=2)
    check(lambda s, t: losses.kl(s, t), lambda s, t: RT.kl(s, t)[1] if isinstance(RT.kl(s, t), tuple)
          else RT.kl(s, t), [a, b], [0, 1], rng)
    labels = np.array([2, -100, 8, 0, 4], np.int32)
    lab = vkdsl.tensor(labels)
    check(lambda s, t: losses.tmkl(s, t, lab), lambda s, t: RT.tmkl(s, t, labels)[0], [a, b], [0], rng,
          scalar=True)


def test_sequence_logprob_and_dpo_grads(rng):
    x = f32(rng, 2, 4, 6)
    labels = np.array([[-100, 2, 5, -100], [1, -100, 0, 3]], np.int32)
    lab = vkdsl.tensor(labels)
    check(lambda t: losses.sequence_logprob(t, lab), lambda t: RT.sequence_logprob(t, labels), [x], [0], rng)
    pc, pr, rc, rr = (f32(rng, 3) for _ in range(4))
    check(lambda a, b, c, d: losses.dpo(a, b, c, d, 0.5)[0],
          lambda a, b, c, d: RT.dpo(a, b, c, d, 0.5)[0] if isinstance(RT.dpo(a, b, c, d, 0.5), tuple)
          else RT.dpo(a, b, c, d, 0.5), [pc, pr, rc, rr], [0, 1], rng, scalar=True)


def test_dpo_is_ln2_when_policy_equals_reference(rng):
    s = f32(rng, 4) * 10
    loss, _ = losses.dpo(*(vkdsl.tensor(s) for _ in range(4)), beta=0.1)
    assert abs(loss.item() - math.log(2)) < 1e-7      # 0.693147 to float32 precision


def test_gather_scatter_add_grad(rng):
    table = f32(rng, 7, 3)
    idx = np.array([0, 6, 2, 2, 5], np.int32)
    it = vkdsl.tensor(idx)
    check(lambda t: t.gather(it), lambda t: t[idx], [table], [0], rng)


def test_lora_linear_grads_and_init_properties(rng):
    x, W = f32(rng, 6, 8), f32(rng, 8, 5)
    lora = LoRA.init(8, 5, r=2, alpha=4.0, seed=1)
    X, Wt = vkdsl.tensor(x), vkdsl.tensor(W)
    y = lora_linear(X, Wt, lora)
    assert np.abs(y.numpy() - (X @ Wt).numpy()).max() == 0.0          # B = 0: exactly the base
    g = rng.standard_normal((6, 5)).astype(np.float32)
    dA, dB = grad(lora_linear(X, Wt, lora), lora.params(), upstream=vkdsl.tensor(g))
    assert np.all(dA.numpy() == 0.0)                                    # dA contains B = 0
    A = lora.A.numpy().astype(np.float64)
    np.testing.assert_allclose(dB.numpy(), lora.scale * (x @ A).T @ g, rtol=1e-4, atol=1e-5)
    lora.B.assign(lora.B - dB * 0.1)                                     # one SGD step
    dA2, _ = grad(lora_linear(X, Wt, lora), lora.params(), upstream=vkdsl.tensor(g))
    assert np.abs(dA2.numpy()).max() > 0.0
    # full check against FD of the reference, with a non-zero B
    B = f32(rng, 2, 5)
    s = lora.scale
    check(lambda a, b: lora_linear(X, Wt, LoRA(a, b, s)), lambda a, b: RT.lora_linear(x, W, a, b, s),
          [A.astype(np.float32), B], [0, 1], rng)


def test_frozen_weight_gets_no_gradient_buffer(rng):
    """Input gradients flow through a frozen W to an earlier adapter, but the traced program
    allocates nothing of W's size: its bytes do not grow with the frozen weight."""
    n = 4

    def program_bytes(d):
        W = vkdsl.tensor(f32(rng, d, d))                     # frozen
        lora = LoRA.init(d, d, r=2, alpha=2.0, seed=0)
        lora.B.assign(vkdsl.tensor(f32(rng, 2, d)))

        @vkdsl.trace
        def step(x):
            h = lora_linear(x, W, lora)                      # trainable adapter first ...
            loss = (h @ W).sum()                             # ... then through frozen W
            return grad(loss, lora.params())
        prog = step.program(f32(rng, n, d))
        step(f32(rng, n, d))
        return prog.device_bytes
    small, big = program_bytes(64), program_bytes(512)
    assert big < 512 * 512 * 4        # less than one gradient of the frozen W
    assert big - small < (512 * 512 - 64 * 64) * 4 / 4


def _logprob_rows_ref(h, W, labels):
    z = np.asarray(h, np.float64) @ np.asarray(W, np.float64).T
    z = z - z.max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = lp[np.arange(len(labels)), np.maximum(labels, 0)]
    return np.where(labels == -100, 0.0, picked)


def test_rowwise_head_loss_grads(rng):
    """vkdsl.autograd.rowwise (the LM head fused with the loss: the gradient rows computed in the
    forward) against finite differences of a float64 log-softmax, through a layer below it, with
    ignored rows and a non-uniform upstream gradient."""
    from vkdsl.autograd import rowwise
    R, D, V = 6, 5, 11
    x, A, W = f32(rng, R, D), f32(rng, D, D), f32(rng, V, D)
    labels = np.array([3, -100, 0, 10, 7, -100], np.int32)
    Wt, lab = vkdsl.tensor(W), vkdsl.tensor(labels)
    check(lambda a, m: rowwise(lambda h, lb: losses.token_logprobs(h @ Wt.T, lb)[0], (a @ m).tanh(), lab),
          lambda a, m: _logprob_rows_ref(np.tanh(a @ m), W, labels), [x, A], [0, 1], rng)


def test_rowwise_keeps_no_logits_for_the_backward(rng):
    """Four chunks of (64, 4096) logits: the composite keeps each chunk's logits until the backward
    (logsumexp's gradient reads them); through rowwise they die in the forward, one chunk alive at
    a time, so the program holds about three chunks' logits less (3.0 measured; 2.75 asked)."""
    from vkdsl.autograd import rowwise
    R, D, V, C = 256, 16, 4096, 64
    x = vkdsl.tensor(f32(rng, R, D), requires_grad=True)
    W = vkdsl.tensor(f32(rng, V, D))
    lab = rng.integers(0, V, R).astype(np.int32)
    rows = lambda h, lb: losses.token_logprobs(h @ W.T, lb)[0]        # noqa: E731

    def program(fused):
        @vkdsl.trace
        def step(lb):
            parts = [(rowwise(rows, x[s:s + C], lb[s:s + C]) if fused else rows(x[s:s + C], lb[s:s + C])).sum()
                     for s in range(0, R, C)]
            loss = sum(parts[1:], parts[0])
            return [loss] + grad(loss, [x])          # the loss first, as a training step returns it
        return step, step.program(lab)
    (f_step, fused), (p_step, plain) = program(True), program(False)
    held = lambda prog: prog.device_bytes      # noqa: E731
    logits = C * V * 4
    assert held(plain) - held(fused) >= 2.75 * logits, (held(plain), held(fused))
    for a, b in zip(f_step(lab), p_step(lab)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_grad_through_a_tensor_read_before_it_is_an_error_not_zeros():
    x = vkdsl.tensor(np.ones((4, 3), np.float32), requires_grad=True)
    y = x @ vkdsl.tensor(np.full((3, 2), 2.0, np.float32))
    (g_before,) = grad(y, [x], upstream=vkdsl.tensor(np.ones((4, 2), np.float32)))
    assert np.array_equal(g_before.numpy(), np.full((4, 3), 4.0))      # d sum(x W) / dx = 1 . W^T
    y.numpy()                                                          # y is now a leaf: its graph is gone
    with pytest.raises(ValueError, match=r"was read \(numpy\(\)\) before grad"):
        grad(y * 3.0, [x], upstream=vkdsl.tensor(np.ones((4, 2), np.float32)))
