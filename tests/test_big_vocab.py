"""A 150k vocabulary (Qwen's is 151,936, Llama 3's 128,256) under the minimal profile's 128 MiB
storage binding: 256 rows of its logits (154 MB) do not fit one buffer, so the LM head runs in
chunks of fewer rows (models.llama.Llama.logit_rows; 89 supervised rows make two) in generation's
prefill, in whole-prompt logits (`vkdsl logits`, `bench model`), in scoring, and in
the training step with TMKL both from cached base logits (passed in chunks) and from a base forward.
References: golden/llama_ref.py's float64 forward (the adapter merged into the weights in float64),
cross-entropy and target-masked KL in float64 numpy written here. Tolerance 1e-3 relative (fp32 over a
150k-way softmax); the two TMKL paths agree to 1e-5. Runs in a process of its own (the profile is
read when the device opens)."""
from fixtures.child import run_under_profile

CHILD = r'''
import gc
import json
import numpy as np
import vkdsl
from vkdsl.models.config import LlamaConfig
from vkdsl.models.tensors import LlamaCheckpoint, TensorRecord
from vkdsl.models.llama import Llama, LogitsFn
from vkdsl.models.generate import Generator
from vkdsl.ops.lora import LoRA
from vkdsl.train.step import BaseLogitCache, build_grad_fn, select, split_rows
from vkdsl.train.scoring import Scorer
from vkdsl.train.data import Example
from vkdsl_golden import llama_ref

V, D, T = 150_000, 64, 100
cfg = LlamaConfig(n_layers=1, dim=D, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=V,
                  context_length=512, arch="qwen2")
rng = np.random.default_rng(0)
shapes = {"token_embd.weight": (V, D), "output.weight": (V, D), "output_norm.weight": (D,),
          "blk.0.attn_norm.weight": (D,), "blk.0.ffn_norm.weight": (D,), "blk.0.attn_q.weight": (64, D),
          "blk.0.attn_k.weight": (32, D), "blk.0.attn_v.weight": (32, D), "blk.0.attn_output.weight": (D, 64),
          "blk.0.ffn_gate.weight": (96, D), "blk.0.ffn_up.weight": (96, D), "blk.0.ffn_down.weight": (D, 96),
          "blk.0.attn_q.bias": (64,), "blk.0.attn_k.bias": (32,), "blk.0.attn_v.bias": (32,)}
w = {}
for n, s in shapes.items():
    a = 1.0 + 0.1 * rng.standard_normal(s) if n.endswith("norm.weight") else \
        rng.standard_normal(s) * (2.0 / np.sqrt(s[-1]) if len(s) == 2 else 0.3)
    w[n] = a.astype(np.float32)
recs = {n: TensorRecord(n, "F32", a.shape, a.view(np.uint8).reshape(a.shape[0], -1) if a.ndim == 2 else a.view(np.uint8))
        for n, a in w.items()}
model = Llama(LlamaCheckpoint(cfg, recs, "big-vocab", "gguf"))
out = {"logit_rows": model.logit_rows}
ids = rng.integers(0, V, T).astype(np.int32)
base_ref = llama_ref.forward(w, cfg.to_dict(), ids)

gen = Generator(model, T + 8)
lg = gen.logits_prefill(list(ids))
out["prefill_rel"] = float(np.abs(lg - base_ref).max() / np.abs(base_ref).max())
last = gen.logits_prefill(list(ids), last_only=True)
out["last_rel"] = float(np.abs(last[0] - base_ref[-1]).max() / np.abs(base_ref).max())
full = LogitsFn(model)                                  # what `vkdsl logits` and `bench model` use
out["logits_rel"] = float(np.abs(full(ids[None])[0] - base_ref).max() / np.abs(base_ref).max())
full.release()
del gen, lg, last, full
gc.collect()                  # each traced program keeps its temporaries: free them between stages

# an adapter on q and down; the reference merges it into the weights
s = 2.0
A = {m: (rng.standard_normal((D if m == "attn_q" else 96, 4)) / 8).astype(np.float32) for m in ("attn_q", "ffn_down")}
B = {m: (0.3 * rng.standard_normal((4, 64 if m == "attn_q" else D))).astype(np.float32) for m in A}
model.lora = {f"blk.0.{m}": LoRA(vkdsl.tensor(A[m], requires_grad=True), vkdsl.tensor(B[m], requires_grad=True), s) for m in A}
merged = dict(w)
for m in A:
    merged[f"blk.0.{m}.weight"] = w[f"blk.0.{m}.weight"] + s * (A[m].astype(np.float64) @ B[m]).T
ad_ref = llama_ref.forward(merged, cfg.to_dict(), ids)
labels = np.full((1, T), -100, np.int32)
labels[0, 10:T - 1] = ids[11:]                          # 89 supervised rows: two head chunks
sup = labels[0] != -100
lab_flat = labels[0]
def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))
rows = np.flatnonzero(sup)
la = log_softmax(ad_ref[rows])
ce_ref = float(-la[np.arange(len(rows)), lab_flat[rows]].sum())
ma, mb = ad_ref[rows].copy(), base_ref[rows].copy()    # TMKL: the target removed from both, renormalized
ma[np.arange(len(rows)), lab_flat[rows]] = -np.inf
mb[np.arange(len(rows)), lab_flat[rows]] = -np.inf
pa, lpa, lpb = np.exp(log_softmax(ma)), log_softmax(ma), log_softmax(mb)
kl_ref = float(np.where(pa > 0, pa * (lpa - np.where(pa > 0, lpb, 0.0)), 0.0).sum())
params = [p for lo in model.lora.values() for p in (lo.A, lo.B)]
pos, lab = select(labels)
inv = np.array([1.0], np.float32)
cache = BaseLogitCache(model, 1 << 40)
cached = cache.fn(ids[None], pos)
del cache
gc.collect()
fn = build_grad_fn(model, params, 0.5, base_input=True)
r1 = [np.asarray(x) for x in fn(ids[None], pos, lab, inv, *split_rows(cached, model.logit_rows))]
del fn, cached
gc.collect()
fn = build_grad_fn(model, params, 0.5, base_input=False)
r2 = [np.asarray(x) for x in fn(ids[None], pos, lab, inv)]
del fn
gc.collect()
out["ce_rel"] = abs(float(r1[0]) - ce_ref) / ce_ref
out["kl_rel"] = abs(float(r1[1]) - kl_ref) / kl_ref
out["paths_rel"] = max(abs(float(a) - float(b)) / abs(float(b)) for a, b in zip(r1[:2], r2[:2]))
out["grads_rel"] = max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
                       for a, b in zip(r1[2:], r2[2:]))
sc = Scorer(model, 0, 16, T, 1).row_logprobs([Example(list(ids), list(labels[0]), "", "row")])
lp_ref = -ce_ref
out["score_rel"] = abs(sc[0][0] - lp_ref) / abs(lp_ref)
print(json.dumps(out))
'''


def test_a_150k_vocabulary_runs_under_minimal():
    r = run_under_profile(CHILD, "minimal", timeout=900)
    assert 1 <= r["logit_rows"] < 256, r                # 48 MiB / (4 B x 150k) = 83 rows
    assert r["prefill_rel"] <= 1e-3 and r["last_rel"] <= 1e-3 and r["logits_rel"] <= 1e-3, r
    assert r["ce_rel"] <= 1e-3 and r["kl_rel"] <= 1e-3, r
    assert r["paths_rel"] <= 1e-5 and r["grads_rel"] <= 1e-4, r
    assert r["score_rel"] <= 1e-3, r
