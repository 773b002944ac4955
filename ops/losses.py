"""Losses for SFT and preference training, composed from primitives.

Label convention: int32, -100 = not supervised (prompt, padding)."""
from __future__ import annotations

import math

import numpy as np

from vkdsl import Tensor
from vkdsl.tensor import ShapeError

from .nn import log_softmax, logsumexp

IGNORE = -100


def check_labels(labels: np.ndarray, vocab: int, what: str = "labels"):
    """Host-side check of a batch's labels before any compute is spent on it."""
    labels = np.asarray(labels)
    bad = (labels >= vocab) | ((labels < 0) & (labels != IGNORE))
    if bad.any():
        r = np.argwhere(bad)[0]
        raise ValueError(f"{what}: value {labels[tuple(r)]} at {tuple(int(i) for i in r)} "
                         f"is outside [0, {vocab}) and is not the ignore index {IGNORE}")
    if not (labels != IGNORE).any():
        raise ValueError(f"{what}: the batch has no supervised token (every label is {IGNORE}); "
                         f"a mean over zero tokens has no value")


def _check_pair(logits: Tensor, labels: Tensor):
    if labels.dtype != "int32":
        raise TypeError(f"labels must be int32, got {labels.dtype}")
    if logits.shape[:-1] != labels.shape:
        raise ShapeError(f"logits {logits.shape} and labels {labels.shape}: labels must have the "
                         f"logits' shape without the vocabulary axis")
    if labels.op == "buffer":
        check_labels(labels.numpy(), logits.shape[-1])


def _onehot(labels: Tensor, V: int) -> Tensor:
    return labels.reshape(*labels.shape, 1).eq(Tensor.arange(V))


def token_logprobs(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(log p(label) at each position (0 where unsupervised), supervision mask as float)."""
    _check_pair(logits, labels)
    V = logits.shape[-1]
    picked = (logits * _onehot(labels, V)).sum(-1)                 # z[label]; 0 for ignored rows
    lp = picked - logsumexp(logits, -1)
    mask = 1.0 - labels.eq(IGNORE)
    return lp * mask, mask


def greedy_gap(logits: Tensor, labels: Tensor) -> Tensor:
    """max(z) - z[label] at each position (0 where unsupervised): exactly 0 where the label is the
    greedy (argmax) token, since both sides are the same stored float there."""
    _check_pair(logits, labels)
    picked = (logits * _onehot(labels, logits.shape[-1])).sum(-1)
    return (logits.max(-1) - picked) * (1.0 - labels.eq(IGNORE))


def cross_entropy(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Masked cross-entropy: (mean over supervised tokens, per-position losses (0 where
    ignored))."""
    lp, mask = token_logprobs(logits, labels)
    per = -lp
    return per.sum() / mask.sum(), per


def sequence_logprob(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of token log-probs over each sequence's supervised (response) tokens: (B, T, V) ->
    (B,)."""
    lp, _ = token_logprobs(logits, labels)
    return lp.sum(-1)


def kl(p_logits: Tensor, q_logits: Tensor) -> Tensor:
    """KL(p || q) per position from logits, over the last axis."""
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return (lp.exp() * (lp - lq)).sum(-1)


def tmkl(adapted_logits: Tensor, base_logits: Tensor, labels: Tensor) -> Tensor:
    """Target-masked KL: at each supervised position remove the target token from both
    distributions, renormalise, and take KL(adapted || base); mean over supervised positions."""
    mask = 1.0 - labels.eq(IGNORE)
    return tmkl_rows(adapted_logits, base_logits, labels).sum() / mask.sum()


def tmkl_rows(adapted_logits: Tensor, base_logits: Tensor, labels: Tensor) -> Tensor:
    """Per-position target-masked KL (0 where unsupervised). The renormalisation is a logsumexp
    with the target set to -inf: stable even when the target holds almost all of the probability."""
    _check_pair(adapted_logits, labels)
    V = adapted_logits.shape[-1]
    hot = _onehot(labels, V)
    za = hot.where(-math.inf, adapted_logits)
    zb = hot.where(-math.inf, base_logits)
    # Renormalised log-probs, set to a finite 0 at the target so neither the forward nor the
    # backward pass ever meets -inf - -inf; the target's probability is then masked to 0.
    la = hot.where(0.0, za - logsumexp(za, -1, keepdim=True))
    lb = hot.where(0.0, zb - logsumexp(zb, -1, keepdim=True))
    pa = hot.where(0.0, la.exp())
    per = (pa * (la - lb)).sum(-1)
    return per * (1.0 - labels.eq(IGNORE))


def softplus(x: Tensor) -> Tensor:
    """log(1 + exp(x)) without overflow."""
    return x.maximum(0.0) + (1.0 + (-(x.maximum(-x))).exp()).log()


def dpo(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
        beta: float = 0.1) -> tuple[Tensor, Tensor]:
    """(mean DPO loss, per-pair margins beta*[(pc - pr) - (rc - rr)]). Loss = -log sigmoid(margin);
    with policy == reference every margin is 0 and the loss is ln 2."""
    margin = ((policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)) * beta
    return softplus(-margin).mean(), margin
