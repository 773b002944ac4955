"""The few-row quantized kernel (decode, M <= 4) against numpy float64 on the weight decoded
independently (gguf's dequantizer, tests/fixtures/quant_codec.py). The kernel is the lvp variant's
choice for few rows; it runs on any device, so the test asks for that variant. Tolerance: fp32 dot products of K = 128 terms of O(1) values: |err| < 1e-4 (gamma_K bound ~1e-5*sum|x||w|)."""
import gguf
import numpy as np
import pytest

from fixtures.quant_codec import decode
from vkdsl.ops import quant
from vkdsl.runtime import Buffer, Recording


@pytest.mark.parametrize("loads", ["texel", "storage"])
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "f16", "q4_k", "q5_k", "q6_k", "int4", "nf4"])
@pytest.mark.parametrize("M", [1, 3, 4])
def test_qmatvec(dev, fmt, M, loads, monkeypatch):
    # the weight as uniform texel buffers (lavapipe's choice) or as storage buffers (GPUs', and a
    # weight past maxTexelBufferElements)
    if loads == "storage":
        monkeypatch.setattr(quant.kernels, "texel_fits", lambda *a: False)
    rng = np.random.default_rng(M)
    N, K = 70, (256 if fmt.endswith("_k") else 128)
    w = rng.standard_normal((N, K)).astype(np.float32)
    if fmt.endswith("_k"):                               # random super-blocks, decoded by gguf
        from fixtures.quant_codec import kquant_blocks
        raw, ref_w = kquant_blocks(fmt, N, K, seed=M)
        qw = quant.from_gguf(raw, fmt.upper(), (N, K))
    elif fmt.startswith("q") or fmt == "f16":
        qt = getattr(gguf.GGMLQuantizationType, fmt.upper())
        raw = gguf.quants.quantize(w, qt)
        qw, ref_w = quant.from_gguf(raw, fmt.upper(), (N, K)), gguf.quants.dequantize(raw, qt)
    else:
        qw = quant.quantize_int4(w) if fmt == "int4" else quant.quantize_nf4(w)
        ref_w = decode(fmt, qw.arrays, (N, K))
    x = rng.standard_normal((M, K)).astype(np.float32)
    X, C = Buffer(dev, x.nbytes), Buffer(dev, 4 * M * N + 64)
    X.write(x)
    C.write(np.full(M * N + 16, 7.0, np.float32))          # sentinels past the output
    plan = quant.plan_qmatmul(dev, fmt, M=M, N=N, K=K, variant="lvp")
    assert plan.name.startswith("qmatvec") and plan.name.endswith("_t") == (loads == "texel")
    rec = Recording(dev, 2)
    quant.record_qmatmul(rec, plan, C, X, *quant.upload_weight(dev, qw))
    rec.submit_wait()
    out = C.read(np.float32)
    np.testing.assert_allclose(out[:M * N].reshape(M, N), x.astype(np.float64) @ np.asarray(ref_w, np.float64).T, atol=1e-4)
    assert (out[M * N:] == 7.0).all()
