"""Closed-form gradients of the training references against central finite differences."""
from __future__ import annotations

import math

import numpy as np

from vkdsl_golden import reference_train as T
from vkdsl_golden.dispatch import evaluate
from vkdsl_golden.store import load_case

from golden_common import (_case, _loss, f64, fd_check, rng0)


# =======================================================================================
# phase 2: closed-form gradients vs central finite differences (float64, ~1e-6 relative)
# =======================================================================================



def test_fd_cross_entropy():
    r = rng0(10)
    x, lab, g = r.standard_normal((4, 5)) * 2, np.array([1, -100, 0, 4]), np.float64(1.3)
    fd_check(lambda: T.cross_entropy(x, lab)[0], x, T.cross_entropy_backward(x, lab, g), g)


def test_fd_lora_linear():
    r = rng0(11)
    ins = [r.standard_normal(s) for s in [(3, 5), (5, 4), (5, 2), (2, 4)]]
    g = r.standard_normal((3, 4))
    grads = T.lora_linear_backward(*ins, 0.7, g)
    for x, gr in zip(ins, grads):
        fd_check(lambda: T.lora_linear(*ins, 0.7), x, gr, g)


def test_fd_rmsnorm():
    r = rng0(12)
    x, w, g = r.standard_normal((3, 5)), r.uniform(0.5, 1.5, 5), r.standard_normal((3, 5))
    dx, dw = T.rmsnorm_backward(x, w, 1e-5, g)
    fd_check(lambda: T.rmsnorm(x, w, 1e-5), x, dx, g)
    fd_check(lambda: T.rmsnorm(x, w, 1e-5), w, dw, g)


def test_fd_rope():
    r = rng0(13)
    x, pos, g = r.standard_normal((3, 2, 6)), np.array([0, 1, 7]), r.standard_normal((3, 2, 6))
    fd_check(lambda: T.rope(x, pos, 100.0), x, T.rope_backward(x, pos, 100.0, g), g)


def test_fd_silu_swiglu():
    r = rng0(14)
    x, u, g = r.standard_normal((3, 4)) * 3, r.standard_normal((3, 4)), r.standard_normal((3, 4))
    fd_check(lambda: T.silu(x), x, T.silu_backward(x, g), g)
    dgate, dup = T.swiglu_backward(x, u, g)
    fd_check(lambda: T.swiglu(x, u), x, dgate, g)
    fd_check(lambda: T.swiglu(x, u), u, dup, g)


def test_fd_attention_gqa():
    r = rng0(15)
    q, k, v = r.standard_normal((4, 4, 3)), r.standard_normal((4, 2, 3)), r.standard_normal((4, 2, 3))
    g = r.standard_normal((4, 4, 3))
    for x, gr in zip((q, k, v), T.attention_backward(q, k, v, g)):
        fd_check(lambda: T.attention(q, k, v), x, gr, g)


def test_fd_kl_tmkl():
    r = rng0(16)
    lp, lq, g = r.standard_normal((3, 5)) * 2, r.standard_normal((3, 5)) * 2, np.float64(0.8)
    for x, gr in zip((lp, lq), T.kl_backward(lp, lq, g)):
        fd_check(lambda: T.kl(lp, lq)[0], x, gr, g)
    lab = np.array([2, -100, 0, 4])
    a, b = r.standard_normal((4, 5)) * 2, r.standard_normal((4, 5)) * 2
    for x, gr in zip((a, b), T.tmkl_backward(a, b, lab, g)):
        fd_check(lambda: T.tmkl(a, b, lab)[0], x, gr, g)


def test_fd_dpo_and_sequence_logprob():
    r = rng0(17)
    ins = [-r.uniform(5, 30, 3) for _ in range(4)]
    g = np.float64(1.1)
    for x, gr in zip(ins, T.dpo_backward(*ins, 0.3, g)):
        fd_check(lambda: T.dpo(*ins, 0.3)[0], x, gr, g)
    logits, lab, gs = r.standard_normal((2, 3, 5)), np.array([[1, -100, 4], [-100, 0, 2]]), r.standard_normal(2)
    fd_check(lambda: T.sequence_logprob(logits, lab), logits,
             T.sequence_logprob_backward(logits, lab, gs), gs)


def test_stored_phase2_gradients_match_fd_on_small_cases():
    # the stored grad arrays themselves, against FD of the stored forward (small cases only)
    for name in ["cross_entropy[7x33]", "kl[7x33]", "tmkl[7x33]", "dpo[n=5]",
                 "lora_linear[7x33x17,r=4]", "rmsnorm[7x33]", "rope[5x2x8,pos=mixed]",
                 "swiglu[7x33]", "attention[7x6x16,kv=2]"]:
        c = _case(None, name)
        a = load_case(c)
        ins = [a[k].astype(f64) if a[k].dtype == np.float32 else a[k] for k in c["inputs"]]
        g = a["gout"].astype(f64)
        for i, x in enumerate(ins):
            if f"grad_in{i}" not in a:
                continue
            # one random direction per input keeps this cheap: d/dt L(x + t*u) = <grad, u>
            u = rng0(i).standard_normal(x.shape)
            h = 1e-6
            lp = _loss(lambda: evaluate(c["op"], [*ins[:i], x + h * u, *ins[i + 1:]], c["params"], g)["out"], g)
            lm = _loss(lambda: evaluate(c["op"], [*ins[:i], x - h * u, *ins[i + 1:]], c["params"], g)["out"], g)
            want = math.fsum((a[f"grad_in{i}"] * u).ravel().tolist())
            assert abs((lp - lm) / (2 * h) - want) <= 1e-6 * max(1e-3, abs(want)), (name, i)
