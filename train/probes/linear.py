"""The two probes on one linear layer, traced on the device (no language model):

lowrank     frozen 768x768 W, targets from a rank-4 update, a rank-8 LoRA trained alone: the loss
            goes to ~0 while W's bytes (sha256 of the device buffer) never change.
rank-floor  a 64x64 update with singular values 8, 4, ..., 0.0625 fitted by ranks 1..16 over
            seeds: the best MSE of rank r sits on the Eckart-Young floor sum(sigma[r:]^2)/4096.

Both hold the learning rate for 40% of the steps, then decay it geometrically, with beta2 = 0.95:
with 0.999 the second moment remembers the large early gradients and the small directions crawl."""
from __future__ import annotations

import hashlib

import numpy as np

import vkdsl
from vkdsl.autograd import grad
from vkdsl.ops.lora import LoRA, lora_linear
from vkdsl.ops.optim import AdamW

from ..charts import line_chart
from .base import Expectation, Result, probe


def schedule(steps, lr0, lr1, hold=0.4):
    """lr0 for the first `hold` of the steps, then geometric decay to lr1 at the last step."""
    h = int(steps * hold)
    return [lr0 if k < h else lr0 * (lr1 / lr0) ** ((k - h) / max(steps - 1 - h, 1))
            for k in range(steps)]


def orthonormal(rng, n, k):
    return np.linalg.qr(rng.standard_normal((n, k)))[0]            # (n, k), orthonormal columns


def device_sha256(t: vkdsl.Tensor) -> str:
    return hashlib.sha256(t.buffer.read(np.uint8, t.buffer.nbytes).tobytes()).hexdigest()


@probe("lowrank",
       "frozen 768x768 W + rank-8 LoRA on a rank-4 target: loss -> ~0, W's sha256 unchanged",
       # the target has rank 4 in X's rows
       needs_model=False, minutes="6 s", d=768, n=128, rank=8, steps=400, seed=0,
       bounds={"d": (4, None), "n": (4, "d"), "seed": (0, None)})
def lowrank(ctx) -> Result:
    """n rows of X orthonormal (so ||X M||_F = ||M||_F on X's row space); the rank-4 update's input
    side lies in that row space, so all of it is observable. loss = ||X W + s (X A) B - Y||_F^2 / n,
    Y = fp32(X (W + dW)) computed in float64."""
    p = ctx.params
    d, n, r = p["d"], p["n"], p["rank"]
    rng = np.random.default_rng(p["seed"])
    X = orthonormal(rng, d, n).T                                     # (n, d)
    W = (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
    U = X.T @ orthonormal(rng, n, 4)                                 # (d, 4), in X's row space
    dW = (U * np.array([2.0, 1.5, 1.0, 0.5])) @ orthonormal(rng, d, 4).T
    Y = (X @ (W.astype(np.float64) + dW)).astype(np.float32)
    Wt, Xt, Yt = vkdsl.tensor(W, name="W"), vkdsl.tensor(X.astype(np.float32)), vkdsl.tensor(Y)
    before = device_sha256(Wt)
    lora = LoRA.init(d, d, r, alpha=2.0 * r, seed=p["seed"] + 1)
    opt = AdamW(lora.params(), betas=(0.9, 0.95))

    @vkdsl.trace
    def step(scalars):
        loss = (lora_linear(Xt, Wt, lora) - Yt).square().sum() * (1.0 / n)
        opt.step(grad(loss, lora.params()), scalars)
        return loss

    losses = [float(step(opt.scalars(lr))) for lr in schedule(p["steps"], 2e-2, 1e-8)]
    after = device_sha256(Wt)
    full, patch = d * d, 2 * d * r
    expect0 = float(np.sum((X @ dW) ** 2) / n)
    rows = [{"quantity": "parameters of the full update d x d", "value": full},
            {"quantity": f"parameters of the rank-{r} patch 2 d r", "value": patch},
            {"quantity": "ratio", "value": full / patch},
            {"quantity": "loss at step 1 (B = 0: the base alone)", "value": losses[0]},
            {"quantity": f"loss at step {len(losses)}", "value": losses[-1]},
            {"quantity": "W sha256 before", "value": before[:16]},
            {"quantity": "W sha256 after", "value": after[:16]}]
    ex = [Expectation("step-1 loss equals ||X dW||^2 / n (B = 0, float64 reference)",
                      f"{losses[0]:.6g} vs {expect0:.6g}",
                      abs(losses[0] - expect0) <= 1e-4 * expect0),
          Expectation("the loss falls by >= 6 orders of magnitude (rank 8 >= the target's rank 4)",
                      f"{losses[0]:.3e} -> {losses[-1]:.3e}", losses[-1] <= losses[0] * 1e-6),
          Expectation("the frozen W's device bytes never change",
                      "sha256 equal" if after == before else
                      "sha256 differs", after == before and np.array_equal(Wt.numpy(), W))]
    return Result(f"lowrank: frozen {d}x{d} W, rank-4 target, rank-{r} LoRA, {len(losses)} "
                  f"AdamW steps", ["quantity", "value"], rows, ex,
                  charts=[line_chart({"loss": losses}, "step", "loss (log)", log=True)])


SIGMA = np.array([8, 4, 2, 1, 0.5, 0.25, 0.125, 0.0625])


@probe("rank-floor",
       "64x64 update, singular values 8..0.0625, ranks 1-16 x seeds: best MSE vs the "
       "Eckart-Young floor", needs_model=False, minutes="50 s", seeds=5, ranks=[1, 2, 4, 8, 16],
       steps=1500, bounds={"ranks": (1, 64)})
def rank_floor(ctx) -> Result:
    """Full-batch identity inputs: MSE = ||s A B - dW||_F^2 / 4096, whose rank-r minimum is
    sum(SIGMA[r:]^2) / 4096 (Eckart-Young). Every (rank, seed) trains in one traced step."""
    n, ranks, seeds = 64, list(ctx.params["ranks"]), ctx.seeds
    rng = np.random.default_rng(0)
    dW = (orthonormal(rng, n, 8) * SIGMA) @ orthonormal(rng, n, 8).T
    I, D = vkdsl.tensor(np.eye(n, dtype=np.float32)), vkdsl.tensor(dW.astype(np.float32))
    runs = [(r, s) for r in ranks for s in range(seeds)]
    loras = [LoRA.init(n, n, r, alpha=float(r), seed=1000 * s + r) for r, s in runs]
    params = [p for lo in loras for p in lo.params()]
    opt = AdamW(params, betas=(0.9, 0.95))

    @vkdsl.trace
    def step(scalars):
        losses = [(lo.delta(I) - D).square().sum() * (1.0 / (n * n)) for lo in loras]
        total = losses[0]
        for x in losses[1:]:
            total = total + x
        opt.step(grad(total, params), scalars)
        return losses

    hist = np.array([[float(x) for x in step(opt.scalars(lr))]
                     for lr in schedule(ctx.params["steps"], 2e-2, 1e-9)])
    best, final = hist.min(axis=0), hist[-1]
    rows, ex = [], []
    for r in ranks:
        k = [i for i, (rr, _) in enumerate(runs) if rr == r]
        floor = float(np.sum(SIGMA[r:] ** 2) / (n * n))
        med = float(np.median(best[k]))
        gap = float(np.max(np.abs(best[k] - floor)) / floor) if floor > 0 else None
        rows.append({"rank": r, "Eckart-Young floor": f"{floor:.5e}",
                     "median best MSE": f"{med:.5e}", "max |best - floor| / floor": gap,
                     "best min": float(best[k].min()), "best max": float(best[k].max()),
                     "final min": float(final[k].min()), "final max": float(final[k].max())})
        if floor > 0:
            ok = gap <= 5e-6
            ex.append(Expectation(f"rank {r}: every seed's best MSE is the floor to the 6 "
                                  f"digits shown",
                                  f"{floor:.5e} vs best {best[k].min():.5e}..{best[k].max():.5e}",
                                  ok))
        else:
            ok = all(best[i] < 1e-9 for i in k)
            ex.append(Expectation(f"rank {r} >= 8 = the target's rank: the best MSE is ~0 (< 1e-9)",
                                  f"best {best[k].max():.3e} at worst", ok))
    curves = {f"rank {r}": hist[:, next(i for i, (rr, s) in enumerate(runs) if rr == r)].tolist()
              for r in ranks}
    return Result(f"rank-floor: 64x64 target of rank 8 (sigma 8 ... 0.0625), {seeds} seeds x ranks "
                  f"{', '.join(map(str, ranks))}, {len(hist)} steps", list(rows[0]), rows, ex,
                  notes=["final-vs-best spread is optimization, not representation: the floor is "
                         "the same for every seed of a rank"],
                  charts=[line_chart(curves, "step", "MSE (log), seed 0", log=True)])
