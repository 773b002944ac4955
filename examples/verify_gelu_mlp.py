"""Verify your own kernel, example 1: a fused op written with the DSL, checked with its gradient.

The op is an MLP block, y = gelu_tanh(x @ W1 + b1) @ W2, written with vkdsl tensor ops (the
scheduler fuses the GELU into one generated kernel beside the two matmuls); its gradients come from
vkdsl's autograd. The reference is plain numpy in float64; the gradient references are central
differences of it (no grad_reference given).

    vkdsl verify --cases examples/verify_gelu_mlp.py                    # this device
    vkdsl verify --cases examples/verify_gelu_mlp.py --all-profiles --junit gelu.xml
    vkdsl golden make --cases examples/verify_gelu_mlp.py --out gelu-goldens   # for devices without numpy's
    vkdsl verify --cases examples/verify_gelu_mlp.py --golden gelu-goldens     # reference at hand
"""
import math

import numpy as np

from vkdsl.cases import Case



def gelu_tanh(h):
    """On the device: vkdsl Tensors. GELU's tanh form (Hendrycks and Gimpel), sqrt(2/pi) inlined."""
    return h * 0.5 * (((h + h * h * h * 0.044715) * 0.7978845608028654).tanh() + 1.0)


def mlp_block(x, w1, b1, w2):
    return gelu_tanh(x @ w1 + b1) @ w2


def reference(x, w1, b1, w2):
    """numpy, float64, written apart from the kernel."""
    h = x @ w1 + b1
    return (0.5 * h * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))) @ w2


def draw(n, d, f, o, scale=1.0):
    """Inputs for x (n, d), W1 (d, f), b1 (f,), W2 (f, o): weights scaled as 1/sqrt(fan-in)."""
    def make(rng):
        x = rng.standard_normal((n, d)) * scale
        return [a.astype(np.float32) for a in (x, rng.standard_normal((d, f)) / math.sqrt(d),
                                                rng.standard_normal(f) * 0.1, rng.standard_normal((f, o)) / math.sqrt(f))]
    return make


MATMUL_AND_TANH = ("fp32 sums over at most 512 terms (NMSE ~ K eps32^2 = 7e-12) and Vulkan's tanh (inherited "
                   "precision, ~1e2 ulp where it saturates: NMSE ~ 4e-11): 1e-8 leaves margin, and one wrong "
                   "constant in the GELU moves the NMSE to ~1e-6 or more")

CASES = [
    # gradients of all four inputs by central differences of the float64 reference
    Case("gelu_mlp[7x33x64x17]", mlp_block, reference, draw(7, 33, 64, 17), limit=1e-8, reason=MATMUL_AND_TANH,
         grads=(0, 1, 2, 3)),
    # ragged sizes: one row, dimensions of no tile's multiple
    Case("gelu_mlp[1x5x3x2]", mlp_block, reference, draw(1, 5, 3, 2), limit=1e-8, reason=MATMUL_AND_TANH,
         grads=(0, 1, 2, 3)),
    # pre-activations far into both tails, where tanh saturates and the GELU is x or 0
    Case("gelu_mlp[16x64x128x32,scale=30]", mlp_block, reference, draw(16, 64, 128, 32, scale=30.0), limit=1e-8,
         reason=MATMUL_AND_TANH),
    # a model-sized block, forward only (its gradient would take 2 x 400k reference calls)
    Case("gelu_mlp[256x512x512x256]", mlp_block, reference, draw(256, 512, 512, 256), limit=1e-8,
         reason=MATMUL_AND_TANH),
]
