"""Llama-family forward pass on the device (Llama, Mistral, Qwen2's q/k/v biases, Qwen3's q/k
norms), built from vkdsl ops.

Weights keep GGUF names, (out, in) shapes and the adjacent-pair RoPE Q/K row order (the loaders
put every family's rows in it).
Linear layers go through models.weights (packed 4-bit/8-bit kept packed on the device, or
dense fp32); LoRA adapters are applied beside them and can be switched off per call, so the
base distribution comes from the same weights in the same step."""
from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import numpy as np

import vkdsl
from vkdsl import Tensor
from vkdsl.autograd import checkpoint as checkpoint_fn
from vkdsl.realize import depends_on
from vkdsl.runtime import default_device
from vkdsl.ops import attention, nn

from .config import LINEARS, LlamaConfig
from .errors import ModelFileError
from .tensors import LlamaCheckpoint
from .weights import binding_limit, device_weight, planned_bytes



_versions = itertools.count(1)


class AdapterTable(dict):
    """The model's adapters by module name; `version` changes (to a number no table had before)
    whenever an entry is set or removed or the table is replaced, so a traced program that captured
    the previous adapters is rebuilt (vkdsl.realize.depends_on) rather than replayed with them.
    Training updates adapter values in place: no new version."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._bump()

    def _bump(self):
        self.version = next(_versions)

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        self._bump()

    def __delitem__(self, k):
        super().__delitem__(k)
        self._bump()

    def clear(self):
        super().clear()
        self._bump()

    def pop(self, *a):
        out = super().pop(*a)
        self._bump()
        return out

    def update(self, *a, **k):
        super().update(*a, **k)
        self._bump()

    def setdefault(self, k, v=None):
        if k not in self:
            self[k] = v
        return self[k]


class Llama:
    def __init__(self, ckpt: LlamaCheckpoint, quant: str = "keep"):
        """quant: 'keep' keeps each tensor's stored block format (GGUF Q4_0/Q4_1/Q8_0 stay packed);
        'none' dequantizes to fp32; 'int4' / 'nf4' quantize dense weights on load."""
        if not isinstance(ckpt.config, LlamaConfig):
            raise ModelFileError(f"{ckpt.source}: a {ckpt.config.arch} model, where this "
                                 f"command needs a Llama-family one (llama, mistral, qwen2, qwen3)")
        self.cfg: LlamaConfig = ckpt.config
        self.source, self.format = ckpt.source, ckpt.format
        self.stored_types = dict(Counter(r.ggml_type for r in ckpt.tensors.values()).most_common())
        c = self.cfg
        # the whole model's device bytes, refused up front rather than half-allocated
        need = (sum(planned_bytes(ckpt[n], quant) for n in ckpt.tensors)
                + 4 * c.context_length * c.head_dim)
        default_device().reserve(need, f"model {Path(str(ckpt.source)).name} (quant {quant})")
        self.linear = {}
        for i in range(c.n_layers):
            for m in LINEARS:
                name = f"blk.{i}.{m}"
                self.linear[name] = device_weight(ckpt[name + ".weight"], quant)
        self.norm = {n: vkdsl.tensor(ckpt[n].dequantize().astype(np.float32), name=n)
                     for n in ckpt.tensors if n.endswith("_norm.weight")}
        self.bias = {n.removesuffix(".bias"): vkdsl.tensor(
            ckpt[n].dequantize().astype(np.float32), name=n)
                     for n in ckpt.tensors if n.endswith(".bias")}      # Qwen2: q, k, v
        self.embed = device_weight(ckpt["token_embd.weight"], quant)
        self.head = device_weight(ckpt["output.weight"], quant) if "output.weight" in ckpt.tensors \
            else self.embed.as_linear()
        self._lora = AdapterTable()   # module name (blk.{i}.attn_q) -> ops.lora.LoRA
        cos, sin = nn.rope_tables(np.arange(c.context_length), c.head_dim, c.rope_base,
                                  c.rope_freq_divisors)
        self._cos, self._sin = (vkdsl.tensor(cos, name="rope_cos"),
                                vkdsl.tensor(sin, name="rope_sin"))

    @property
    def lora(self) -> AdapterTable:
        return self._lora

    @lora.setter
    def lora(self, table):
        self._lora = AdapterTable(table)

    @property
    def vector(self) -> dict:
        """The weights that are no matrices (norms, biases), by name."""
        return {**self.norm, **{n + ".bias": t for n, t in self.bias.items()}}

    @property
    def logit_rows(self) -> int:
        """Rows of logits per head call: 256 rows of SmolLM2's 49k vocabulary (48 MiB), fewer for a
        larger one, so a program's vocabulary-wide temporaries stay that size (a 152k vocabulary's
        256 rows would be 156 MB each, over the 128 MiB binding of lavapipe and the minimal
        profile)."""
        return max(1, min(256, min(48 << 20, binding_limit()) // (4 * self.cfg.vocab_size)))

    # ---- memory honesty ----
    def device_bytes(self) -> dict:
        """Bytes the weights occupy on the device (from the allocations) vs the same weights in
        fp32."""
        ws = (list(self.linear.values()) + [self.embed]
              + ([self.head] if self.head is not self.embed else []))
        vectors = list(self.vector.values())
        dev = sum(w.device_bytes for w in ws) + sum(t.buffer.nbytes for t in vectors)
        fp32 = sum(w.fp32_bytes for w in ws) + sum(t.size * 4 for t in vectors)
        return {"device_bytes": dev, "fp32_bytes": fp32}

    @property
    def table_bytes(self) -> int:
        """Device bytes of the RoPE tables (cos and sin at every position of the context)."""
        return self._cos.buffer.nbytes + self._sin.buffer.nbytes

    # ---- forward ----
    def _lin(self, name, x, adapters_on):
        """x W^T, its adapter's term (fused into a packed weight's product) and its bias."""
        y = self.linear[name](x, self.lora.get(name) if adapters_on else None)
        return y + self.bias[name] if name in self.bias else y

    def _adapter_tensors(self, layers, adapters_on):
        """The LoRA A and B tensors of those layers (what a checkpointed group's backward
        differentiates)."""
        los = ([self.lora.get(f"blk.{i}.{m}") for i in layers for m in self.cfg.linears(i)]
               if adapters_on else [])
        return [t for lo in los if lo is not None for t in (lo.A, lo.B)]

    def _layer(self, i, x, adapters_on, cos, sin, kv, mask, spans=None):
        """One transformer block: x (B, T, dim) -> x after attention and the SwiGLU MLP."""
        c = self.cfg
        B, T = x.shape[:2]
        H, KV, D = c.n_heads, c.n_kv_heads, c.head_dim
        p = f"blk.{i}."
        h = nn.rmsnorm(x, self.norm[p + "attn_norm.weight"], c.norm_eps).reshape(B * T, c.dim)
        q = self._lin(p + "attn_q", h, adapters_on).reshape(B, T, H, D)
        k = self._lin(p + "attn_k", h, adapters_on).reshape(B, T, KV, D)
        if c.qk_norm:                               # Qwen3: each head normalized before RoPE
            q = nn.rmsnorm(q, self.norm[p + "attn_q_norm.weight"], c.norm_eps)
            k = nn.rmsnorm(k, self.norm[p + "attn_k_norm.weight"], c.norm_eps)
        q, k = nn.rope(q, cos, sin), nn.rope(k, cos, sin)
        v = self._lin(p + "attn_v", h, adapters_on).reshape(B, T, KV, D)
        if kv is not None:
            k, v, causal = kv.layer(i, k, v)       # a KV cache may substitute its keys/values
            a = attention.attention(q, k, v, mask=mask, causal=causal)
        else:
            a = attention.attention(q, k, v, mask=mask, spans=spans)
        x = (x + self._lin(p + "attn_output", a.reshape(B * T, H * D),
                           adapters_on).reshape(B, T, c.dim))
        h = nn.rmsnorm(x, self.norm[p + "ffn_norm.weight"], c.norm_eps).reshape(B * T, c.dim)
        f = nn.swiglu(self._lin(p + "ffn_gate", h, adapters_on),
                      self._lin(p + "ffn_up", h, adapters_on))
        return x + self._lin(p + "ffn_down", f, adapters_on).reshape(B, T, c.dim)

    def forward(self, ids: Tensor, adapters_on: bool = True, cos=None, sin=None, kv=None, mask=None,
                hidden_only=False, start: int = 0, stop: int | None = None, positions=None,
                spans=None, checkpoint: int = 0) -> Tensor:
        """ids: (B, T) int32 -> logits (B, T, vocab).
        kv: optional KV cache (models.generate.KVCache) for generation.
        start > 0: `ids` is instead the residual stream (B, T, dim) entering layer `start`.
        stop: return the residual stream entering layer `stop` (no final norm, no head).
        positions (B, T), spans (B, T, 2) int32 for packed rows (train.packing): each token's
        position within its row and its row's [start, end); a token attends only to earlier tokens
        of its own row (ops.attention: the fused kernels never visit another row's keys).
        checkpoint K > 0: the backward recomputes each group of K layers from its input instead of
        keeping their activations (vkdsl.autograd.checkpoint); 0 keeps every activation."""
        c = self.cfg
        B, T, D = *ids.shape[:2], c.head_dim
        depends_on(lambda: self.lora.version)       # a traced forward holds these adapter objects
        if T > c.context_length:
            raise ValueError(f"{T} tokens exceed the model's context of {c.context_length}")
        if positions is not None:
            flat = positions.reshape(B * T)
            cos, sin = (t.gather(flat).reshape(B, T, c.rotary_dim // 2)
                        for t in (self._cos, self._sin))
        elif cos is None:
            cos, sin = self._cos[:T], self._sin[:T]
        x = ids if start else self.embed.rows(ids.reshape(B * T)).reshape(B, T, c.dim)
        end = c.n_layers if stop is None else stop
        K = checkpoint if kv is None else 0            # generation keeps nothing for a backward
        for g in range(start, end, K or max(1, end - start)):
            group = range(g, min(end, g + K) if K else end)

            def blocks(x, group=group):
                for i in group:
                    x = self._layer(i, x, adapters_on, cos, sin, kv, mask, spans)
                return x
            x = (checkpoint_fn(blocks, x, self._adapter_tensors(group, adapters_on)) if K
                 else blocks(x))
        if stop is not None:
            return x
        x = nn.rmsnorm(x, self.vector["output_norm.weight"], c.norm_eps)
        if hidden_only:
            return x
        return self.head(x.reshape(B * T, c.dim)).reshape(B, T, c.vocab_size)


def head_in_chunks(head, h: np.ndarray, n: int) -> np.ndarray:
    """Host logits of hidden rows h (R, dim) through a traced head, n rows a call: the last chunk
    padded to n so one program serves every call."""
    R = h.shape[0]
    n = min(n, R)
    h = np.concatenate([h, np.zeros((-R % n, h.shape[1]), h.dtype)])
    return np.concatenate([np.asarray(head(h[s:s + n])) for s in range(0, len(h), n)])[:R]


class LogitsFn:
    """ids (B, T) -> host logits (B, T, vocab): the forward to the final norm, then the head in
    chunks of model.logit_rows rows -- a whole (T, vocab) block can pass one storage binding (512
    tokens of a 152k vocabulary are 311 MB). release() frees the programs' buffers."""

    def __init__(self, model: Llama, adapters_on: bool = True):
        self.model = model
        self.hidden = vkdsl.trace(
            lambda x: model.forward(x, adapters_on=adapters_on, hidden_only=True))
        self.head = vkdsl.trace(lambda h: model.head(h))

    def __call__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, np.int32)
        B, T = ids.shape
        h = np.asarray(self.hidden(ids)).reshape(B * T, -1)
        return head_in_chunks(self.head, h, self.model.logit_rows).reshape(B, T, -1)

    def release(self):
        for t in (self.hidden, self.head):
            t.programs.clear()
