"""Every golden case of version 1: the op, its parameters and how its inputs are drawn (odd
sizes, extremes, ties, masks). generate.py turns each into stored arrays."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import gated_delta as GD
from .elementary import pow_pos

@dataclass
class Case:
    name: str
    op: str
    params: dict
    make: Callable[[np.random.Generator], list]   # rng -> inputs as the device gets them
    gout_shape: tuple | None = None                # upstream gradient shape (backward ops)


# ---------------------------------------------------------------------------------------
# value helpers: float data is float32, indices/labels int32
# ---------------------------------------------------------------------------------------

def U(rng, shape, lo, hi):
    """float32 uniform in [lo, hi)."""
    return np.asarray(rng.uniform(lo, hi, shape), dtype=np.float32)


def N(rng, shape, scale=1.0):
    """float32 normal(0, scale)."""
    return np.asarray(rng.standard_normal(shape) * scale, dtype=np.float32)


def LOGU(rng, shape, lo_exp, hi_exp):
    """float32 positive values 10**uniform(lo_exp, hi_exp)."""
    return np.asarray(pow_pos(10.0, rng.uniform(lo_exp, hi_exp, shape)), dtype=np.float32)


def SIGNED(rng, x):
    """x with random signs."""
    return np.where(rng.random(np.shape(x)) < 0.5, -x, x).astype(np.float32)


def I32(x):
    """int32 array."""
    return np.asarray(x, dtype=np.int32)


def shp(shape) -> str:
    """(33, 1023) -> '33x1023'; () -> '0d'."""
    return "x".join(map(str, shape)) if len(shape) else "0d"


# ---------------------------------------------------------------------------------------
# phase 1: core DSL
# ---------------------------------------------------------------------------------------

UNARY_DOMAINS = {   # op -> (typical sampler, [(tag, extreme sampler)])
    "neg": (lambda r, s: N(r, s), [("mag=1e4", lambda r, s: U(r, s, -1e4, 1e4))]),
    "exp": (lambda r, s: U(r, s, -5, 5), [("range=-80..80", lambda r, s: U(r, s, -80, 80))]),
    "log": (lambda r, s: LOGU(r, s, -2, 2),
            [("range=1e-30..1e30", lambda r, s: LOGU(r, s, -30, 30))]),
    "sqrt": (lambda r, s: LOGU(r, s, -2, 2),
             [("range=1e-30..1e30", lambda r, s: LOGU(r, s, -30, 30))]),
    "rsqrt": (lambda r, s: LOGU(r, s, -2, 2),
              [("range=1e-30..1e30", lambda r, s: LOGU(r, s, -30, 30))]),
    "tanh": (lambda r, s: N(r, s, 2.0), [("range=-30..30", lambda r, s: U(r, s, -30, 30)),
                                         ("range=1e-8..1e-2",
                                          lambda r, s: SIGNED(r, LOGU(r, s, -8, -2)))]),
}


def unary_cases():
    out = []
    for op, (typical, extremes) in UNARY_DOMAINS.items():
        for shape in [(1,), (3,), (7, 33), (1023,)]:
            out.append(Case(f"{op}[{shp(shape)}]", op, {}, lambda r, f=typical, s=shape: [f(r, s)]))
        for tag, fn in extremes:
            out.append(Case(f"{op}[1023,{tag}]", op, {}, lambda r, f=fn: [f(r, (1023,))]))
    return out


BROADCASTS = [((7, 33), (7, 33)), ((33, 1023), (1023,)), ((33, 1), (33, 1023)),
              ((), (1023,)), ((1023,), (1,)), ((3, 1, 7), (1, 33, 7))]


def _binary_inputs(op, rng, sa, sb, mag):
    """Inputs for one binary case; div denominators stay away from 0."""
    if mag:
        a = U(rng, sa, -1e4, 1e4)
        b = SIGNED(rng, LOGU(rng, sb, -1, 4)) if op == "div" else U(rng, sb, -1e4, 1e4)
    else:
        a = N(rng, sa)
        b = SIGNED(rng, U(rng, sb, 0.5, 4.0)) if op == "div" else N(rng, sb)
    return [a, b]


def binary_cases():
    out = []
    for op in ["add", "sub", "mul", "div", "maximum"]:
        for sa, sb in BROADCASTS:
            if 33 in sa + sb and 1023 in sa + sb and op not in ("add", "div"):
                continue            # the 33x1023 broadcasts once per code path keep the data small
            out.append(Case(f"{op}[{shp(sa)}+{shp(sb)}]", op, {},
                            lambda r, o=op, a=sa, b=sb: _binary_inputs(o, r, a, b, False)))
        out.append(Case(f"{op}[1023+1023,mag=1e4]", op, {},
                        lambda r, o=op: _binary_inputs(o, r, (1023,), (1023,), True)))
    return out


def _no_ties(a, b):
    """cmplt cases must not contain a == b anywhere (the result would hinge on rounding)."""
    assert not np.any(np.broadcast_to(a, np.broadcast_shapes(a.shape, b.shape)) == b), "tie"
    return [a, b]


def _ulp_pairs(rng):
    """b = a moved one float32 ulp up or down: the comparison must be exact."""
    a = N(rng, (1023,))
    up = rng.random(1023) < 0.5
    b = np.where(up, np.nextafter(a, np.float32(np.inf)), np.nextafter(a, np.float32(-np.inf)))
    return _no_ties(a, b.astype(np.float32))


def compare_select_cases():
    out = [
        Case("cmplt[7x33+7x33]", "cmplt", {}, lambda r: _no_ties(N(r, (7, 33)), N(r, (7, 33)))),
        Case("cmplt[3x1x7+1x33x7]", "cmplt", {},
             lambda r: _no_ties(N(r, (3, 1, 7)), N(r, (1, 33, 7)))),
        Case("cmplt[0d+1023]", "cmplt", {}, lambda r: _no_ties(N(r, ()), N(r, (1023,)))),
        Case("cmplt[1023+1023,mag=1e4]", "cmplt", {},
             lambda r: _no_ties(U(r, (1023,), -1e4, 1e4), U(r, (1023,), -1e4, 1e4))),
        Case("cmplt[1023+1023,ulp]", "cmplt", {}, _ulp_pairs),
    ]
    cond = lambda r, s: (r.random(s) < 0.5).astype(np.float32)  # noqa: E731
    for sc, sx, sy in [((7, 33), (7, 33), (7, 33)), ((3, 1, 7), (1, 33, 7), (7,)),
                       ((1023,), (1023,), ()), ((1,), (33,), (7, 1))]:
        out.append(Case(f"where[{shp(sc)}+{shp(sx)}+{shp(sy)}]", "where", {},
                        lambda r, a=sc, b=sx, c=sy: [cond(r, a), N(r, b), N(r, c)]))
    return out


REDUCE_SHAPES = [((1,), 0), ((7,), 0), ((1023,), 0), ((33, 1023), 0), ((33, 1023), 1),
                 ((3, 7, 33), 1), ((2, 3, 4097), 2)]


def reduce_cases():
    out = []
    for op in ["sum", "max", "mean"]:
        for shape, axis in REDUCE_SHAPES:
            out.append(Case(f"{op}[{shp(shape)},axis={axis}]", op, {"axis": axis},
                            lambda r, s=shape: [N(r, s)]))
        # large magnitude, one sign: accumulation error shows, the reference stays well scaled
        out.append(Case(f"{op}[7x1023,axis=1,mag=1e4]", op, {"axis": 1},
                        lambda r: [np.float32(1e4) + N(r, (7, 1023), 100.0)]))
    return out


MATMUL_SHAPES = [(1, 1, 1), (3, 7, 33), (33, 1023, 7), (64, 64, 64), (7, 33, 1023), (129, 257, 95)]


def _mm_inputs(rng, m, k, n, ta, tb, batch=()):
    """A (.., M, K) / B (.., K, N) stored as the op reads them: ta -> (.., K, M), tb -> (.., N,
    K)."""
    a = U(rng, batch + ((k, m) if ta else (m, k)), -1, 1)
    b = U(rng, batch + ((n, k) if tb else (k, n)), -1, 1)
    return [a, b]


def matmul_cases():
    out = []
    for form, ta, tb in [("nn", False, False), ("nt", False, True), ("tn", True, False)]:
        for m, k, n in MATMUL_SHAPES:
            out.append(Case(f"matmul[{form},{m}x{k}x{n}]", "matmul", {"ta": ta, "tb": tb},
                            lambda r, m=m, k=k, n=n, ta=ta, tb=tb: _mm_inputs(r, m, k, n, ta, tb)))
    for bsz, m, k, n in [(3, 33, 7, 5), (2, 64, 64, 64)]:
        out.append(Case(f"matmul[nn,batch={bsz},{m}x{k}x{n}]", "matmul",
                        {"ta": False, "tb": False, "batch": True},
                        lambda r, b=bsz, m=m, k=k, n=n: _mm_inputs(r, m, k, n, False, False, (b,))))
    return out


def layout_cases():
    out = []
    for shape, axes in [((3, 7, 33), (2, 0, 1)), ((3, 7, 33), (1, 0, 2)), ((33, 1023), (1, 0)),
                        ((1, 1023), (1, 0))]:
        out.append(Case(f"permute[{shp(shape)},axes=({','.join(map(str, axes))})]", "permute",
                        {"axes": list(axes)}, lambda r, s=shape: [N(r, s)]))

    def idx_big(r):
        i = r.integers(0, 1023, 129)
        i[0], i[-1], i[64] = 0, 1022, i[63]   # first row, last row, a repeat
        return I32(i)
    out.append(Case("gather[3x1,n=3]", "gather", {}, lambda r: [N(r, (3, 1)), I32([2, 0, 2])]))
    out.append(Case("gather[50x33,n=7]", "gather", {},
                    lambda r: [N(r, (50, 33)), I32([0, 49, 7, 7, 23, 0, 31])]))
    out.append(Case("gather[1023x64,n=129]", "gather", {},
                    lambda r: [N(r, (1023, 64)), idx_big(r)]))
    out.append(Case("fused_chain[33x1023+1023+33x1]", "fused_chain", {},
                    lambda r: [U(r, (33, 1023), -2, 2), U(r, (1023,), -2, 2),
                               U(r, (33, 1), -1, 1)]))
    out.append(Case("fused_chain[3x7+7+3x1]", "fused_chain", {},
                    lambda r: [U(r, (3, 7), -2, 2), U(r, (7,), -2, 2), U(r, (3, 1), -1, 1)]))
    return out


def _with_neg_inf(rng):
    """(7, 33) logits with ~40% -inf per row, row 0 keeping a single finite entry."""
    x = N(rng, (7, 33), 3.0)
    mask = rng.random((7, 33)) < 0.4
    mask[0] = True
    mask[0, 17] = False
    mask[np.arange(7), rng.integers(0, 33, 7)] &= np.arange(7) == 0  # >= 1 finite in other rows
    x[mask] = -np.inf
    assert np.all(np.isfinite(x).any(-1))
    return [x]


def softmax_cases():
    out = []
    for op in ["softmax", "log_softmax"]:
        for shape in [(3, 1), (1, 7), (33, 1023), (1, 49152)]:   # 3x1: one-entry rows
            out.append(Case(f"{op}[{shp(shape)}]", op, {"axis": -1},
                            lambda r, s=shape: [N(r, s, 3.0)]))
        out.append(Case(f"{op}[7x1023,mag=1e4]", op, {"axis": -1},
                        lambda r: [U(r, (7, 1023), -1e4, 1e4)]))
        out.append(Case(f"{op}[7x33,-inf]", op, {"axis": -1}, _with_neg_inf))
    return out


# ---------------------------------------------------------------------------------------
# phase 2: training ops (backward ops carry gout of out's shape)
# ---------------------------------------------------------------------------------------

def _labels(rng, n, v, ignore_frac, force=()):
    """int32 labels in [0, v) with about ignore_frac of them -100; forced (index, value) pairs."""
    lab = rng.integers(0, v, n)
    lab[rng.random(n) < ignore_frac] = -100
    for i, val in force:
        lab[i] = val
    assert (lab != -100).any()
    return I32(lab)


def loss_cases():
    out = []
    ce = [("7x33", 7, 33, 2.0, [(0, 0), (1, 32), (2, -100), (5, -100)]),
          ("9x1023", 9, 1023, 2.0, [(0, -100)]),
          ("5x257,mag=30", 5, 257, 30.0, [(3, -100)])]
    for tag, n, v, scale, force in ce:
        out.append(Case(f"cross_entropy[{tag}]", "cross_entropy", {"ignore_index": -100},
                        lambda r, n=n, v=v, s=scale, f=force: [
                            N(r, (n, v), s), _labels(r, n, v, 0.2, f)],
                        ()))
    for n, v in [(7, 33), (3, 1023)]:
        out.append(Case(f"kl[{n}x{v}]", "kl", {},
                        lambda r, n=n, v=v: [N(r, (n, v), 2.0), N(r, (n, v), 2.0)], ()))
    for n, v, force in [(7, 33, [(1, -100), (2, 0), (3, 32)]), (3, 1023, [(2, -100)])]:
        out.append(Case(f"tmkl[{n}x{v}]", "tmkl", {"ignore_index": -100},
                        lambda r, n=n, v=v, f=force: [N(r, (n, v), 2.0), N(r, (n, v), 2.0),
                                                      _labels(r, n, v, 0.2, f)], ()))

    def dpo_in(r, n, same, spread):
        pc, pr = -U(r, (n,), 5, 60), -U(r, (n,), 5, 60)
        if same:
            return [pc, pr, pc.copy(), pr.copy()]
        return [pc, pr, pc + N(r, (n,), spread), pr + N(r, (n,), spread)]
    for tag, n, beta, same, spread in [("n=5", 5, 0.1, False, 3.0),
                                       ("n=3,policy=ref", 3, 0.1, True, 0),
                                       ("n=7,wide", 7, 1.0, False, 40.0)]:
        out.append(Case(f"dpo[{tag}]", "dpo", {"beta": beta},
                        lambda r, n=n, s=same, sp=spread: dpo_in(r, n, s, sp), ()))
    return out


def layer_cases():
    out = []
    for tag, n, din, dout, rank, s, zero_b in [("7x33x17,r=4", 7, 33, 17, 4, 2.0, False),
                                               ("33x64x95,r=8", 33, 64, 95, 8, 0.5, False),
                                               ("7x33x17,r=4,B=0", 7, 33, 17, 4, 2.0, True)]:
        def mk(r, n=n, din=din, dout=dout, rank=rank, zb=zero_b):
            b = np.zeros((rank, dout), np.float32) if zb else N(r, (rank, dout), 0.1)
            return [N(r, (n, din)), N(r, (din, dout), 1.0 / math.sqrt(din)), N(r, (din, rank), 0.1),
                    b]
        out.append(Case(f"lora_linear[{tag}]", "lora_linear", {"s": s}, mk, (n, dout)))
    for tag, shape, scale in [("7x33", (7, 33), 1.0), ("3x576", (3, 576), 1.0),
                              ("4x64,small", (4, 64), 1e-3)]:
        out.append(Case(f"rmsnorm[{tag}]", "rmsnorm", {"eps": 1e-5},
                        lambda r, s=shape, k=scale: [N(r, s, k), U(r, s[-1:], 0.5, 1.5)], shape))
    for tag, shape, base, pos in [("7x3x64", (7, 3, 64), 100000.0, list(range(7))),
                                  ("33x1x64", (33, 1, 64), 100000.0, list(range(33))),
                                  ("5x2x8,pos=mixed", (5, 2, 8), 10000.0,
                                   [100, 101, 102, 4095, 0])]:
        out.append(Case(f"rope[{tag}]", "rope", {"base": base},
                        lambda r, s=shape, p=pos: [N(r, s), I32(p)], shape))
    for tag, shape, fn in [("1023", (1023,), lambda r, s: N(r, s, 4.0)),
                           ("7x33,range=-30..30", (7, 33), lambda r, s: U(r, s, -30, 30))]:
        out.append(Case(f"silu[{tag}]", "silu", {}, lambda r, s=shape, f=fn: [f(r, s)], shape))
    for shape in [(7, 33), (1, 1536)]:
        out.append(Case(f"swiglu[{shp(shape)}]", "swiglu", {},
                        lambda r, s=shape: [N(r, s, 3.0), N(r, s)], shape))
    # long windows: the kernels of the short rows' head shapes, at 2048 and 4096 tokens
    for t, hq, hkv, d in [(1, 2, 1, 8), (7, 6, 2, 16), (5, 2, 2, 8), (17, 9, 3, 64), (70, 4, 2, 16),
                          (130, 6, 2, 32), (2048, 2, 1, 16), (4096, 2, 1, 8)]:
        out.append(Case(f"attention[{t}x{hq}x{d},kv={hkv}]", "attention", {},
                        lambda r, t=t, hq=hq, hkv=hkv, d=d: [N(r, (t, hq, d)), N(r, (t, hkv, d)),
                                                             N(r, (t, hkv, d))], (t, hq, d)))
    # Qwen3.5's Gated DeltaNet: the chunked delta rule (chunks of 8 over 37 steps; two chunks of 64
    # with padding; the model's head size 128 in one chunk) and its chunk solve
    for t, h, dk, dv, chunk in [(37, 3, 8, 6, 8), (130, 2, 16, 16, 64), (64, 1, 128, 128, 64)]:
        out.append(Case(f"gated_delta[{t}x{h}x{dk}x{dv},chunk={chunk}]", "gated_delta",
                        {"chunk": chunk},
                        lambda r, t=t, h=h, dk=dk, dv=dv: GD.draw(r, t, h, dk, dv), (1, t, h, dv)))
    for shape in [(6, 7, 7), (4, 64, 64)]:
        out.append(Case(f"tri_inverse[{shp(shape)}]", "tri_inverse", {},
                        lambda r, s=shape: [np.tril(N(r, s, 0.3), -1)], shape))
    return out


def optim_cases():
    out = []
    hp = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
    out.append(Case("adamw[33x17,step=1]", "adamw", {**hp, "step": 1},
                    lambda r: [N(r, (33, 17)), N(r, (33, 17), 0.1), np.zeros((33, 17), np.float32),
                               np.zeros((33, 17), np.float32)]))
    out.append(Case("adamw[1023,step=10]", "adamw", {**hp, "step": 10},
                    lambda r: [N(r, (1023,)), N(r, (1023,), 0.1), N(r, (1023,), 0.01),
                               U(r, (1023,), 0, 1e-4)]))
    for max_norm in [1.0, 1000.0]:
        out.append(Case(f"clip_grad_norm[7x33+17+3x5,max_norm={max_norm:g}]", "clip_grad_norm",
                        {"max_norm": max_norm},
                        lambda r: [N(r, (7, 33)), N(r, (17,)), N(r, (3, 5))]))
    return out


def all_cases() -> list[Case]:
    """The version-1 cases of the elementwise, reduction, matmul, layout, loss, layer and optimizer
    ops, in manifest order (cases_gpu.every_case: then the quantized, fp16 and GPU-block ones)."""
    return (unary_cases() + binary_cases() + compare_select_cases() + reduce_cases()
            + matmul_cases() + layout_cases() + softmax_cases()
            + loss_cases() + layer_cases() + optim_cases())
