"""Quantization references: nibble layout, int4, NF4, GGUF block dequantizers."""
from __future__ import annotations

import statistics

import numpy as np
import pytest

from vkdsl_golden import reference_quant as Q
from vkdsl_golden.store import load_case

from golden_common import (cases, f64, ids, rng0)


# =======================================================================================
# quantization
# =======================================================================================

def test_nibble_packing_layout():
    codes = np.array([[-8, 7, 0, -1, 3, -3]])
    packed = Q.pack_nibbles(codes)
    assert packed.tolist() == [[0x78, 0xF0, 0xD3]]      # low nibble = even element
    assert Q.unpack_nibbles(packed, signed=True).tolist() == codes.tolist()


@pytest.mark.parametrize("c", cases("int4_roundtrip"), ids=ids)
def test_int4_roundtrip(c):
    a = load_case(c)
    x = a["in0"].astype(f64)
    xg = x.reshape(x.shape[0], -1, 64)
    assert np.array_equal(a["out_scales"], (np.abs(xg).max(-1) / 7).astype(np.float32))
    codes = Q.unpack_nibbles(a["out_codes"], signed=True).reshape(xg.shape)
    s = a["out_scales"].astype(f64)[..., None]
    assert codes.min() >= -8 and codes.max() <= 7
    assert np.all(np.abs(xg - codes * s) <= s / 2 * (1 + 1e-6) + 0.0)  # nearest code
    assert np.array_equal(a["out"], (codes * s).reshape(x.shape))
    if c["name"] == "int4_roundtrip[3x320]":
        assert a["out_scales"][1, 1] == 0 and np.all(a["out"][1, 64:128] == 0)


def test_nf4_codebook_is_qlora_normalfloat():
    # QLoRA: quantiles of N(0,1), 8 positive and 7 negative halves + 0, offset 0.9677083
    nd, off = statistics.NormalDist(), 0.9677083
    pos = [nd.inv_cdf(p) for p in np.linspace(off, 0.5, 9)[:-1]]
    neg = [-nd.inv_cdf(p) for p in np.linspace(off, 0.5, 8)[:-1]]
    v = np.sort(np.array(pos + [0.0] + neg))
    np.testing.assert_allclose(Q.NF4_CODEBOOK, v / v.max(), atol=5e-7)
    assert Q.NF4_CODEBOOK[7] == 0 and Q.NF4_CODEBOOK[0] == -1 and Q.NF4_CODEBOOK[15] == 1


@pytest.mark.parametrize("c", cases("nf4_roundtrip"), ids=ids)
def test_nf4_roundtrip(c):
    a = load_case(c)
    x = a["in0"].astype(f64).reshape(-1, 64)
    absmax = np.abs(x).max(-1)
    nb = absmax.size
    codes = Q.unpack_nibbles(a["out_codes"], signed=False).reshape(-1, 64)
    # codes are the nearest codebook entries to x / absmax (brute force, per element)
    for b in range(0, nb, max(1, nb // 7)):
        for j in range(64):
            d = [abs(x[b, j] / absmax[b] - cb) for cb in Q.NF4_CODEBOOK]
            assert d[codes[b, j]] == min(d)
    # double quant: offset = mean absmax, one scale per 256 blocks, |error| <= half a step
    off = float(a["out_absmax_offset"])
    assert abs(off - absmax.mean()) <= 1e-6 * absmax.mean()
    assert a["out_absmax_scale"].shape == (-(-nb // 256),)
    s = np.repeat(a["out_absmax_scale"].astype(f64), 256)[:nb]
    deq_absmax = a["out_absmax_q"].astype(f64) * s + off
    assert np.all(np.abs(deq_absmax - absmax) <= s / 2 * (1 + 1e-6))
    np.testing.assert_array_equal(a["out"], (Q.NF4_CODEBOOK[codes] * deq_absmax[:, None]).reshape(a["out"].shape))


def _gguf_raw(qtype, rows, cols, seed):
    """Random bytes of a GGUF-quantized (rows, cols) tensor made with gguf.quants.quantize."""
    import gguf
    x = rng0(seed).standard_normal((rows, cols)).astype(np.float32)
    return gguf.quants.quantize(x, qtype)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_dequant_matches_gguf_package(name):
    import gguf
    qt = getattr(gguf.GGMLQuantizationType, name)
    fn = getattr(Q, "dequant_" + name.lower())
    raw = _gguf_raw(qt, 5, 96, 30)                          # (5, bytes per row) uint8
    ours = fn(raw, (5, 96))
    assert np.array_equal(ours.astype(np.float32), gguf.quants.dequantize(raw, qt))
    for c in cases("dequant_" + name.lower()):              # the stored random-byte cases
        a = load_case(c)
        rows, cols = c["params"]["shape"]
        theirs = gguf.quants.dequantize(a["in0"].reshape(rows, -1), qt)
        assert np.array_equal(a["out"].astype(np.float32), theirs), c["name"]
        assert np.array_equal(a["out"], fn(a["in0"], (rows, cols)))


@pytest.mark.parametrize("name", ["F16", "Q4_K", "Q5_K", "Q6_K"])
def test_stored_f16_and_kquant_cases_match_the_gguf_package(name):
    """The stored random-byte cases of the newer formats, decoded again by gguf: the goldens'
    decoders (written from the definitions) and gguf's agree (to fp32 rounding of d * sc * q - m)."""
    import gguf
    qt = getattr(gguf.GGMLQuantizationType, name)
    fn = getattr(Q, "dequant_" + name.lower())
    stored = cases("dequant_" + name.lower())
    assert stored
    for c in stored:
        a = load_case(c)
        rows, cols = c["params"]["shape"]
        theirs = gguf.quants.dequantize(a["in0"].astype(np.uint8).reshape(rows, -1), qt).astype(np.float64)
        assert np.max(np.abs(a["out"] - theirs)) <= 1e-6 * np.max(np.abs(theirs)), c["name"]
        assert np.array_equal(a["out"], fn(a["in0"], (rows, cols)))


def test_q4_nibble_order_low_first():
    # a single Q4_1 block with d=1, m=0: byte j = (j+16) << 4 | j encodes elements j and j+16
    blk = np.concatenate([np.array([1.0, 0.0], "<f2").view(np.uint8),
                          np.array([(j & 0xF) | (((15 - j) & 0xF) << 4) for j in range(16)], np.uint8)])
    w = Q.dequant_q4_1(blk, (1, 32))[0]
    assert w[:16].tolist() == list(range(16)) and w[16:].tolist() == [15 - j for j in range(16)]
