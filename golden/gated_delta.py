"""The gated delta rule (Gated DeltaNet's token mixer) in float64, written from its definition.

Per head, a state S (dk x dv) is carried over the sequence. At step t, with a_t = exp(g_t) (g_t <= 0
is the log decay) and beta_t in (0, 1) the write strength:

    S' = a_t S_{t-1}                      decay
    d_t = beta_t (v_t - S'^T k_t)         what the key should read, minus what it reads now
    S_t = S' + k_t d_t^T                  the delta-rule write
    o_t = scale * S_t^T q_t               read with the query (scale = dk^-1/2 unless given)

`recurrent` is that loop; `chunked` computes the same outputs a chunk of C steps at a time
(derivation in its docstring) and is what training and prompts use; `recurrent_backward` is the
loop's reverse-mode gradient, derived by hand below. Tests compare the three with each other and
with central differences.

Layout: q, k (B, T, H, dk), v (B, T, H, dv), g, beta (B, T, H), state (B, H, dk, dv).
The loop and its backward sum with math.fsum and take exp from golden.elementary, so the stored
goldens do not depend on BLAS or the CPU. Nothing here imports vkdsl.
"""
from __future__ import annotations

import numpy as np

from . import elementary as E
from .reference import exact_sum


def _read(S, x):
    """S^T x per (batch, head): S (..., dk, dv), x (..., dk) -> (..., dv)."""
    return exact_sum(S * x[..., :, None], axis=-2)


def _apply(S, y):
    """S y: S (..., dk, dv), y (..., dv) -> (..., dk)."""
    return exact_sum(S * y[..., None, :], axis=-1)


def _f64(*xs):
    return [np.asarray(x, np.float64) for x in xs]


def _scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def recurrent(q, k, v, g, beta, state=None, scale=None, segments=None):
    """Outputs (B, T, H, dv) and the final state (B, H, dk, dv), one step at a time. segments (B,
    T):
    packed sequences' ids; where the id changes the state starts again from zero."""
    q, k, v, g, beta = _f64(q, k, v, g, beta)
    B, T, H, dk = k.shape
    S = np.zeros((B, H, dk, v.shape[-1])) if state is None else np.array(state, np.float64)
    o = np.zeros(v.shape)
    s = _scale(q, scale)
    for t in range(T):
        if segments is not None and t > 0:
            seg = np.asarray(segments)
            S = S * (seg[:, t] == seg[:, t - 1])[:, None, None, None]
        S = S * E.exp(g[:, t])[..., None, None]
        d = beta[:, t][..., None] * (v[:, t] - _read(S, k[:, t]))
        S = S + k[:, t][..., :, None] * d[..., None, :]
        o[:, t] = s * _read(S, q[:, t])
    return o, S


def chunked(q, k, v, g, beta, chunk=64, state=None, scale=None):
    """The same as `recurrent`, C = chunk steps at a time.

    Inside a chunk entered with state S0, let G_t = g_1 + ... + g_t (the chunk's cumulative log
    decay) and u_t = d_t. Unrolling the loop,
        S_t = e^{G_t} S0 + sum_{s<=t} e^{G_t - G_s} k_s u_s^T,
    so the write of step t solves a unit lower-triangular system over the chunk:
        u_t + sum_{s<t} beta_t e^{G_t - G_s} (k_t . k_s) u_s = beta_t (v_t - e^{G_t} S0^T k_t),
    i.e. (I + A) U = beta (V - e^G K S0) with A_ts = beta_t e^{G_t - G_s} k_t . k_s for s < t.
    With T = (I + A)^-1 (forward substitution): U = T (beta V) - T (beta e^G K) S0. Then
        o_t = scale (e^{G_t} S0^T q_t + sum_{s<=t} e^{G_t - G_s} (q_t . k_s) u_s)
        S_C = e^{G_C} S0 + sum_s e^{G_C - G_s} k_s u_s^T.
    A sequence that is no multiple of C gets steps with g = 0, beta = 0, k = 0 appended, which
    leave the state as it is."""
    q, k, v, g, beta = _f64(q, k, v, g, beta)
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    C = int(chunk)
    pad = -T % C
    # (B, H, N, C, .) chunks
    q, k, v = (np.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
               for x in (q, k, v))
    g, beta = (np.pad(x, ((0, 0), (0, pad), (0, 0))).transpose(0, 2, 1) for x in (g, beta))
    N = (T + pad) // C
    q, k, v = (x.reshape(B, H, N, C, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)
    G = np.cumsum(g, axis=-1)
    lower = np.tril(np.ones((C, C), bool))
    decay = np.where(lower, np.exp(np.where(lower, G[..., :, None] - G[..., None, :], 0.0)), 0.0)
    A = np.where(np.tril(lower, -1), beta[..., :, None] * (k @ k.swapaxes(-1, -2)) * decay, 0.0)
    Tinv = np.linalg.inv(np.eye(C) + A)
    U0 = Tinv @ (beta[..., None] * v)
    W = Tinv @ (beta[..., None] * np.exp(G)[..., None] * k)
    s = _scale(q, scale)
    S = np.zeros((B, H, dk, dv)) if state is None else np.array(state, np.float64)
    out = np.zeros((B, H, N, C, dv))
    for n in range(N):
        U = U0[:, :, n] - W[:, :, n] @ S
        Gn = G[:, :, n]
        out[:, :, n] = s * ((np.exp(Gn)[..., None] * q[:, :, n]) @ S
                            + ((q[:, :, n] @ k[:, :, n].swapaxes(-1, -2)) * decay[:, :, n]) @ U)
        last = Gn[..., -1:]
        S = (np.exp(last)[..., None] * S
             + (np.exp(last - Gn)[..., None] * k[:, :, n]).swapaxes(-1, -2) @ U)
    out = out.reshape(B, H, N * C, dv)[:, :, :T].transpose(0, 2, 1, 3)
    return out, S


def recurrent_backward(q, k, v, g, beta, gout, state=None, gstate=None, scale=None):
    """Gradients of sum(out * gout) + sum(S_T * gstate) with respect to q, k, v, g, beta and the
    initial state, by running the loop backwards. With L the adjoint of S_t (dk x dv):

        o_t = s S_t^T q_t:      L += s q_t gout_t^T;  dq_t = s S_t gout_t
        S_t = S' + k_t d_t^T:   dk_t = L d_t;  dd = L^T k_t  (and S' receives L)
        d_t = beta_t (v_t - r): dv_t = beta_t dd;  dbeta_t = (v_t - r) . dd;  dr = -beta_t dd
        r = S'^T k_t:           dk_t += S' dr;  L' = L + k_t dr^T
        S' = a_t S_{t-1}:       dg_t = a_t sum(L' * S_{t-1});  L = a_t L'
    """
    q, k, v, g, beta, gout = _f64(q, k, v, g, beta, gout)
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    s = _scale(q, scale)
    S = np.zeros((B, H, dk, dv)) if state is None else np.array(state, np.float64)
    states = [S]                                   # S_{t-1} before step t, then S_T
    reads, writes = [], []
    for t in range(T):
        Sd = S * E.exp(g[:, t])[..., None, None]
        r = _read(Sd, k[:, t])
        d = beta[:, t][..., None] * (v[:, t] - r)
        S = Sd + k[:, t][..., :, None] * d[..., None, :]
        reads.append(r)
        writes.append(d)
        states.append(S)
    L = np.zeros((B, H, dk, dv)) if gstate is None else np.array(gstate, np.float64)
    dq, dk_, dv_ = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dg, dbeta = np.zeros(g.shape), np.zeros(beta.shape)
    for t in reversed(range(T)):
        a = E.exp(g[:, t])
        kt, go, d, r, prev = k[:, t], gout[:, t], writes[t], reads[t], states[t]
        L = L + s * q[:, t][..., :, None] * go[..., None, :]
        dq[:, t] = s * _apply(states[t + 1], go)
        dd = _read(L, kt)
        dv_[:, t] = beta[:, t][..., None] * dd
        dbeta[:, t] = exact_sum((v[:, t] - r) * dd, axis=-1)
        dr = -beta[:, t][..., None] * dd
        both = np.concatenate([L * d[..., None, :], (a[..., None, None] * prev) * dr[..., None, :]],
                              axis=-1)
        dk_[:, t] = exact_sum(both, axis=-1)              # L d_t + S' dr, as one sum
        L = L + kt[..., :, None] * dr[..., None, :]
        dg[:, t] = a * exact_sum((L * prev).reshape(*prev.shape[:-2], -1), axis=-1)
        L = a[..., None, None] * L
    return dq, dk_, dv_, dg, dbeta, L


def l2norm(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis (Gated DeltaNet's q and k)."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def causal_conv(x, w, state=None):
    """Depthwise causal convolution over time: x (B, T, channels), w (channels, K):
    y_t = sum_j w[:, j] x_{t - (K-1) + j}, with x_{<0} taken from `state` (B, K-1, channels) or 0.
    Returns y and the last K-1 inputs (the next call's state)."""
    x, w = _f64(x, w)
    B, T, Ch = x.shape
    K = w.shape[1]
    prev = np.zeros((B, K - 1, Ch)) if state is None else np.asarray(state, np.float64)
    full = np.concatenate([prev, x], axis=1)
    y = sum(w[:, j] * full[:, j:j + T] for j in range(K))
    return y, full[:, T:]


def tri_inverse(a) -> np.ndarray:
    """(I + A)^-1 for strictly lower-triangular A (..., n, n) (only below the diagonal is read), by
    forward substitution: row i of the inverse is e_i minus A's row i times the rows above it."""
    a = np.tril(np.asarray(a, np.float64), -1)
    n = a.shape[-1]
    t = np.zeros(a.shape)
    for i in range(n):
        t[..., i, i] = 1.0
        if i:
            t[..., i, :i] = -exact_sum(a[..., i, :i, None] * t[..., :i, :i], axis=-2)
    return t


def tri_inverse_backward(a, g) -> np.ndarray:
    """Gradient of sum(T * g), T = (I + A)^-1, w.r.t. A's entries below the diagonal: -T^T g T^T."""
    from .reference import matmul
    tt = np.swapaxes(tri_inverse(a), -1, -2)
    return np.tril(-matmul(matmul(tt, g, batch=True), tt, batch=True), -1)


def draw(rng, t: int, h: int, dk: int, dv: int) -> list:
    """float32 inputs of one sequence (batch 1) as the layer gives them: q and k of unit length,
    v standard normal, decays g in (-1, -0.01), write strengths beta in (0.05, 0.95)."""
    def unit(x):
        return (x / np.sqrt((x ** 2).sum(-1, keepdims=True))).astype(np.float32)
    q = unit(np.asarray(rng.standard_normal((1, t, h, dk)), np.float32).astype(np.float64))
    k = unit(np.asarray(rng.standard_normal((1, t, h, dk)), np.float32).astype(np.float64))
    v = np.asarray(rng.standard_normal((1, t, h, dv)), np.float32)
    return [q, k, v, np.asarray(rng.uniform(-1.0, -0.01, (1, t, h)), np.float32),
            np.asarray(rng.uniform(0.05, 0.95, (1, t, h)), np.float32)]
