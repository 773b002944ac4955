"""Weights larger than one storage binding (models.weights.RowSplit): under the minimal profile
(128 MiB per binding) a 143 MB fp32 table is refused as one buffer and works split by rows — its
matmul against float64 numpy, its row gather exactly, ids at the block boundary and outside the
table (NaN rows, never zeros) — and a Q8_0 table split the same way gathers and multiplies as the
gguf package's own dequantization says. Each runs in a process of its own (the profile is read
when the device opens)."""
from fixtures.child import run_under_profile

CHILD = r'''
import json, sys
import numpy as np
import gguf
import vkdsl
from vkdsl.models.tensors import TensorRecord
from vkdsl.models.weights import Dense, RowSplit, device_weight
from vkdsl.runtime import default_device

out = {"range": default_device().limits.max_storage_buffer_range}
rng = np.random.default_rng(0)
V, D = 140_000, 256                                     # 143.4 MB of fp32: over 128 MiB
w = rng.standard_normal((V, D), dtype=np.float32)
try:
    Dense(w, "whole")
    out["whole"] = "allocated"
except ValueError as e:
    out["whole"] = str(e)
W = device_weight(TensorRecord("big", "F32", (V, D), w.view(np.uint8).reshape(V, 4 * D)))
out["parts"] = len(W.parts) if isinstance(W, RowSplit) else 0
b = W.starts[1] if out["parts"] > 1 else 1
ids = np.array([0, 1, b - 1, b, V - 1, 12345, 99999], np.int32)
x = rng.standard_normal((5, D)).astype(np.float32)
y = W(vkdsl.tensor(x)).numpy()
ref = x.astype(np.float64) @ w.astype(np.float64).T
out["matmul_rel"] = float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
out["gather_exact"] = bool(np.array_equal(W.rows(vkdsl.tensor(ids)).numpy(), w[ids]))
bad = W.rows(vkdsl.tensor(np.array([V, -1, V + 7], np.int32))).numpy()
out["outside_nan"] = bool(np.isnan(bad).all())

# Q8_0 (1.1 MB), split at a 512 KiB limit: the packed parts take the same path
Vq = 4096
wq = rng.standard_normal((Vq, D), dtype=np.float32)
raw = gguf.quants.quantize(wq, gguf.GGMLQuantizationType.Q8_0)
deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).astype(np.float64)
Q = device_weight(TensorRecord("q", "Q8_0", (Vq, D), raw), limit=512 << 10)
out["q_parts"] = len(Q.parts) if isinstance(Q, RowSplit) else 0
qb = Q.starts[1] if out["q_parts"] > 1 else 1
qids = np.array([0, qb - 1, qb, Vq - 1, 777], np.int32)
out["q_gather_err"] = float(np.max(np.abs(Q.rows(vkdsl.tensor(qids)).numpy() - deq[qids])))
qy = Q(vkdsl.tensor(x)).numpy()
qref = x.astype(np.float64) @ deq.T
out["q_matmul_rel"] = float(np.max(np.abs(qy - qref)) / np.max(np.abs(qref)))
out["q_outside_nan"] = bool(np.isnan(Q.rows(vkdsl.tensor(np.array([Vq], np.int32))).numpy()).all())
print(json.dumps(out))
'''


def test_a_table_over_one_binding_works_split_under_minimal():
    r = run_under_profile(CHILD, "minimal", timeout=600)
    assert r["range"] == 128 << 20
    assert "exceeds the device's maxStorageBufferRange" in r["whole"], r["whole"]     # one buffer: refused
    assert r["parts"] == 2
    assert r["matmul_rel"] <= 1e-5, r                   # fp32 accumulation over K = 256
    assert r["gather_exact"] and r["outside_nan"]
    assert r["q_parts"] >= 2
    assert r["q_gather_err"] <= 1e-6 and r["q_matmul_rel"] <= 1e-5 and r["q_outside_nan"], r
