"""Quantized weight formats: their block layouts, and the numpy codecs the device kernels must
match.

A weight W is N x K (rows = output features, as GGUF stores (out, in)), quantized along K:

  q4_0      GGUF: blocks of 32, f16 d, w = d * (q - 8)                      18 bytes / 32 weights
  q4_1      GGUF: blocks of 32, f16 d and m, w = d * q + m                   20 bytes / 32
  q8_0      GGUF: blocks of 32, f16 d, int8 q, w = d * q                     34 bytes / 32
  f16       GGUF F16: every weight a half, widened exactly as it is read     64 bytes / 32
  q4_k      GGUF: super-blocks of 256, f16 d and dmin, 6-bit scale and min
            codes per 32, w = d * sc * q - dmin * m (q 4-bit)                144 bytes / 256
  q5_k      the same with 5-bit q (a fifth bit per weight in qh)             176 bytes / 256
  q6_k      GGUF: super-blocks of 256, f16 d, int8 scale per 16,
            w = d * sc * (q - 32) (q 6-bit)                                  210 bytes / 256
  int4      vkdsl: symmetric groups of 64, s = absmax / 7 (f32), codes -8..7  36 bytes / 64
  int4_f16  the same with f16 scales                                          34 bytes / 64
  nf4       QLoRA NormalFloat-4: blocks of 64, w = NF4[q] * absmax; absmaxes
            double-quantized to int8 per 256 blocks with an f32 scale and offset
                                                            32 + 1 bytes / 64, + 8 per 256 blocks

On the device a weight is a structure of arrays (scales first, 4/8-bit codes last; see
vkdsl/kernels/quant_common.glsl), each padded to 4 bytes, so `device_bytes` equals the block
format's bytes up to that padding. 4-bit codes keep GGUF's nibble order in every 32-element range.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# QLoRA's NormalFloat-4 values (bitsandbytes), and the midpoints a weight is rounded by.
NF4_CODEBOOK = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                         -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                         0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                         0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                         0.7229568362236023, 1.0], np.float32)
NF4_MID = ((NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / np.float32(2)).astype(np.float32)
NF4_GROUP = 256                  # blocks per double-quantization group
# Scales divide by 7 and 127 as multiplies by float32 reciprocals: shader compilers turn a division
# by a constant into that multiply, so host and device agree to the bit only this way.
INV7 = np.float32(1) / np.float32(7)
INV127 = np.float32(1) / np.float32(127)


@dataclass(frozen=True)
class Format:
    name: str
    group: int                   # weights per scale along K (K must be a multiple)
    defines: dict
    arrays: tuple                # device arrays, binding order
    gguf: str | None = None      # GGMLQuantizationType name

    @property
    def words(self) -> tuple:
        """32-bit words each array's shader reads at a time (Q_ARRAY_U1/U2/U4 in quant_common.glsl):
        4 for the codes, 2 for nf4's (scale, offset) pairs, 1 for the other scales."""
        return tuple(4 if a in _UVEC4_ARRAYS else 2 if a == "group" else 1 for a in self.arrays)


FORMATS = {
    "q4_0": Format("q4_0", 32, {"FMT_Q4_0": 1}, ("d", "qs"), "Q4_0"),
    "q4_1": Format("q4_1", 32, {"FMT_Q4_1": 1}, ("dm", "qs"), "Q4_1"),
    "q8_0": Format("q8_0", 32, {"FMT_Q8_0": 1}, ("d", "qs"), "Q8_0"),
    "int4": Format("int4", 64, {"FMT_INT4": 1, "INT4_F16": 0}, ("scale", "qs")),
    "int4_f16": Format("int4_f16", 64, {"FMT_INT4": 1, "INT4_F16": 1}, ("scale", "qs")),
    "nf4": Format("nf4", 64, {"FMT_NF4": 1}, ("amax_code", "group", "qs")),
    "f16": Format("f16", 32, {"FMT_F16": 1}, ("w",), "F16"),
    "q4_k": Format("q4_k", 256, {"FMT_Q4_K": 1}, ("dm", "sc", "qs"), "Q4_K"),
    "q5_k": Format("q5_k", 256, {"FMT_Q5_K": 1}, ("dm", "sc", "qh", "qs"), "Q5_K"),
    "q6_k": Format("q6_k", 256, {"FMT_Q6_K": 1}, ("d", "sc", "ql", "qh"), "Q6_K"),
}
_UVEC4_ARRAYS = ("qs", "qh", "ql", "w")
# GGUF block formats: (weights per block, bytes per block)
_GGUF_BLOCK = {"q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34), "f16": (32, 64),
               "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}
# where each device array lies in a block (byte ranges, in the format's array order)
_BLOCK_ARRAYS = {"q4_0": ((0, 2), (2, 18)), "q4_1": ((0, 4), (4, 20)), "q8_0": ((0, 2), (2, 34)),
                 "f16": ((0, 64),), "q4_k": ((0, 4), (4, 16), (16, 144)),
                 "q5_k": ((0, 4), (4, 16), (16, 48), (48, 176)),
                 "q6_k": ((208, 210), (192, 208), (0, 128), (128, 192))}


def get_format(fmt) -> Format:
    name = getattr(fmt, "name", fmt)            # accepts a GGMLQuantizationType too
    name = str(name).lower()
    if name not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def check_shape(fmt: Format, N: int, K: int):
    if N <= 0 or K <= 0 or K % fmt.group:
        raise ValueError(f"{fmt.name}: weight {N} x {K} must have K a positive multiple of "
                         f"{fmt.group}")


def format_bytes(fmt, N: int, K: int) -> int:
    """Bytes of the packed block format itself, without the device arrays' padding."""
    f = get_format(fmt)
    if f.gguf:
        per, nbytes = _GGUF_BLOCK[f.name]
        return N * K // per * nbytes
    groups = N * K // 64
    if f.name == "nf4":
        return groups * 33 + -(-groups // NF4_GROUP) * 8
    return groups * (36 if f.name == "int4" else 34)


def _pad4(a: np.ndarray) -> np.ndarray:
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    if raw.nbytes % 4:
        raw = np.concatenate([raw, np.zeros(4 - raw.nbytes % 4, np.uint8)])
    return raw


def array_nbytes(fmt, N: int, K: int) -> list[int]:
    """Sizes of the device arrays (binding order) of an N x K weight."""
    f = get_format(fmt)
    check_shape(f, N, K)
    r, g, sb = N * K // 32, N * K // 64, N * K // 256
    up4 = lambda n: -(-n // 4) * 4
    return {"q4_0": [up4(2 * r), 16 * r], "q4_1": [4 * r, 16 * r], "q8_0": [up4(2 * r), 32 * r],
            "int4": [4 * g, 16 * r], "int4_f16": [up4(2 * g), 16 * r],
            "nf4": [up4(g), 8 * -(-g // NF4_GROUP), 16 * r], "f16": [64 * r],
            "q4_k": [4 * sb, 12 * sb, 128 * sb], "q5_k": [4 * sb, 12 * sb, 32 * sb, 128 * sb],
            "q6_k": [up4(2 * sb), 16 * sb, 128 * sb, 64 * sb]}[f.name]


@dataclass
class QuantizedWeight:
    fmt: str
    shape: tuple                 # (N, K): N rows (output features), K columns (quantized along K)
    arrays: tuple                # device arrays in binding order, each uint8 with nbytes % 4 == 0

    def __post_init__(self):
        self.arrays = tuple(_pad4(a) for a in self.arrays)
        want = array_nbytes(self.fmt, *self.shape)
        got = [a.nbytes for a in self.arrays]
        if got != want:
            raise ValueError(f"{self.fmt} {self.shape}: arrays of {got} bytes, expected {want}")

    @property
    def device_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    @property
    def format_bytes(self) -> int:
        return format_bytes(self.fmt, *self.shape)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.device_bytes / (self.shape[0] * self.shape[1])

    @classmethod
    def from_device(cls, fmt, shape, buffers) -> "QuantizedWeight":
        """Read a weight's arrays back from device buffers (anything with .read(dtype, count))."""
        return cls(get_format(fmt).name, tuple(shape),
                   tuple(b.read(np.uint8, n) for b, n in zip(buffers, array_nbytes(fmt, *shape))))

    def dequantize(self) -> np.ndarray:
        return dequantize(self)


# ---- numpy packing -------------------------------------------------------------------------

def from_gguf(data: np.ndarray, qtype, shape=None) -> QuantizedWeight:
    """GGUF blocks (uint8, (N, row bytes) as gguf's reader gives them) -> device arrays."""
    f = get_format(qtype)
    if not f.gguf:
        raise ValueError(f"{f.name} is not a GGUF block format")
    per, bb = _GGUF_BLOCK[f.name]
    raw = np.ascontiguousarray(data).view(np.uint8)
    if shape is None:
        if raw.ndim != 2:
            raise ValueError("pass shape=(N, K) with flat GGUF data")
        shape = (raw.shape[0], raw.shape[1] // bb * per)
    N, K = int(shape[0]), int(shape[1])
    check_shape(f, N, K)
    blocks = raw.reshape(-1)
    if blocks.nbytes != N * K // per * bb:
        raise ValueError(f"{f.name} {N} x {K}: expected {N * K // per * bb} bytes of blocks, got "
                         f"{blocks.nbytes}")
    blocks = blocks.reshape(-1, bb)
    return QuantizedWeight(f.name, (N, K), tuple(blocks[:, a:b] for a, b in _BLOCK_ARRAYS[f.name]))


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """codes (..., 32) in 0..15 -> 16 bytes per range, GGUF order (byte j: element j, j + 16)."""
    c = codes.reshape(-1, 32).astype(np.uint8)
    return (c[:, :16] | (c[:, 16:] << 4)).astype(np.uint8)


def unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    q = qs.reshape(-1, 16)
    return np.concatenate([q & 0xF, q >> 4], axis=1)      # (ranges, 32)


def _groups(w: np.ndarray, fmt: str) -> np.ndarray:
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"{fmt}: expected a 2-D weight (N, K), got shape {w.shape}")
    check_shape(FORMATS[fmt], *w.shape)
    return np.ascontiguousarray(w).reshape(-1, 64)


def quantize_int4(w: np.ndarray, scale_dtype=np.float32) -> QuantizedWeight:
    """Symmetric int4 per 64 weights along K: s = absmax / 7 (as absmax * float32(1/7); f32 or f16),
    code = round(w / s) half to even, clipped to -8..7 (in practice -7..7)."""
    fmt = "int4_f16" if np.dtype(scale_dtype) == np.float16 else "int4"
    if fmt == "int4" and np.dtype(scale_dtype) != np.float32:
        raise ValueError("int4 scales are float32 or float16")
    g = _groups(w, fmt)
    s = (np.abs(g).max(axis=1) * INV7).astype(np.float32)
    if fmt == "int4_f16":
        s = s.astype(np.float16).astype(np.float32)
    div = np.where(s > 0, s, np.float32(1))
    codes = np.clip(np.rint(g / div[:, None]), -8, 7).astype(np.int32) + 8
    scales = s.astype(np.float16) if fmt == "int4_f16" else s
    return QuantizedWeight(fmt, w.shape, (scales, pack_nibbles(codes)))


def quantize_nf4(w: np.ndarray) -> QuantizedWeight:
    """NF4 per 64 weights (nearest codebook value of w / absmax); absmaxes double-quantized to int8
    per 256 blocks: offset = mean (sequential float32 sum, as the device kernel adds),
    scale = max |absmax - offset| / 127, code = round((absmax - offset) / scale)."""
    g = _groups(w, "nf4")
    amax = np.abs(g).max(axis=1).astype(np.float32)
    v = g / np.where(amax > 0, amax, np.float32(1))[:, None]
    codes = (v[..., None] > NF4_MID).sum(axis=-1)
    nb = len(amax)
    acodes = np.zeros(nb, np.int8)
    group = np.zeros((-(-nb // NF4_GROUP), 2), np.float32)
    for i, first in enumerate(range(0, nb, NF4_GROUP)):
        a = amax[first:first + NF4_GROUP]
        offset = np.float32(np.cumsum(a, dtype=np.float32)[-1] / np.float32(len(a)))
        scale = np.float32(np.abs(a - offset).max() * INV127)
        div = scale if scale > 0 else np.float32(1)
        acodes[first:first + len(a)] = np.clip(np.rint((a - offset) / div), -127,
                                               127).astype(np.int8)
        group[i] = scale, offset
    return QuantizedWeight("nf4", w.shape, (acodes, group, pack_nibbles(codes)))


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """numpy reference: the fp32 weight (N x K) the device kernels must reproduce."""
    N, K = qw.shape
    r = N * K // 32
    f = qw.fmt
    a = qw.arrays
    if f in ("q4_k", "q5_k", "q6_k"):
        return _kquant_dequantize(qw)
    if f == "f16":
        w = a[0].view(np.float16).astype(np.float32)
    elif f == "q8_0":
        d = a[0].view(np.float16)[:r].astype(np.float32)
        w = d[:, None] * a[1].view(np.int8).reshape(r, 32).astype(np.float32)
    elif f in ("q4_0", "q4_1"):
        q = unpack_nibbles(a[1]).astype(np.float32)
        if f == "q4_0":
            w = a[0].view(np.float16)[:r].astype(np.float32)[:, None] * (q - np.float32(8))
        else:
            dm = a[0].view(np.float16).reshape(r, 2).astype(np.float32)
            w = dm[:, :1] * q + dm[:, 1:]
    elif f in ("int4", "int4_f16"):
        s = (a[0].view(np.float16) if f == "int4_f16"
             else a[0].view(np.float32))[:r // 2].astype(np.float32)
        w = np.repeat(s, 2)[:, None] * (unpack_nibbles(a[1]).astype(np.float32) - np.float32(8))
    elif f == "nf4":
        nb = r // 2
        group = a[1].view(np.float32).reshape(-1, 2)
        gi = np.arange(nb) // NF4_GROUP
        amax = a[0].view(np.int8)[:nb].astype(np.float32) * group[gi, 0] + group[gi, 1]
        w = NF4_CODEBOOK[unpack_nibbles(a[2])] * np.repeat(amax, 2)[:, None]
    else:
        raise ValueError(f"unknown format {f}")
    return w.astype(np.float32).reshape(N, K)


def _kquant_dequantize(qw: QuantizedWeight) -> np.ndarray:
    """K-quants: the device arrays put back into GGUF super-blocks, decoded by the gguf package."""
    import gguf
    per, bb = _GGUF_BLOCK[qw.fmt]
    N, K = qw.shape
    nb = N * K // per
    blocks = np.zeros((nb, bb), np.uint8)
    for arr, (a, b) in zip(qw.arrays, _BLOCK_ARRAYS[qw.fmt]):
        blocks[:, a:b] = arr[:nb * (b - a)].reshape(nb, b - a)
    qt = getattr(gguf.GGMLQuantizationType, qw.fmt.upper())
    return gguf.quants.dequantize(blocks, qt).astype(np.float32).reshape(N, K)
