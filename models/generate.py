"""Text generation with a KV cache: one traced prefill per prompt-length bucket, then one
traced single-token step replayed per new token. The prefill stops at the final norm and the
head runs on the rows asked for, in chunks one storage binding holds (a 152k vocabulary's logits
for a 512-token prompt would be 311 MB)."""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import numpy as np

import vkdsl
from vkdsl.ops import nn

from vkdsl.ops.quant.kernels import MV_ROWS

from .llama import head_in_chunks

BUCKET = 64          # prompt lengths round up to this, so a few recorded programs serve all prompts


class KVCache:
    """Per-layer key/value caches (B, L, KV, D) living on the device between calls, one row per
    sequence. dtype float16 halves their memory (the device's 16-bit storage): keys and values are
    rounded to fp16 as they are written, and attention reads them back widened to fp32 -- the
    current token's too."""

    def __init__(self, cfg, length: int, dtype: str = "float32", batch: int = 1):
        if dtype not in ("float32", "float16"):
            raise ValueError(f"KV cache dtype {dtype!r}: expected float32 or float16")
        self.L, self.dtype, self.B = length, dtype, batch
        shape = (batch, length, cfg.n_kv_heads, cfg.head_dim)

        def zeros(name):
            t = vkdsl.tensor(np.zeros(shape, np.float32), name=name)
            if dtype == "float16":
                t = t.half()
                t.numpy()               # realized: a float16 buffer of its own
            return t
        self.k = [zeros(f"k_cache{i}") for i in range(cfg.n_layers)]
        self.v = [zeros(f"v_cache{i}") for i in range(cfg.n_layers)]
        self.onehot = None          # (B, L): each row's position being decoded; None in a prompt

    def nbytes(self) -> int:
        return sum(t.buffer.nbytes for t in self.k + self.v)

    def layer(self, i, k, v):
        if self.dtype == "float16":
            k, v = k.half(), v.half()
        if self.onehot is None:     # prefill: write rows 0..T-1, attend causally within the prompt
            T = k.shape[1]
            pad = ((0, 0), (0, self.L - T), (0, 0), (0, 0))
            self.k[i].assign(k.pad(pad))
            self.v[i].assign(v.pad(pad))
            return k.float(), v.float(), True
        sel = self.onehot.reshape(self.B, self.L, 1, 1)
        k_all = self.k[i] * (1.0 - sel) + k * sel          # (B, L, KV, D), this step's row replaced
        v_all = self.v[i] * (1.0 - sel) + v * sel
        # fp32 arithmetic on fp16 values: exact, so rounding again is a no-op
        if self.dtype == "float16":
            k_all, v_all = k_all.half(), v_all.half()
        self.k[i].assign(k_all)
        self.v[i].assign(v_all)
        return k_all.float(), v_all.float(), False


class StateCache:
    """Qwen3.5's caches: keys and values of its full-attention layers (a KVCache over those), and
    for each Gated DeltaNet layer the last K-1 inputs of its convolution and its recurrent state.
    During a prompt `valid` (T,) marks its real tokens and `tail` (K-1, T) picks its last K-1."""

    def __init__(self, cfg, length: int, dtype: str = "float32"):
        self.full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
        self.kv = KVCache(SimpleNamespace(n_layers=len(self.full), n_kv_heads=cfg.n_kv_heads,
                                          head_dim=cfg.head_dim), length, dtype)
        linear = [i for i in range(cfg.n_layers) if i not in self.full]
        shape = (1, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim)
        self.conv = {i: vkdsl.tensor(np.zeros((1, cfg.conv_kernel - 1, cfg.conv_dim), np.float32),
                                     name=f"conv{i}")
                     for i in linear}
        self.state = {i: vkdsl.tensor(np.zeros(shape, np.float32), name=f"state{i}")
                      for i in linear}
        self.L, self.K = length, cfg.conv_kernel
        self.onehot = self.valid = self.tail = None

    def nbytes(self) -> int:
        return (self.kv.nbytes()
                + sum(t.buffer.nbytes for t in [*self.conv.values(), *self.state.values()]))

    def layer(self, i, k, v):
        self.kv.onehot = self.onehot
        return self.kv.layer(self.full.index(i), k, v)

    def prompt_inputs(self, T: int, Tb: int) -> tuple[np.ndarray, np.ndarray]:
        valid = (np.arange(Tb) < T).astype(np.float32)
        tail = np.zeros((self.K - 1, Tb), np.float32)
        for r in range(self.K - 1):
            t = T - (self.K - 1) + r
            if t >= 0:
                tail[r, t] = 1.0
        return valid, tail


class Generator:
    """batch B > 1: B prompts decoded together (generate_many), one cache row each -- a decode
    step's matrix-vector products read each weight once for up to ops.quant's MV_ROWS rows, so
    B <= 4 sequences cost about what one does (Llama-family models; Qwen3.5's recurrent state is
    kept for one sequence)."""

    @staticmethod
    def batch_for(cfg, n: int) -> int:
        """The batch to decode n sequences with: all of them up to MV_ROWS (more rows than that
        cost their own weight reads), one for Qwen3.5."""
        return 1 if cfg.arch == "qwen35" else max(1, min(n, MV_ROWS))

    def __init__(self, model, max_len: int, kv_dtype: str = "float32", batch: int = 1):
        self.model, self.cfg = model, model.cfg
        if max_len > self.cfg.context_length:
            raise ValueError(f"prompt + new tokens = {max_len} exceed the model's context of "
                             f"{self.cfg.context_length} tokens")
        c = self.cfg
        if batch < 1 or (batch > 1 and c.arch == "qwen35"):
            raise ValueError(f"Generator batch {batch}: expected >= 1" + (
                " (1 for qwen35: its recurrent state holds one sequence)" * (c.arch == "qwen35")))
        self.L, self.B = min(c.context_length, BUCKET * math.ceil(max_len / BUCKET)), batch
        self.cache = (StateCache(c, self.L, kv_dtype) if c.arch == "qwen35" else
                      KVCache(c, self.L, kv_dtype, batch))

        def prefill(ids, valid, tail):                      # ids (B, Tb) -> final hidden states
            self.cache.onehot = None
            self.cache.valid, self.cache.tail = valid, tail  # read by a StateCache only
            return self.model.forward(ids, kv=self.cache, hidden_only=True)

        def step(ids, cos, sin, onehot, mask):     # ids (B, 1); cos, sin (B, 1, R/2); onehot (B, L)
            self.cache.onehot = onehot
            return self.model.forward(ids, cos=cos, sin=sin, kv=self.cache,
                                      mask=mask.reshape(batch, 1, self.L))
        self._prefill, self._step = vkdsl.trace(prefill), vkdsl.trace(step)
        self._head = vkdsl.trace(lambda h: self.model.head(h))
        cos, sin = nn.rope_tables(np.arange(self.L), c.rotary_dim, c.rope_base,
                                  c.rope_freq_divisors)
        self._cos, self._sin = cos, sin

    def _hidden(self, prompts: list[list[int]]) -> np.ndarray:
        """Final hidden states (B, Tb, dim) of the B prompts in one prefill, right-padded to one
        bucket (causal rows never see the padding; a StateCache masks it from its recurrence)."""
        if len(prompts) != self.B:
            raise ValueError(f"{len(prompts)} prompts for a Generator of batch {self.B}")
        T = max(len(p) for p in prompts)
        Tb = min(self.L, BUCKET * math.ceil(T / BUCKET))
        padded = np.zeros((self.B, Tb), np.int32)
        for b, p in enumerate(prompts):
            padded[b, :len(p)] = p
        valid, tail = (self.cache.prompt_inputs(T, Tb) if isinstance(self.cache, StateCache) else
                       (np.zeros(1, np.float32), np.zeros((1, 1), np.float32)))
        return np.asarray(self._prefill(padded, valid, tail))

    def logits_prefill(self, ids: list[int], last_only: bool = False) -> np.ndarray:
        """Logits (T, vocab) of the prompt's positions, or (1, vocab) of its last with last_only."""
        h, T = self._hidden([ids])[0], len(ids)
        if last_only:
            return self._head(h[T - 1:T])
        return head_in_chunks(self._head, h, self.model.logit_rows)[:T]

    def logits_step(self, token: int, pos: int) -> np.ndarray:
        return self.logits_step_rows([token], [pos])[0]

    def logits_prefill_rows(self, prompts: list[list[int]]) -> np.ndarray:
        """(B, vocab): the logits at each prompt's last position, the B prompts in one prefill."""
        h = self._hidden(prompts)
        return self._head(np.stack([h[b, len(p) - 1] for b, p in enumerate(prompts)]))

    def logits_step_rows(self, tokens: list[int], pos: list[int]) -> np.ndarray:
        """(B, vocab): one decode step of every row, token b written at position pos[b]."""
        if len(tokens) != self.B:
            raise ValueError(f"{len(tokens)} tokens for a Generator of batch {self.B}")
        onehot = np.zeros((self.B, self.L), np.float32)
        onehot[np.arange(self.B), pos] = 1.0
        mask = np.where(np.arange(self.L)[None, :] <= np.asarray(pos)[:, None], 0.0,
                        -np.inf).astype(np.float32)
        out = self._step(np.asarray(tokens, np.int32).reshape(self.B, 1),
                         self._cos[pos].reshape(self.B, 1, -1),
                         self._sin[pos].reshape(self.B, 1, -1), onehot, mask)
        return np.asarray(out)[:, 0]

    def generate_many(self, prompts: list[list[int]], max_new: int, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int = 0, stop: set | None = None):
        """New ids of each of the B prompts, decoded together; a row that stops (a stop token,
        max_new tokens, the cache's end) keeps stepping with the others, its output ignored."""
        check_sampling(max_new, temperature, top_p, seed)
        n = len(prompts)
        if not 1 <= n <= self.B or not all(prompts):
            raise ValueError(f"generate_many: {n} prompts for a Generator of batch {self.B}, "
                             f"each at least one token")
        if self.B == 1:
            return [self.generate(prompts[0], max_new, temperature, top_p, seed, stop)[0]]
        prompts = prompts + [prompts[-1]] * (self.B - n)    # rows beyond n: decoded, not returned
        rng = np.random.default_rng(seed)
        logits, pos = self.logits_prefill_rows(prompts), [len(p) for p in prompts]
        out, live = [[] for _ in prompts], [max_new > 0] * self.B
        while any(live):
            for b in range(self.B):
                if live[b]:
                    out[b].append(sample(logits[b], temperature, top_p, rng))
                    live[b] = (len(out[b]) < max_new and out[b][-1] not in (stop or ())
                               and pos[b] < self.L)
            if not any(live):
                break
            logits = self.logits_step_rows([o[-1] if o else 0 for o in out],
                                           [min(p, self.L - 1) for p in pos])
            pos = [p + 1 for p in pos]
        return out[:n]

    def generate(self, ids: list[int], max_new: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, stop: set | None = None, on_token=None):
        """Returns (new ids, stats). Greedy when temperature == 0."""
        check_sampling(max_new, temperature, top_p, seed)
        rng = np.random.default_rng(seed)
        t0 = time.perf_counter()
        logits = self.logits_prefill(ids, last_only=True)[-1]
        t_prefill = time.perf_counter() - t0
        out, pos = [], len(ids)
        t1 = time.perf_counter()
        for _ in range(max_new):
            nxt = sample(logits, temperature, top_p, rng)
            out.append(nxt)
            if on_token:
                on_token(nxt)
            if (stop and nxt in stop) or pos >= self.L:
                break
            logits = self.logits_step(nxt, pos)
            pos += 1
        t_gen = time.perf_counter() - t1
        return (out, {"prompt_tokens": len(ids), "new_tokens": len(out), "prefill_s": t_prefill,
                      "decode_s": t_gen})


def check_sampling(max_new, temperature, top_p, seed):
    for bad, what in ((max_new < 0, f"max_new {max_new}: expected >= 0"),
                      (not 0 <= temperature < math.inf,
                       f"temperature {temperature}: expected a finite number >= 0"),
                      (not 0 < top_p <= 1, f"top_p {top_p}: expected 0 < top_p <= 1"),
                      (seed < 0, f"seed {seed}: expected >= 0")):
        if bad:
            raise ValueError(f"generate: {what}")


def sample(logits: np.ndarray, temperature: float, top_p: float, rng) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]
    q = p[keep] / p[keep].sum()
    return int(rng.choice(keep, p=q))
