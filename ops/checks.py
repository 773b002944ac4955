"""verify rows for the op library: how each golden op is built from vkdsl.ops, with the error
limit and the reason for it. Gradients (grad_in*) come from vkdsl.autograd."""
from __future__ import annotations

import vkdsl
from vkdsl.verify import register

from . import attention, gated_delta, losses, nn
from .lora import LoRA, lora_linear
from .optim import adamw_update, clip_by_global_norm

_SOFT = (1e-9, "exp/log over a row plus a sum of <= 49152 terms in fp32: NMSE ~ n*eps^2 ~ "
               "7e-10 worst case, typically far less")
_LOSS = (1e-8, "composite of log-softmax, masked sums and a division in fp32; gradients add "
               "a backward pass of the same depth")
_NET = (1e-8, "chains of fp32 matmuls (K <= 64) and reductions forward and backward")

register("softmax", lambda i, p: nn.softmax(i[0], p["axis"]), *_SOFT)
register("log_softmax", lambda i, p: nn.log_softmax(i[0], p["axis"]), *_SOFT)


def _ce(i, p):
    mean, per = losses.cross_entropy(i[0], i[1])
    return {"out": mean, "out_rows": per}


def _kl(i, p):
    rows = losses.kl(i[0], i[1])
    return {"out": rows.mean(), "out_rows": rows}


def _tmkl(i, p):
    return {"out": losses.tmkl(i[0], i[1], i[2])}


def _dpo(i, p):
    mean, margin = losses.dpo(*i, beta=p["beta"])
    return {"out": mean, "out_rows": losses.softplus(-margin)}


def _rope(i, p):
    cos, sin = nn.rope_tables(i[1].numpy(), i[0].shape[-1], p["base"])
    return nn.rope(i[0], vkdsl.tensor(cos), vkdsl.tensor(sin))


def _attention(i, p):
    T, Hq, D = i[0].shape
    Hkv = i[1].shape[1]
    return attention.attention(i[0].reshape(1, T, Hq, D), i[1].reshape(1, T, Hkv, D),
                        i[2].reshape(1, T, Hkv, D)).reshape(T, Hq, D)


def _adamw(i, p):
    t = p["step"]
    b1, b2 = p["beta1"], p["beta2"]
    new_p, m, v = adamw_update(i[0], i[1], i[2], i[3], p["lr"], 1 / (1 - b1 ** t),
                               1 / (1 - b2 ** t), b1, b2, p["eps"], p["weight_decay"])
    return {"out": new_p, "out_m": m, "out_v": v}


def _clip(i, p):
    clipped, norm = clip_by_global_norm(i, p["max_norm"])
    return {"out": norm, **{f"out_clipped{k}": c for k, c in enumerate(clipped)}}


register("cross_entropy", _ce, *_LOSS)
register("kl", _kl, *_LOSS)
register("tmkl", _tmkl, *_LOSS)
register("dpo", _dpo, 1e-10, "softplus of a few fp32 differences: a handful of roundings")
register("lora_linear", lambda i, p: lora_linear(i[0], i[1], LoRA(i[2], i[3], p["s"])), *_NET)
register("rmsnorm", lambda i, p: nn.rmsnorm(i[0], i[1], p["eps"]), *_NET)
register("rope", _rope, 1e-8, "cos/sin tables from float64 angles rounded to fp32 (positions up to "
                              "4095 are exact there); one fp32 rotation per pair")
register("silu", lambda i, p: nn.silu(i[0]), 1e-10, "exp plus two correctly rounded operations")
register("swiglu", lambda i, p: nn.swiglu(i[0], i[1]), 1e-10,
         "exp plus three correctly rounded operations")
register("attention", _attention, *_NET)
register("gated_delta", lambda i, p: gated_delta.chunked(*i, chunk=p["chunk"])[0], 1e-10,
         "the chunked delta rule in fp32: per chunk matmuls over <= 128 features and a "
         "forward-substitution solve whose entries stay O(1) (|k| = 1, beta < 1, decays <= 1), "
         "then the state carried across <= 3 chunks; errors ~1e-7 relative (NMSE ~1e-13) against "
         "the float64 step-by-step loop")
register("tri_inverse", lambda i, p: gated_delta.tri_inverse(i[0]), 1e-12,
         "forward substitution over <= 64 rows of O(0.3) entries: a few correctly rounded fp32 "
         "operations per term, NMSE ~ n eps^2")
register("adamw", _adamw, 1e-10, "a few correctly rounded fp32 operations per element and one sqrt")
register("clip_grad_norm", _clip, 1e-10,
         "an fp32 sum of squares over <= 1023 terms, then one scale")
