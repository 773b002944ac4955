"""The gated delta rule (Qwen3.5's linear-attention token mixer) as vkdsl ops.

Per head a state S (dk x dv) decays by a_t = exp(g_t), takes a delta-rule write of strength beta_t
(S += k_t beta_t (v_t - S^T k_t)^T after the decay) and is read as o_t = scale S_t^T q_t
(golden/gated_delta.py has the definition, the chunk derivation and a hand-written backward).

`chunked` is the training and prompt form: inside a chunk of C steps everything is a matmul over
the chunk (one unit lower-triangular solve, kernels/tri_inverse.comp), and only the state passes
from chunk to chunk. Its gradient is the autograd of these ops plus the solve's closed form; the
tests hold both to the float64 reference's forward, its hand-derived backward and central
differences. `recurrent` is one step at a time, for generation with a state cache.

Layout: q, k (B, T, H, dk), v (B, T, H, dv), g, beta (B, T, H), state (B, H, dk, dv); q and k
come normalized (the layer's l2norm), and grouped heads come expanded to v's H."""
from __future__ import annotations

import numpy as np

import vkdsl
from vkdsl import Tensor
from vkdsl.custom import CustomOp, custom
from vkdsl.handwritten import KernelVariant, PushLayout, grid_for, variant_family
from vkdsl.tensor import ShapeError

MAX_CHUNK = 64                    # the longest column kernels/tri_inverse.comp keeps per invocation
PUSH = PushLayout("<II", "tri_inverse.comp")
VARIANT = KernelVariant("tri_inverse.comp", "tri_inverse", {"N": MAX_CHUNK}, (64, 1, 1))


@variant_family("delta rule")
def delta_rule_variants(dev) -> list[KernelVariant]:
    """The delta rule's one hand-written kernel (the chunk's triangular solve)."""
    return [VARIANT]


class TriInverse(CustomOp):
    """(I + A)^-1 for a batch of strictly lower-triangular n x n matrices A (..., n, n)."""

    def __init__(self, mats: int, n: int):
        self.mats, self.n = mats, n
        self.name = "tri_inverse"

    def record(self, rec, out, srcs):
        k = VARIANT.build(rec.device, 2, PUSH)
        rec.dispatch(k, [out, srcs[0]], grid_for(rec.device, self.mats * self.n),
                     PUSH.pack(self.mats, self.n))

    def flops(self, node) -> int:
        return self.mats * self.n ** 3 // 3

    def backward(self, node, g, a):
        """T = (I + A)^-1: dA = -T^T dT T^T, on A's strictly lower part (the rest is not read)."""
        t = node.transpose(-1, -2)
        return (-(t @ g @ t) * _mask(self.n, -1),)


def tri_inverse(a: Tensor) -> Tensor:
    n = a.shape[-1]
    if a.ndim < 2 or a.shape[-2] != n or not 0 < n <= MAX_CHUNK:
        raise ShapeError(f"tri_inverse: needs (..., n, n) with 0 < n <= {MAX_CHUNK}, got {a.shape}")
    return custom(TriInverse(int(np.prod(a.shape[:-2])), n), [a], a.shape)


_masks: dict = {}


def _mask(n: int, diagonal: int) -> Tensor:
    """Lower-triangular 0/1 (n, n) constant: 1 where column <= row + diagonal."""
    key = (n, diagonal)
    if key not in _masks:
        _masks[key] = vkdsl.tensor(np.tril(np.ones((n, n), np.float32), diagonal),
                                   name=f"tril{n}_{diagonal}")
    return _masks[key]


def _check(q, k, v, g, beta, state):
    B, T, H, dk = k.shape
    if (q.shape != k.shape or v.shape[:3] != (B, T, H) or g.shape != (B, T, H)
        or beta.shape != (B, T, H)):
        raise ShapeError(f"gated delta rule: q {q.shape}, k {k.shape} must be (B, T, H, dk), v "
                         f"{v.shape} (B, T, H, dv), g {g.shape} and beta {beta.shape} (B, T, H)")
    if state is not None and state.shape != (B, H, dk, v.shape[-1]):
        raise ShapeError(f"gated delta rule: state {state.shape}, expected "
                         f"{(B, H, dk, v.shape[-1])}")


def _concat(parts: list, axis: int) -> Tensor:
    """Tensors equal but for `axis`, joined along it (pairwise, so each level copies the total
    once)."""
    while len(parts) > 1:
        joined = []
        for a, b in zip(parts[0::2], parts[1::2]):
            wa = [(0, 0)] * a.ndim
            wb = list(wa)
            wa[axis], wb[axis] = (0, b.shape[axis]), (a.shape[axis], 0)
            joined.append(a.pad(wa) + b.pad(wb))
        parts = joined + ([parts[-1]] if len(parts) % 2 else [])
    return parts[0]


def chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk: int = MAX_CHUNK,
            state: Tensor | None = None, scale: float | None = None,
            segments: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Outputs (B, T, H, dv) and the state after the last step (None with segments).

    segments (B, T) int32: packed sequences' ids (contiguous runs); the state starts again from
    zero where the id changes. Inside a chunk, steps interact only within their own sequence (the
    solve and the chunk's attention masked to equal ids); the carried state reaches only the steps
    of the sequence the previous chunk ended in, and the next state only gathers the writes of
    the sequence the chunk ends in."""
    _check(q, k, v, g, beta, state)
    B, T, H, dk = k.shape
    if segments is not None and (state is not None or segments.shape != (B, T)):
        raise ShapeError(f"gated delta rule: segments {segments.shape} must be (B, T) = {(B, T)}, "
                         f"and packed sequences start from no state")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 < chunk <= MAX_CHUNK:
        raise ValueError(f"gated delta rule: chunk must be in 1..{MAX_CHUNK}, got {chunk!r}")
    C = min(chunk, T)
    s = dk ** -0.5 if scale is None else float(scale)
    pad = -T % C
    N = (T + pad) // C

    def chunks(x):                      # (B, T, H, ...) -> (B, H, N, C, ...), zero steps appended
        x = x.permute((0, 2, 1) + tuple(range(3, x.ndim)))
        x = x.pad(((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 3))
        return x.reshape(B, H, N, C, *x.shape[3:])
    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    # cumulative log decay
    G = (g.reshape(B, H, N, 1, C) @ _mask(C, 0).transpose(0, 1)).reshape(B, H, N, C)
    lower = _mask(C, 0)
    decay = lower.where(G.reshape(B, H, N, C, 1) - G.reshape(B, H, N, 1, C), 0.0).exp() * lower
    carry = to_last = None
    if segments is not None:  # (B, 1, N, C) ids; appended steps get id 0 (they write nothing)
        seg = segments.pad(((0, 0), (0, pad))).reshape(B, 1, N, C)
        decay = decay * seg.reshape(B, 1, N, C, 1).eq(seg.reshape(B, 1, N, 1, C))
        ends = seg[:, :, :, C - 1:C]                                   # the id each chunk ends in
        # ... the one before it ended in
        before = ends.pad(((0, 0), (0, 0), (1, 0), (0, 0)))[:, :, :N]
        carry, to_last = seg.eq(before), seg.eq(ends)                  # (B, 1, N, C) 0/1
    kT = k.transpose(-1, -2)
    # reads below the diagonal only
    solve = tri_inverse(beta.reshape(B, H, N, C, 1) * (k @ kT) * decay)
    eG = G.exp()
    reach = eG if carry is None else eG * carry  # how much of the entering state a step sees
    U0 = solve @ (v * beta.reshape(B, H, N, C, 1))
    W = solve @ (k * (beta * reach).reshape(B, H, N, C, 1))
    qs = q * s
    QK = (qs @ kT) * decay
    qe = qs * reach.reshape(B, H, N, C, 1)
    last = G[..., C - 1:C]                                      # (B, H, N, 1)
    gather = (last - G).exp() if to_last is None else (last - G).exp() * to_last
    kd = k * gather.reshape(B, H, N, C, 1)
    keep = last.exp() if carry is None else last.exp() * carry[..., C - 1:C]
    S, outs = state, []
    for n in range(N):
        U = U0[:, :, n] if S is None else U0[:, :, n] - W[:, :, n] @ S
        O = QK[:, :, n] @ U
        if S is not None:
            O = O + qe[:, :, n] @ S
        write = kd[:, :, n].transpose(-1, -2) @ U
        S = write if S is None else keep[:, :, n].reshape(B, H, 1, 1) * S + write
        outs.append(O)
    o = _concat(outs, 2)[:, :, :T]
    return o.permute(0, 2, 1, 3), (S if segments is None else None)


def recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None,
              scale: float | None = None) -> tuple[Tensor, Tensor]:
    """One step at a time (generation: T is 1 and `state` is the cache)."""
    _check(q, k, v, g, beta, state)
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    s = dk ** -0.5 if scale is None else float(scale)
    S, outs = state, []
    for t in range(T):
        kt = k[:, t].reshape(B, H, dk, 1)
        if S is None:
            d = v[:, t] * beta[:, t].reshape(B, H, 1)
            S = kt * d.reshape(B, H, 1, dv)
        else:
            S = S * g[:, t].exp().reshape(B, H, 1, 1)
            read = (S * kt).sum(2)
            d = (v[:, t] - read) * beta[:, t].reshape(B, H, 1)
            S = S + kt * d.reshape(B, H, 1, dv)
        outs.append((S * (q[:, t] * s).reshape(B, H, dk, 1)).sum(2).reshape(B, 1, H, dv))
    return _concat(outs, 1), S
