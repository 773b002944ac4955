"""Float64 numpy references for the quantization round trips (symmetric int4, NF4 with double-
quantized scales) and GGUF's block dequantizers, written from the formats' definitions.
numpy only; nothing from vkdsl is imported."""
from __future__ import annotations

import numpy as np

from .reference import exact_sum, matmul


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)

__all__ = ["int4_quantize", "int4_dequantize", "int4_roundtrip",
           "NF4_CODEBOOK", "nf4_quantize", "nf4_dequantize", "nf4_roundtrip",
           "pack_nibbles", "unpack_nibbles", "dequant_q8_0", "dequant_q4_0", "dequant_q4_1",
           "dequant_f16", "dequant_q4_k", "dequant_q5_k", "dequant_q6_k", "qmatmul_f16in",
           "qgather", "gguf_weight", "packed_weight"]


# ---------------------------------------------------------------------------------------
# 4-bit packing shared by int4 and NF4: two codes per byte, low nibble = even element
# ---------------------------------------------------------------------------------------

def pack_nibbles(codes) -> np.ndarray:
    """(..., 2k) codes (their low 4 bits) -> (..., k) uint8:
    byte = c[2j] & 15 | (c[2j+1] & 15) << 4."""
    c = np.asarray(codes).astype(np.int64) & 0xF
    if c.shape[-1] % 2:
        raise ValueError("need an even number of codes along the last axis")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed, signed: bool) -> np.ndarray:
    """Inverse of pack_nibbles; signed=True reads nibbles as two's complement -8..7."""
    b = np.asarray(packed).astype(np.int64)
    c = np.empty(b.shape[:-1] + (2 * b.shape[-1],), dtype=np.int64)
    c[..., 0::2], c[..., 1::2] = b & 0xF, b >> 4
    return np.where(c >= 8, c - 16, c) if signed else c


# ---------------------------------------------------------------------------------------
# symmetric int4, groups of `group` along the last axis
# ---------------------------------------------------------------------------------------

def int4_quantize(x, group: int = 64):
    """Returns (packed uint8 (..., n/2), scales float32 (..., n/group)); scale = float32(absmax/7),
    code = clip(rint(x/scale), -8, 7)."""
    x = _f64(x)
    if x.shape[-1] % group:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of {group}")
    xg = x.reshape(x.shape[:-1] + (-1, group))
    scales = (np.max(np.abs(xg), -1) / 7.0).astype(np.float32)   # the scale as stored
    s = scales.astype(np.float64)[..., None]
    safe = np.where(s > 0, s, 1.0)                                # all-zero group -> codes 0
    codes = np.clip(np.rint(xg / safe), -8, 7).astype(np.int64)
    return pack_nibbles(codes.reshape(x.shape)), scales


def int4_dequantize(packed, scales, group: int = 64) -> np.ndarray:
    """code * scale, float64, shape (..., n)."""
    c = unpack_nibbles(packed, signed=True).astype(np.float64)
    cg = c.reshape(c.shape[:-1] + (-1, group))
    return (cg * _f64(scales)[..., None]).reshape(c.shape)


def int4_roundtrip(x, group: int = 64):
    """Returns (dequantized float64, packed uint8, scales float32)."""
    packed, scales = int4_quantize(x, group)
    return int4_dequantize(packed, scales, group), packed, scales


# ---------------------------------------------------------------------------------------
# NF4 (QLoRA NormalFloat-4) with double-quantized block scales.
#
# Layout chosen here (x (..., n), n % 64 == 0; blocks run along the flattened row-major data):
#   codes         uint8 (..., n/2)  4-bit indices into NF4_CODEBOOK, packed as pack_nibbles
#                                   (low nibble = even element; bitsandbytes uses the high one)
#   absmax_q      int8  (nb,)       nb = numel/64; per-block absmax, double-quantized:
#   absmax_scale  float32 (ceil(nb/256),)   one scale per 256 consecutive blocks
#   absmax_offset float32 ()        float32(mean of all block absmax), subtracted first
#   absmax_q[b] = clip(rint((absmax[b] - offset) / absmax_scale[b // 256]), -127, 127)
#   (absmax_scale = float32(max |absmax - offset| over its 256 blocks / 127); 0 -> codes 0)
#   dequant: x = NF4_CODEBOOK[code] * (absmax_q[b] * absmax_scale[b // 256] + offset)
# Codes are chosen with the exact block absmax (as bitsandbytes does): the nearest codebook
# value to x / absmax, ties to the lower index.
# ---------------------------------------------------------------------------------------

# The float32 table from bitsandbytes / the QLoRA paper (Appendix E), as float64.
NF4_CODEBOOK = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=np.float32).astype(np.float64)

NF4_BLOCK = 64
NF4_SCALE_BLOCK = 256


def nf4_quantize(x) -> dict:
    """NF4 with double-quantized scales; returns {codes, absmax_q, absmax_scale, absmax_offset}
    (layout above)."""
    x = _f64(x)
    if x.shape[-1] % NF4_BLOCK:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of {NF4_BLOCK}")
    blocks = x.reshape(-1, NF4_BLOCK)
    absmax = np.max(np.abs(blocks), -1)                             # exact (float32 values)
    norm = blocks / np.where(absmax > 0, absmax, 1.0)[:, None]
    codes = np.argmin(np.abs(norm[..., None] - NF4_CODEBOOK), -1)   # ties -> lower index
    offset = np.float32(exact_sum(absmax) / absmax.shape[0])
    dev = absmax - np.float64(offset)
    nb = absmax.shape[0]
    n_sb = -(-nb // NF4_SCALE_BLOCK)
    pad = np.zeros(n_sb * NF4_SCALE_BLOCK)
    pad[:nb] = np.abs(dev)
    sscale = (pad.reshape(n_sb, -1).max(-1) / 127.0).astype(np.float32)
    s = np.repeat(sscale.astype(np.float64), NF4_SCALE_BLOCK)[:nb]
    q = np.clip(np.rint(dev / np.where(s > 0, s, 1.0)), -127, 127).astype(np.int8)
    return {
        "codes": pack_nibbles(codes.reshape(x.shape)),
        "absmax_q": q,
        "absmax_scale": sscale,
        "absmax_offset": np.asarray(offset, dtype=np.float32),
    }


def nf4_dequantize(codes, absmax_q, absmax_scale, absmax_offset) -> np.ndarray:
    """Float64 values from the NF4 layout above; shape (..., 2 * codes.shape[-1])."""
    c = unpack_nibbles(codes, signed=False)
    s = np.repeat(_f64(absmax_scale), NF4_SCALE_BLOCK)[: np.asarray(absmax_q).shape[0]]
    absmax = _f64(absmax_q) * s + float(_f64(absmax_offset))
    vals = NF4_CODEBOOK[c].reshape(-1, NF4_BLOCK) * absmax[:, None]
    return vals.reshape(c.shape)


def nf4_roundtrip(x):
    """Returns (dequantized float64, the nf4_quantize dict)."""
    q = nf4_quantize(x)
    return nf4_dequantize(**q), q


# ---------------------------------------------------------------------------------------
# GGUF block dequantization from raw little-endian bytes; shape = (rows, cols), cols % 32 == 0
#   Q8_0: 34 bytes = f16 d, 32 x int8 q;          w = d * q
#   Q4_0: 18 bytes = f16 d, 16 bytes of nibbles;  w = d * (nibble - 8)
#   Q4_1: 20 bytes = f16 d, f16 m, 16 bytes;      w = d * nibble + m
#   4-bit: byte j holds element j (low nibble) and element j + 16 (high nibble).
# ---------------------------------------------------------------------------------------

def _blocks(raw, shape, nbytes: int) -> np.ndarray:
    """Raw bytes -> (n_blocks, nbytes) uint8, checking the size against shape."""
    rows, cols = shape
    if cols % 32:
        raise ValueError(f"cols {cols} is not a multiple of 32")
    b = np.ascontiguousarray(np.asarray(raw, dtype=np.uint8).ravel())
    nblk = rows * cols // 32
    if b.size != nblk * nbytes:
        raise ValueError(f"expected {nblk * nbytes} bytes for shape {tuple(shape)}, got {b.size}")
    return b.reshape(nblk, nbytes)


def _f16(b2) -> np.ndarray:
    """(n, 2) little-endian bytes -> float64 (n,)."""
    return np.ascontiguousarray(b2).view("<f2").astype(np.float64)[:, 0]


def _nibbles32(qs) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) unsigned nibbles: low nibbles first, then high nibbles."""
    q = qs.astype(np.int64)
    return np.concatenate([q & 0xF, q >> 4], axis=1)


def dequant_q8_0(raw, shape) -> np.ndarray:
    """GGUF Q8_0 bytes -> float64 (rows, cols)."""
    b = _blocks(raw, shape, 34)
    q = b[:, 2:].view(np.int8).astype(np.float64)
    return (_f16(b[:, :2])[:, None] * q).reshape(shape)


def dequant_q4_0(raw, shape) -> np.ndarray:
    """GGUF Q4_0 bytes -> float64 (rows, cols)."""
    b = _blocks(raw, shape, 18)
    q = (_nibbles32(b[:, 2:]) - 8).astype(np.float64)
    return (_f16(b[:, :2])[:, None] * q).reshape(shape)


def dequant_q4_1(raw, shape) -> np.ndarray:
    """GGUF Q4_1 bytes -> float64 (rows, cols)."""
    b = _blocks(raw, shape, 20)
    q = _nibbles32(b[:, 4:]).astype(np.float64)
    return (_f16(b[:, :2])[:, None] * q + _f16(b[:, 2:4])[:, None]).reshape(shape)


def dequant_f16(raw, shape) -> np.ndarray:
    """GGUF F16 bytes (little-endian halves, row-major) -> float64 (rows, cols)."""
    b = _blocks(raw, shape, 64)
    return np.ascontiguousarray(b).reshape(-1, 2).view("<f2").astype(np.float64).reshape(shape)


# GGUF K-quants: super-blocks of 256 weights (shape = (rows, cols), cols % 256 == 0)
#   Q4_K: 144 bytes = f16 d, f16 dmin, 12 bytes of 6-bit scale/min codes, 128 bytes of nibbles
#         range j (32 weights): w = d * sc_j * q - dmin * m_j,
#                               q = nibble (j % 2) of byte 32 (j / 2) + e
#         codes: j < 4: sc = s[j] & 63, m = s[j+4] & 63;
#                j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4,
#                        m = (s[j+4] >> 4) | (s[j] >> 6) << 4
#   Q5_K: 176 bytes = d, dmin, 12 code bytes, 32 bytes qh (bit j of byte e: bit 4 of range j's
#         element e), 128 bytes of nibbles as Q4_K
#   Q6_K: 210 bytes = 128 ql, 64 qh, 16 int8 scales (one per 16 weights), f16 d;
#         w[t] = d * sc[t / 16] * (q - 32), h = t / 128, u = t % 128,
#         q = nibble (u / 64) of ql[64 h + u % 64] | ((qh[32 h + u % 32] >> 2 (u / 32)) & 3) << 4

def _kscales(s) -> tuple[np.ndarray, np.ndarray]:
    s = s.astype(np.int64)
    sc, m = np.zeros((len(s), 8), np.int64), np.zeros((len(s), 8), np.int64)
    for j in range(8):
        if j < 4:
            sc[:, j], m[:, j] = s[:, j] & 63, s[:, j + 4] & 63
        else:
            sc[:, j] = (s[:, j + 4] & 15) | ((s[:, j - 4] >> 6) << 4)
            m[:, j] = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
    return sc, m


def _k_blocks(raw, shape, nbytes):
    rows, cols = shape
    if cols % 256:
        raise ValueError(f"cols {cols} is not a multiple of 256")
    b = np.ascontiguousarray(np.asarray(raw, dtype=np.uint8).ravel())
    if b.size != rows * cols // 256 * nbytes:
        raise ValueError(f"expected {rows * cols // 256 * nbytes} bytes for shape {tuple(shape)}, "
                         f"got {b.size}")
    return b.reshape(-1, nbytes)


def _q45_k(raw, shape, five: bool) -> np.ndarray:
    b = _k_blocks(raw, shape, 176 if five else 144)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _kscales(b[:, 4:16])
    qs = b[:, 48:176] if five else b[:, 16:144]
    out = np.zeros((len(b), 256), np.float64)
    e = np.arange(32)
    for j in range(8):
        q = (qs[:, 32 * (j // 2) + e].astype(np.int64) >> (4 * (j % 2))) & 15
        if five:
            q = q | (((b[:, 16 + e].astype(np.int64) >> j) & 1) << 4)
        out[:, 32 * j + e] = (d * sc[:, j])[:, None] * q - (dmin * m[:, j])[:, None]
    return out.reshape(shape)


def dequant_q4_k(raw, shape) -> np.ndarray:
    """GGUF Q4_K bytes -> float64 (rows, cols)."""
    return _q45_k(raw, shape, False)


def dequant_q5_k(raw, shape) -> np.ndarray:
    """GGUF Q5_K bytes -> float64 (rows, cols)."""
    return _q45_k(raw, shape, True)


def dequant_q6_k(raw, shape) -> np.ndarray:
    """GGUF Q6_K bytes -> float64 (rows, cols)."""
    b = _k_blocks(raw, shape, 210)
    ql, qh = b[:, 0:128].astype(np.int64), b[:, 128:192].astype(np.int64)
    sc, d = b[:, 192:208].view(np.int8).astype(np.float64), _f16(b[:, 208:210])
    t = np.arange(256)
    h, u = t // 128, t % 128
    q = (((ql[:, 64 * h + u % 64] >> (4 * (u // 64))) & 15)
         | (((qh[:, 32 * h + u % 32] >> (2 * (u // 32))) & 3) << 4))
    return (d[:, None] * sc[:, t // 16] * (q - 32)).reshape(shape)


def gguf_weight(raw, fmt: str, shape) -> np.ndarray:
    """The float64 weight of GGUF bytes in one of the formats the cases draw."""
    deq = {"q8_0": dequant_q8_0, "q4_0": dequant_q4_0, "q4_1": dequant_q4_1, "f16": dequant_f16,
           "q4_k": dequant_q4_k, "q5_k": dequant_q5_k, "q6_k": dequant_q6_k}[fmt]
    return deq(raw, tuple(shape))


def packed_weight(arrays, fmt: str, shape) -> np.ndarray:
    """The float64 weight (N, K) of a case's packed arrays: GGUF bytes (one array), int4's
    (codes, scales) or NF4's (codes, absmax_q, absmax_scale, absmax_offset), laid out as above."""
    if fmt == "int4":
        return int4_dequantize(np.asarray(arrays[0], np.uint8), arrays[1]).reshape(shape)
    if fmt == "nf4":
        codes, q, scale, offset = arrays
        return nf4_dequantize(np.asarray(codes, np.uint8), q, scale,
                              np.reshape(offset, ())).reshape(shape)
    return gguf_weight(arrays[0], fmt, shape)


def qmatmul_f16in(x, raw, fmt: str, shape, form: str) -> np.ndarray:
    """X times a GGUF weight W of shape (N, K) at precision fp16: X and the dequantized W rounded
    to fp16 (round to nearest even), summed exactly; form nt: X . W^T, nn: X . W."""
    deq = {"q8_0": dequant_q8_0, "q4_0": dequant_q4_0, "q4_1": dequant_q4_1,
           "q6_k": dequant_q6_k}[fmt]
    w = deq(raw, tuple(shape)).astype(np.float16)
    return matmul(np.asarray(x, np.float32).astype(np.float16), w, tb=form == "nt")


def qgather(raw, ids, fmt: str, shape) -> np.ndarray:
    """Rows ids of a GGUF table of shape (V, D): an embedding lookup in a quantized table."""
    deq = {"q8_0": dequant_q8_0, "q4_0": dequant_q4_0, "q4_1": dequant_q4_1,
           "q6_k": dequant_q6_k}[fmt]
    return deq(raw, tuple(shape))[np.asarray(ids, np.int64)]
