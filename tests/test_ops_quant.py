"""Quantization as used by training (vkdsl.ops.quant, models.quantized): the device round
trip (device quantize, device dequantize) in bytes and in error, its codes against the goldens,
the quantized matmul as a graph node forward and backward, and bad input.
Run: pytest tests/test_ops_quant.py
"""
import gguf
import numpy as np
import pytest

import vkdsl
from fixtures.quant_codec import decode
from vkdsl.ops import quant as Q
from vkdsl.autograd import grad
from vkdsl_golden import store
from vkdsl.models.quantized import Packed
from vkdsl.models.tensors import TensorRecord
from vkdsl.ops.quant import roundtrip
from vkdsl.ops.quant.checks import codes_of, pair_packed

U32 = 2.0 ** -24
# Measured relative Frobenius errors on N(0, 1) weights are 0.1076 (int4) and 0.0920 (NF4). The
# int4 estimate: the step is absmax/7 with E[absmax^2] ~ 6.1 for 64 Gaussians, rounding error
# step^2/12 -> sqrt(6.1/49/12) = 0.102; NF4 spends its levels where a Gaussian's mass is.
REL_ERROR = {"int4": 0.115, "int4_f16": 0.115, "nf4": 0.097}
BITS = {"int4": 4.5, "int4_f16": 4.25, "nf4": 33 * 8 / 64}      # nf4 plus 8 bytes per 256 blocks


@pytest.mark.parametrize("fmt", ["int4", "int4_f16", "nf4"])
@pytest.mark.parametrize("shape", [(96, 576), (300, 128)])
def test_device_roundtrip_bytes_and_error(fmt, shape):
    w = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    out, op = roundtrip(vkdsl.tensor(w, name="w"), fmt)
    deq = out.numpy()
    qw = op.packed()
    # the device wrote exactly the host packer's bytes, and dequantized them as the host does
    host = Q.quantize_nf4(w) if fmt == "nf4" else Q.quantize_int4(w, np.float16 if fmt == "int4_f16" else np.float32)
    for a, b in zip(qw.arrays, host.arrays):
        assert np.array_equal(a, b)
    ref = decode(fmt, host.arrays, shape)                                     # independent decoder
    assert np.all(np.abs(deq - ref) <= np.spacing(np.abs(ref)) + 1e-30)     # FMA contraction: 1 ulp
    # real packed storage: bytes counted on the device arrays, not a 4-bit tensor held as fp32
    n = w.size
    extra = 8 * -(-(n // 64) // Q.NF4_GROUP) if fmt == "nf4" else 0
    assert qw.format_bytes == n * BITS[fmt] / 8 + extra
    assert qw.device_bytes - qw.format_bytes < 4 * len(qw.arrays)            # 4-byte padding only
    assert qw.device_bytes / w.nbytes < 0.141
    rel = np.linalg.norm(deq.astype(np.float64) - w) / np.linalg.norm(w.astype(np.float64))
    assert 0.05 < rel < REL_ERROR[fmt], rel


def test_nf4_beats_int4_on_gaussian_weights():
    w = np.random.default_rng(7).standard_normal((128, 512)).astype(np.float32)
    err = {}
    for fmt in ("int4", "nf4"):
        out, op = roundtrip(vkdsl.tensor(w), fmt)
        err[fmt] = np.linalg.norm(out.numpy() - w) / np.linalg.norm(w)
        err[fmt + "_bytes"] = op.packed().device_bytes
    assert err["nf4"] < err["int4"] and err["nf4_bytes"] < err["int4_bytes"]


@pytest.mark.parametrize("op", ["int4_roundtrip", "nf4_roundtrip"])
def test_device_codes_equal_the_goldens(op):
    """Exact comparison of what verify compares by NMSE: codes re-laid out into the golden layout
    (a bit permutation) equal the golden codes; int4 scales within 1 ulp (absmax * fl(1/7) against
    fl(absmax / 7)); NF4 double quantization where the layouts agree (<= 256 blocks)."""
    cases = [c for c in store.iter_cases(1) if c["op"] == op]
    assert cases
    for case in cases:
        a = store.load_case(case)
        x = a["in0"]
        fmt = op.split("_")[0]
        out, qop = roundtrip(vkdsl.tensor(x), fmt)
        deq = out.numpy()
        qw = qop.packed()
        assert np.array_equal(pair_packed(codes_of(qw)), a["out_codes"]), case["name"]
        N, K = x.shape
        if fmt == "int4":
            s = qw.arrays[0].view(np.float32)[:N * K // 64].reshape(N, K // 64)
            assert np.all(np.abs(s - a["out_scales"]) <= np.spacing(a["out_scales"])), case["name"]
            # a 1-ulp scale is <= 2u relative, plus the product's rounding
            assert np.allclose(deq, a["out"], rtol=3 * U32, atol=0), case["name"]
        elif N * K // 64 <= Q.NF4_GROUP:
            nb = N * K // 64
            group = qw.arrays[1].view(np.float32).reshape(-1, 2)
            assert np.array_equal(qw.arrays[0].view(np.int8)[:nb], a["out_absmax_q"])
            assert group[0, 1] == a["out_absmax_offset"]
            assert np.all(np.abs(group[:, 0] - a["out_absmax_scale"]) <= np.spacing(a["out_absmax_scale"]))
            # absmax = q * scale + offset with |q * d(scale)| <= 2u |absmax|, then three roundings
            assert np.allclose(deq, a["out"], rtol=8 * U32, atol=0), case["name"]
        else:   # per-group offsets (vkdsl) vs one global offset (golden): the absmax differ by <= 1 step
            assert np.abs(deq - a["out"]).max() <= 0.01 * np.abs(a["out"]).max(), case["name"]


def record_of(fmt, N, K, seed):
    """A TensorRecord as a loader gives it: GGUF blocks for q*, an F32 matrix for int4 / nf4."""
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    if fmt.startswith("q"):
        raw = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, fmt.upper()))
        return TensorRecord("blk.0.ffn_up.weight", fmt.upper(), (N, K), raw), "keep"
    return TensorRecord("blk.0.ffn_up.weight", "F32", (N, K), w.view(np.uint8)), fmt


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "int4", "nf4"])
def test_qmatmul_graph_node_forward_and_input_gradient(fmt):
    """y = x . W^T with the packed W as a graph node, traced; dx = g . W from autograd (the 'nn'
    kernel). Reference: float64 numpy on the dequantized weight. Bound: fp32 dot products of
    length n, |err| <= gamma_n |x| |W| with gamma_n = n u / (1 - n u), doubled for the one-ulp
    FMA contraction of each dequantized weight."""
    M, N, K = 19, 96, 128
    rec, mode = record_of(fmt, N, K, seed=3)
    W = Packed(rec, mode)
    assert W.device_bytes < W.fp32_bytes / 3
    if mode == "keep":                      # GGUF blocks: gguf's own dequantizer is the reference
        wd = rec.dequantize()
    else:
        qw = Q.quantize_int4(rec.dequantize()) if mode == "int4" else Q.quantize_nf4(rec.dequantize())
        wd = decode(qw.fmt, qw.arrays, qw.shape)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((M, K)).astype(np.float32)
    g = rng.standard_normal((M, N)).astype(np.float32)
    xt = vkdsl.tensor(x, requires_grad=True)

    @vkdsl.trace
    def step(gi):
        y = W(xt)
        return y, grad(y, [xt], upstream=gi)[0]

    y, dx = step(g)
    w64 = wd.astype(np.float64)
    for got, a, b, n in ((y, x, w64.T, K), (dx, g, w64, N)):
        ref, mag = a.astype(np.float64) @ b, np.abs(a.astype(np.float64)) @ np.abs(b)
        gamma = n * U32 / (1 - n * U32)
        assert np.all(np.abs(got - ref) <= 2 * gamma * mag + 1e-30), f"{fmt}: {np.abs(got - ref).max():.3g}"


def _custom_names(t, seen=None):
    """Names of the custom ops a traced output depends on."""
    seen = set() if seen is None else seen
    if id(t) in seen:
        return []
    seen.add(id(t))
    own = [t.arg.name] if t.op == "custom" else []
    return own + [n for s in t.src for n in _custom_names(s, seen)]


@pytest.mark.parametrize("fmt", ["q8_0", "nf4"])
@pytest.mark.parametrize("M, rank, fused", [(19, 8, True), (3, 8, False), (19, 6, False)])
def test_lora_on_a_packed_weight(fmt, M, rank, fused):
    """A packed weight called with its adapter (the model's layers): the LoRA term fused into the
    product where the kernel takes it (more than 4 rows, rank % 4 == 0), else added as its own
    products, with the same forward and the same gradients of x, A and B either way. Reference:
    float64 numpy on the dequantized weight; bounds as above, over the sums of each result."""
    from vkdsl.ops.lora import LoRA
    N, K, s = 96, 128, 2.0
    rec, mode = record_of(fmt, N, K, seed=7)
    W = Packed(rec, mode)
    if mode == "keep":
        wd = rec.dequantize()
    else:
        qw = Q.quantize_nf4(rec.dequantize())
        wd = decode(qw.fmt, qw.arrays, qw.shape)
    rng = np.random.default_rng(8)
    x, g = (rng.standard_normal(sh).astype(np.float32) for sh in ((M, K), (M, N)))
    a, b = (rng.standard_normal(sh).astype(np.float32) * 0.1 for sh in ((K, rank), (rank, N)))
    xt, At, Bt = (vkdsl.tensor(v, requires_grad=True) for v in (x, a, b))

    @vkdsl.trace
    def step(gi):
        y = W(xt, LoRA(At, Bt, s))
        return [y, *grad(y, [xt, At, Bt], upstream=gi)]

    y, dx, da, db = step(g)
    names = _custom_names(W(xt, LoRA(At, Bt, s)))
    assert any(n.endswith("_lora") for n in names) == fused, names
    w, x, a, b, g = (v.astype(np.float64) for v in (wd, x, a, b, g))
    gb = g @ b.T
    rows = [(y, x @ w.T + s * (x @ a) @ b, abs(x) @ abs(w.T) + s * (abs(x) @ abs(a)) @ abs(b), K),
            (dx, g @ w + s * gb @ a.T, abs(g) @ abs(w) + s * (abs(g) @ abs(b.T)) @ abs(a.T), N),
            (da, s * x.T @ gb, s * abs(x.T) @ (abs(g) @ abs(b.T)), M + N),
            (db, s * (x @ a).T @ g, s * (abs(x) @ abs(a)).T @ abs(g), K + M)]
    for i, (got, ref, mag, n) in enumerate(rows):
        gamma = (n + rank) * U32 / (1 - (n + rank) * U32)
        err = np.abs(np.asarray(got) - ref)
        assert np.all(err <= 2 * gamma * mag + 1e-30), f"result {i}: {err.max():.3g}"


def test_fused_lora_under_fp16_saved_activations():
    """The fused layer's U = x A is a narrow product stored transposed, so the fused kernel reads a
    copy of it; with fp16 saved activations its stash must follow that copy, not the product (it
    once read the copy's buffer before the copy was made: NaN in B's gradient). Reference: the
    same step with fp32 activations; fp16 rounding of x and U moves the gradients by ~1e-3."""
    from vkdsl.autograd import saved_activations
    from vkdsl.ops.lora import LoRA
    rec, mode = record_of("q8_0", 96, 64, seed=9)
    W = Packed(rec, mode)
    rng = np.random.default_rng(10)
    x0 = vkdsl.tensor(rng.standard_normal((37, 64)).astype(np.float32))
    a, b = (vkdsl.tensor(rng.standard_normal(sh).astype(np.float32) * 0.1, requires_grad=True)
            for sh in ((64, 8), (8, 96)))
    got = {}
    for act in ("float32", "float16"):
        @vkdsl.trace
        def step():
            y = W((x0 * 1.5).tanh(), LoRA(a, b, 2.0))         # a computed, stashed activation
            with saved_activations(act):
                return grad((y * y).sum(), [a, b])
        got[act] = [np.asarray(t) for t in step()]
    for full, half in zip(got["float32"], got["float16"]):
        assert np.abs(half - full).max() <= 1e-2 * np.abs(full).max()


def test_group_size_that_does_not_divide_the_row_is_refused():
    w = np.ones((4, 100), np.float32)
    for fn in (Q.quantize_int4, Q.quantize_nf4):
        with pytest.raises(ValueError, match="multiple of 64"):
            fn(w)
    with pytest.raises(ValueError, match=r"w\.bad.*multiple of the group size 64.*\(4, 100\)"):
        roundtrip(vkdsl.tensor(w, name="w.bad"), "nf4")
    with pytest.raises(ValueError, match="multiple of 64"):
        Q.plan_quantize(vkdsl.tensor(w).buffer.device, "int4", N=4, K=100)
    with pytest.raises(ValueError, match="4 x 100 must have K a positive multiple of 64"):
        Packed(TensorRecord("blk.0.attn_q.weight", "F32", (4, 100), w.view(np.uint8)), "int4")
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.from_gguf(np.zeros(40, np.uint8), "q4_1", (2, 16))
