"""evaluate(op, inputs, params, gout) -> every reference array a golden case stores.

The generator builds its outputs through this table and nothing else, so a device-side
verifier can recompute any case from (op, params, inputs) with the same call.
Output names: "out" (main result), "out_<name>" (extra results), "grad_in<i>" (gradient of
sum(out * gout) w.r.t. input i, only for differentiable float inputs).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from . import gated_delta as GD
from . import reference as R
from . import reference_quant as Q
from . import reference_train as T

Arrays = dict[str, np.ndarray]


def _grads(*gs) -> Arrays:
    """Name gradients grad_in0, grad_in1, ... (None entries are skipped)."""
    return {f"grad_in{i}": np.asarray(g, np.float64) for i, g in enumerate(gs) if g is not None}


# --- phase 1: one output ---------------------------------------------------------------

def _p1(fn: Callable) -> Callable:
    """Wrap fn(inputs, params) -> array as an evaluator returning {"out": ...}."""
    return lambda ins, p, g: {"out": np.asarray(fn(ins, p), np.float64)}


PHASE1: dict[str, Callable] = {}
for _name, _fn in R.UNARY.items():
    PHASE1[_name] = _p1(lambda ins, p, f=_fn: f(ins[0]))
for _name, _fn in R.BINARY.items():
    PHASE1[_name] = _p1(lambda ins, p, f=_fn: f(ins[0], ins[1]))
for _name, _fn in R.REDUCE.items():
    PHASE1[_name] = _p1(lambda ins, p, f=_fn: f(ins[0], p["axis"]))
PHASE1.update({
    "where": _p1(lambda ins, p: R.where(*ins)),
    "matmul": _p1(lambda ins, p: R.matmul(ins[0], ins[1], p["ta"], p["tb"], p.get("batch", False))),
    "matmul_block": _p1(lambda ins, p: R.matmul(ins[0], ins[1], p["ta"], p["tb"])),
    "matmul_f16in": _p1(lambda ins, p: R.matmul_f16in(ins[0], ins[1], p["ta"], p["tb"],
                                                      p.get("batch", False))),
    "half": _p1(lambda ins, p: R.half(ins[0])),
    "permute": _p1(lambda ins, p: R.permute(ins[0], p["axes"])),
    "gather": _p1(lambda ins, p: R.gather(ins[0], ins[1])),
    "fused_chain": _p1(lambda ins, p: R.fused_chain(*ins)),
    "softmax": _p1(lambda ins, p: R.softmax(ins[0], p["axis"])),
    "log_softmax": _p1(lambda ins, p: R.log_softmax(ins[0], p["axis"])),
})


# --- phase 2: forward, extra outputs, closed-form gradients -----------------------------

def _cross_entropy(ins, p, g):
    loss, rows = T.cross_entropy(ins[0], ins[1])
    return {"out": loss, "out_rows": rows, **_grads(T.cross_entropy_backward(ins[0], ins[1], g))}


def _lora_linear(ins, p, g):
    return {"out": T.lora_linear(*ins, p["s"]), **_grads(*T.lora_linear_backward(*ins, p["s"], g))}


def _qlora_linear(ins, p, g):
    """A LoRA layer on a packed weight W (N, K): x W^T + s (x A) B; W is frozen (no gradient).
    Inputs: x, W's arrays (PACKED_ARRAYS), A, B."""
    n = PACKED_ARRAYS.get(p["fmt"], 1)
    x, a, b = ins[0], ins[1 + n], ins[2 + n]
    wt = Q.packed_weight(ins[1:1 + n], p["fmt"], tuple(p["shape"])).T
    dx, _, da, db = T.lora_linear_backward(x, wt, a, b, p["s"], g)
    return {"out": T.lora_linear(x, wt, a, b, p["s"]), **_grads(dx, *[None] * n, da, db)}


def _qlinear(ins, p, g):
    """x W^T on a packed weight W (N, K) (GGUF bytes, or int4's / NF4's arrays), and the input's
    gradient g W (the product's nn form)."""
    w = Q.packed_weight(ins[1:], p["fmt"], tuple(p["shape"]))
    return {"out": R.matmul(ins[0], w, tb=True), **_grads(R.matmul(g, w))}


def _rmsnorm(ins, p, g):
    return {"out": T.rmsnorm(*ins, p["eps"]), **_grads(*T.rmsnorm_backward(*ins, p["eps"], g))}


def _rope(ins, p, g):
    return {"out": T.rope(ins[0], ins[1], p["base"]),
            **_grads(T.rope_backward(ins[0], ins[1], p["base"], g))}


def _silu(ins, p, g):
    return {"out": T.silu(ins[0]), **_grads(T.silu_backward(ins[0], g))}


def _swiglu(ins, p, g):
    return {"out": T.swiglu(*ins), **_grads(*T.swiglu_backward(*ins, g))}


def _attention(ins, p, g):
    return {"out": T.attention(*ins), **_grads(*T.attention_backward(*ins, g))}


def _gated_delta(ins, p, g):
    return {"out": GD.recurrent(*ins)[0], **_grads(*GD.recurrent_backward(*ins, g)[:5])}


def _tri_inverse(ins, p, g):
    return {"out": GD.tri_inverse(ins[0]), **_grads(GD.tri_inverse_backward(ins[0], g))}


def _kl(ins, p, g):
    loss, rows = T.kl(*ins)
    return {"out": loss, "out_rows": rows, **_grads(*T.kl_backward(*ins, g))}


def _tmkl(ins, p, g):
    loss, rows = T.tmkl(*ins)
    return {"out": loss, "out_rows": rows, **_grads(*T.tmkl_backward(*ins, g))}


def _dpo(ins, p, g):
    loss, rows = T.dpo(*ins, p["beta"])
    return {"out": loss, "out_rows": rows, **_grads(*T.dpo_backward(*ins, p["beta"], g))}


def _adamw(ins, p, g):
    keys = ("step", "lr", "beta1", "beta2", "eps", "weight_decay")
    new_p, m, v = T.adamw(*ins, **{k: p[k] for k in keys})
    return {"out": new_p, "out_m": m, "out_v": v}


def _clip(ins, p, g):
    clipped, norm = T.clip_grad_norm(ins, p["max_norm"])
    return {"out": norm, **{f"out_clipped{i}": c for i, c in enumerate(clipped)}}


def _int4(ins, p, g):
    deq, packed, scales = Q.int4_roundtrip(ins[0], p["group"])
    return {"out": deq, "out_codes": packed, "out_scales": scales}


def _nf4(ins, p, g):
    deq, q = Q.nf4_roundtrip(ins[0])
    return {"out": deq, **{f"out_{k}": v for k, v in q.items()}}


def _dequant(fn):
    return lambda ins, p, g: {"out": fn(ins[0], tuple(p["shape"]))}


PHASE2: dict[str, Callable] = {
    "cross_entropy": _cross_entropy, "lora_linear": _lora_linear, "qlora_linear": _qlora_linear,
    "qlinear": _qlinear, "rmsnorm": _rmsnorm,
    "rope": _rope, "silu": _silu, "swiglu": _swiglu, "attention": _attention,
    "gated_delta": _gated_delta, "tri_inverse": _tri_inverse,
    "kl": _kl, "tmkl": _tmkl, "dpo": _dpo, "adamw": _adamw, "clip_grad_norm": _clip,
    "int4_roundtrip": _int4, "nf4_roundtrip": _nf4,
    "dequant_q8_0": _dequant(Q.dequant_q8_0), "dequant_q4_0": _dequant(Q.dequant_q4_0),
    "dequant_q4_1": _dequant(Q.dequant_q4_1), "dequant_f16": _dequant(Q.dequant_f16),
    "dequant_q4_k": _dequant(Q.dequant_q4_k), "dequant_q5_k": _dequant(Q.dequant_q5_k),
    "dequant_q6_k": _dequant(Q.dequant_q6_k),
    "qmatmul_f16in": lambda ins, p, g: {
        "out": Q.qmatmul_f16in(ins[0], ins[1], p["fmt"], p["shape"], p["form"])},
    "qgather": lambda ins, p, g: {"out": Q.qgather(ins[0], ins[1], p["fmt"], p["shape"])},
}

# ops whose cases carry an upstream gradient "gout" (same shape as "out"), and the inputs each
# one's gradients are of (evaluate checks that it returns exactly those)
GRAD_INPUTS = {"cross_entropy": (0,), "lora_linear": (0, 1, 2, 3), "qlora_linear": (0, 2, 3),
               "qlinear": (0,),
               "rmsnorm": (0, 1), "rope": (0,),
               "silu": (0,), "swiglu": (0, 1), "attention": (0, 1, 2),
               "gated_delta": (0, 1, 2, 3, 4), "tri_inverse": (0,), "kl": (0, 1), "tmkl": (0, 1),
               "dpo": (0, 1, 2, 3)}
BACKWARD_OPS = frozenset(GRAD_INPUTS)
# a packed weight is one input of GGUF bytes, or these many arrays (reference_quant's layouts)
PACKED_ARRAYS = {"int4": 2, "nf4": 4}


def grad_inputs(op: str, params: dict) -> tuple:
    """The inputs whose gradients a case of op stores: GRAD_INPUTS, but qlora_linear's A and B
    come after however many arrays its weight's format has."""
    if op == "qlora_linear":
        a = 1 + PACKED_ARRAYS.get(params["fmt"], 1)
        return 0, a, a + 1
    return GRAD_INPUTS.get(op, ())

OPS: dict[str, Callable] = {**PHASE1, **PHASE2}


def evaluate(op: str, inputs: Sequence[np.ndarray], params: dict,
             gout: np.ndarray | None = None) -> Arrays:
    """All reference arrays for one case: {"out", "out_*", "grad_in*"}; gout needed for
    BACKWARD_OPS."""
    if op not in OPS:
        raise KeyError(f"unknown golden op {op!r}")
    if op in BACKWARD_OPS and gout is None:
        raise ValueError(f"op {op!r} needs an upstream gradient gout")
    res = {k: np.asarray(v) for k, v in OPS[op](list(inputs), params, gout).items()}
    if gout is not None and np.shape(gout) != res["out"].shape:
        raise ValueError(f"gout shape {np.shape(gout)} differs from out shape {res['out'].shape}")
    grads = tuple(sorted(int(k[len("grad_in"):]) for k in res if k.startswith("grad_in")))
    if grads != grad_inputs(op, params):
        raise ValueError(f"op {op!r} returned gradients of inputs {grads}, grad_inputs says "
                         f"{grad_inputs(op, params)}")
    return res
