"""The two training probes of issue 3, on the device: LoRA + AdamW inside a vkdsl.trace'd step.

(a) frozen 768x768 W, target from a rank-4 update, rank-8 LoRA: the loss falls by >= 6 orders
    of magnitude and W's buffer bytes are unchanged (sha256 before and after).
(b) a 64x64 update with singular values 8, 4, ..., 0.0625 fitted with LoRA ranks 1, 2, 4, 8, 16:
    ranks 1, 2, 4 stop at the Eckart-Young floor, ranks 8 and 16 fit it to below 1e-9.

Both use a learning rate held for 40% of the steps then decayed geometrically, and beta2 = 0.95:
with torch's 0.999 the second moment remembers the large early gradients for ~1000 steps and the
small directions crawl. Run: pytest tests/test_probes.py  (~15 s on lavapipe, 2 cores)
"""
import hashlib

import numpy as np

import vkdsl
from vkdsl.autograd import grad
from vkdsl.ops.lora import LoRA, lora_linear
from vkdsl.ops.optim import AdamW


def schedule(steps, lr0, lr1, hold=0.4):
    """lr0 for the first `hold` of the steps, then geometric decay to lr1 at the last step."""
    h = int(steps * hold)
    return [lr0 if k < h else lr0 * (lr1 / lr0) ** ((k - h) / (steps - 1 - h)) for k in range(steps)]


def orthonormal(rng, n, k):
    return np.linalg.qr(rng.standard_normal((n, k)))[0]            # (n, k), orthonormal columns


def sha256(t: vkdsl.Tensor) -> str:
    return hashlib.sha256(t.buffer.read(np.uint8, t.buffer.nbytes).tobytes()).hexdigest()


def test_probe_frozen_base_rank4_target():
    """Inputs: n = 128 rows of X orthonormal (so ||X M||_F = ||M||_F on X's row space); the
    rank-4 update's input side lies in that row space, so all of it is observable.
    loss = ||X W + s (X A) B - Y||_F^2 / n with Y = fp32(X (W + dW)) computed in float64."""
    d, n = 768, 128
    rng = np.random.default_rng(0)
    X = orthonormal(rng, d, n).T                                     # (n, d)
    W = (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
    U = X.T @ orthonormal(rng, n, 4)                                 # (d, 4), in X's row space
    dW = (U * np.array([2.0, 1.5, 1.0, 0.5])) @ orthonormal(rng, d, 4).T
    Y = (X @ (W.astype(np.float64) + dW)).astype(np.float32)
    Wt, Xt, Yt = vkdsl.tensor(W, name="W"), vkdsl.tensor(X.astype(np.float32)), vkdsl.tensor(Y)
    before = sha256(Wt)
    lora = LoRA.init(d, d, 8, alpha=16.0, seed=1)
    opt = AdamW(lora.params(), betas=(0.9, 0.95))

    @vkdsl.trace
    def step(scalars):
        loss = (lora_linear(Xt, Wt, lora) - Yt).square().sum() * (1.0 / n)
        opt.step(grad(loss, lora.params()), scalars)
        return loss

    losses = [float(step(opt.scalars(lr))) for lr in schedule(400, 2e-2, 1e-8)]
    print(f"probe (a): loss {losses[0]:.4e} -> {losses[-1]:.4e} (x{losses[0] / losses[-1]:.3g})")
    assert np.isclose(losses[0], np.sum((X @ dW) ** 2) / n, rtol=1e-4)     # B = 0: the base alone
    assert losses[-1] <= losses[0] * 1e-6, f"loss {losses[0]:.3e} -> {losses[-1]:.3e}"
    assert sha256(Wt) == before, "the frozen W's bytes changed"
    assert np.array_equal(Wt.numpy(), W)


SIGMA = np.array([8, 4, 2, 1, 0.5, 0.25, 0.125, 0.0625])
RANKS = (1, 2, 4, 8, 16)


def test_probe_eckart_young():
    """Normalization: full-batch identity inputs, loss = ||I (s A B) - dW||_F^2 = ||s A B - dW||_F^2,
    whose rank-r minimum is sum(SIGMA[r:]^2) (Eckart-Young); ||dW||_F^2 = 85.33. All five ranks
    train in one traced step (one submit per step)."""
    n = 64
    rng = np.random.default_rng(0)
    dW = (orthonormal(rng, n, 8) * SIGMA) @ orthonormal(rng, n, 8).T
    assert np.allclose(np.linalg.svd(dW, compute_uv=False)[:8], SIGMA)
    I, D = vkdsl.tensor(np.eye(n, dtype=np.float32)), vkdsl.tensor(dW.astype(np.float32))
    loras = [LoRA.init(n, n, r, alpha=float(r), seed=r) for r in RANKS]
    params = [p for lo in loras for p in lo.params()]
    opt = AdamW(params, betas=(0.9, 0.95))

    @vkdsl.trace
    def step(scalars):
        losses = [(lo.delta(I) - D).square().sum() for lo in loras]
        total = losses[0]
        for x in losses[1:]:
            total = total + x
        opt.step(grad(total, params), scalars)
        return losses

    for lr in schedule(1200, 2e-2, 1e-9):
        final = [float(x) for x in step(opt.scalars(lr))]
    print("probe (b): rank, final loss, Eckart-Young floor:",
          [(r, f"{x:.6e}", f"{np.sum(SIGMA[r:] ** 2):.6e}") for r, x in zip(RANKS, final)])
    for r, loss in zip(RANKS, final):
        floor = float(np.sum(SIGMA[r:] ** 2))
        if r < len(SIGMA):
            assert abs(loss - floor) <= 5e-4 * floor, f"rank {r}: {loss:.6g} vs floor {floor:.6g}"
        else:
            assert loss < 1e-9, f"rank {r}: {loss:.3e}"
