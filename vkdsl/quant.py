"""Quantized weights: numpy packing and unpacking, and the device kernels that use them.

A weight W is N x K (rows = output features, as GGUF stores (out, in)), quantized along K:

  q4_0      GGUF: blocks of 32, f16 d, w = d * (q - 8)                      18 bytes / 32 weights
  q4_1      GGUF: blocks of 32, f16 d and m, w = d * q + m                   20 bytes / 32
  q8_0      GGUF: blocks of 32, f16 d, int8 q, w = d * q                     34 bytes / 32
  int4      vkdsl: symmetric groups of 64, s = absmax / 7 (f32), codes -8..7  36 bytes / 64
  int4_f16  the same with f16 scales                                          34 bytes / 64
  nf4       QLoRA NormalFloat-4: blocks of 64, w = NF4[q] * absmax; absmaxes
            double-quantized to int8 per 256 blocks with an f32 scale and offset
                                                            32 + 1 bytes / 64, + 8 per 256 blocks

On the device a weight is a structure of arrays (scales first, 4/8-bit codes last; see
kernels/quant_common.glsl), each padded to 4 bytes, so `device_bytes` equals the block format's
bytes up to that padding. 4-bit codes keep GGUF's nibble order in every 32-element range.

Device kernels (shapes in push constants, one pipeline per format and form):
    plan_qmatmul / record_qmatmul     C = X . W^T (form 'nt', forward) or C = X . W ('nn', dX)
    plan_dequant / record_dequant     W -> fp32
    plan_quantize / record_quantize   fp32 -> int4 / int4_f16 / nf4, on the device
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .compiler import compile_glsl, kernel_source
from .matmul import LVP_TILE, PUSH_FORMAT, _push_block_size, build_kernel, _widest, default_variant, gpu_config, lvp_widths
from .runtime import Buffer

QUANT_PUSH_FORMAT = "<2I"        # QuantPush in kernels/quant_push.glsl: N, K
assert struct.calcsize(QUANT_PUSH_FORMAT) == _push_block_size(kernel_source("quant_push.glsl")), \
    "QUANT_PUSH_FORMAT does not match QuantPush in kernels/quant_push.glsl"

# QLoRA's NormalFloat-4 values (bitsandbytes), and the midpoints a weight is rounded by.
NF4_CODEBOOK = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                         -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                         0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                         0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)
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


FORMATS = {
    "q4_0": Format("q4_0", 32, {"FMT_Q4_0": 1}, ("d", "qs"), "Q4_0"),
    "q4_1": Format("q4_1", 32, {"FMT_Q4_1": 1}, ("dm", "qs"), "Q4_1"),
    "q8_0": Format("q8_0", 32, {"FMT_Q8_0": 1}, ("d", "qs"), "Q8_0"),
    "int4": Format("int4", 64, {"FMT_INT4": 1, "INT4_F16": 0}, ("scale", "qs")),
    "int4_f16": Format("int4_f16", 64, {"FMT_INT4": 1, "INT4_F16": 1}, ("scale", "qs")),
    "nf4": Format("nf4", 64, {"FMT_NF4": 1}, ("amax_code", "group", "qs")),
}
_GGUF_BLOCK = {"q4_0": 18, "q4_1": 20, "q8_0": 34}


def get_format(fmt) -> Format:
    name = getattr(fmt, "name", fmt)            # accepts a GGMLQuantizationType too
    name = str(name).lower()
    if name not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def _check_shape(fmt: Format, N: int, K: int):
    if N <= 0 or K <= 0 or K % fmt.group:
        raise ValueError(f"{fmt.name}: weight {N} x {K} must have K a positive multiple of {fmt.group}")


def format_bytes(fmt, N: int, K: int) -> int:
    """Bytes of the packed block format itself, without the device arrays' padding."""
    f = get_format(fmt)
    if f.gguf:
        return N * K // 32 * _GGUF_BLOCK[f.name]
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
    _check_shape(f, N, K)
    r, g = N * K // 32, N * K // 64
    up4 = lambda n: -(-n // 4) * 4
    return {"q4_0": [up4(2 * r), 16 * r], "q4_1": [4 * r, 16 * r], "q8_0": [up4(2 * r), 32 * r],
            "int4": [4 * g, 16 * r], "int4_f16": [up4(2 * g), 16 * r],
            "nf4": [up4(g), 8 * -(-g // NF4_GROUP), 16 * r]}[f.name]


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

    def upload(self, dev) -> list:
        bufs = []
        for name, a in zip(get_format(self.fmt).arrays, self.arrays):
            b = Buffer(dev, a.nbytes, label=f"{self.fmt}.{name}")
            b.write(a)
            bufs.append(b)
        return bufs

    @classmethod
    def from_device(cls, fmt, shape, buffers) -> "QuantizedWeight":
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
    bb = _GGUF_BLOCK[f.name]
    raw = np.ascontiguousarray(data).view(np.uint8)
    if shape is None:
        if raw.ndim != 2:
            raise ValueError("pass shape=(N, K) with flat GGUF data")
        shape = (raw.shape[0], raw.shape[1] // bb * 32)
    N, K = int(shape[0]), int(shape[1])
    _check_shape(f, N, K)
    blocks = raw.reshape(-1)
    if blocks.nbytes != N * K // 32 * bb:
        raise ValueError(f"{f.name} {N} x {K}: expected {N * K // 32 * bb} bytes of blocks, got {blocks.nbytes}")
    blocks = blocks.reshape(-1, bb)
    scale_bytes = 4 if f.name == "q4_1" else 2           # d (and m) lead each block
    return QuantizedWeight(f.name, (N, K), (blocks[:, :scale_bytes], blocks[:, scale_bytes:]))


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """codes (..., 32) in 0..15 -> 16 bytes per range, GGUF order (byte j: element j, j + 16)."""
    c = codes.reshape(-1, 32).astype(np.uint8)
    return (c[:, :16] | (c[:, 16:] << 4)).astype(np.uint8)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    q = qs.reshape(-1, 16)
    return np.concatenate([q & 0xF, q >> 4], axis=1)      # (ranges, 32)


def _groups(w: np.ndarray, fmt: str) -> np.ndarray:
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"{fmt}: expected a 2-D weight (N, K), got shape {w.shape}")
    _check_shape(FORMATS[fmt], *w.shape)
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
    return QuantizedWeight(fmt, w.shape, (scales, _pack_nibbles(codes)))


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
        acodes[first:first + len(a)] = np.clip(np.rint((a - offset) / div), -127, 127).astype(np.int8)
        group[i] = scale, offset
    return QuantizedWeight("nf4", w.shape, (acodes, group, _pack_nibbles(codes)))


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """numpy reference: the fp32 weight (N x K) the device kernels must reproduce."""
    N, K = qw.shape
    r = N * K // 32
    f = qw.fmt
    a = qw.arrays
    if f == "q8_0":
        d = a[0].view(np.float16)[:r].astype(np.float32)
        w = d[:, None] * a[1].view(np.int8).reshape(r, 32).astype(np.float32)
    elif f in ("q4_0", "q4_1"):
        q = _unpack_nibbles(a[1]).astype(np.float32)
        if f == "q4_0":
            w = a[0].view(np.float16)[:r].astype(np.float32)[:, None] * (q - np.float32(8))
        else:
            dm = a[0].view(np.float16).reshape(r, 2).astype(np.float32)
            w = dm[:, :1] * q + dm[:, 1:]
    elif f in ("int4", "int4_f16"):
        s = (a[0].view(np.float16) if f == "int4_f16" else a[0].view(np.float32))[:r // 2].astype(np.float32)
        w = np.repeat(s, 2)[:, None] * (_unpack_nibbles(a[1]).astype(np.float32) - np.float32(8))
    elif f == "nf4":
        nb = r // 2
        group = a[1].view(np.float32).reshape(-1, 2)
        gi = np.arange(nb) // NF4_GROUP
        amax = a[0].view(np.int8)[:nb].astype(np.float32) * group[gi, 0] + group[gi, 1]
        w = NF4_CODEBOOK[_unpack_nibbles(a[2])] * np.repeat(amax, 2)[:, None]
    else:
        raise ValueError(f"unknown format {f}")
    return w.astype(np.float32).reshape(N, K)


# ---- device kernels ------------------------------------------------------------------------

_kernel = build_kernel          # (dev, source, name, defines, n_buffers, push_format, local)


def _grid(items: int, local: int = 64) -> tuple:
    """Workgroups for `items` work items of a 1-D kernel, folded into y past 65535 (work_item())."""
    groups = -(-items // local)
    gx = min(groups, 65535)
    return (gx, -(-groups // gx), 1) if groups else (0, 0, 0)


@dataclass(frozen=True)
class QuantPlan:
    name: str
    kernel: object
    groups: tuple
    push: bytes
    fmt: str
    N: int
    K: int
    bytes_x: int = 0             # qmatmul: smallest X and C buffers
    bytes_c: int = 0
    flops: int = 0
    kernel2: object = None       # nf4 quantize: the second pass
    groups2: tuple = ()
    scratch_bytes: int = 0

    @property
    def dispatches(self) -> int:
        """Dispatches (descriptor sets) the plan records: size Recording(dev, n_sets) with it."""
        return 2 if self.kernel2 is not None else 1


def qmatmul_variant(dev, f: Format, form: str, variant: str, vec: int, sv: int):
    """(kernel name, defines, local size, rows and columns per workgroup) of a qmatmul variant."""
    tb = int(form == "nt")
    if variant == "gpu":
        cfg = gpu_config(dev)
        d = dict(f.defines, TB=tb, VARIANT_GPU=1, VEC=1, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], TM=cfg["TM"],
                 TN=cfg["TN"])
        return f"qmatmul_{form}_{f.name}_gpu{cfg['BM']}", d, cfg["LOCAL"], cfg["BM"], cfg["BN"]
    if variant != "lvp":
        raise ValueError(f"unknown qmatmul variant {variant!r} (lvp or gpu)")
    t = LVP_TILE
    d = dict(f.defines, TB=tb, VEC=vec, SV=sv, TM=t["TM"], TN=t["TN"])
    lx, ly, _ = t["LOCAL"]
    return f"qmatmul_{form}_{f.name}_lvp_v{vec}s{sv}", d, t["LOCAL"], ly * t["TM"], lx * t["TN"]


MV_ROWS = 4          # up to this many rows of X use the matrix-vector kernel (qmatvec.comp)


def plan_qmatmul(dev, fmt, *, M: int, N: int, K: int, form: str = "nt", batch: int = 1,
                 batch_stride_x: int | None = None, variant: str | None = None) -> QuantPlan:
    """Matmul with a quantized N x K weight W (dequantized in the shader):
    form 'nt': C (M x N) = X (M x K) . W^T;   form 'nn': C (M x K) = X (M x N) . W.
    X is fp32, batched with batch_stride_x elements (None: dense; 0: one X for every batch)."""
    f = get_format(fmt)
    M, N, K, batch = int(M), int(N), int(K), int(batch)
    _check_shape(f, N, K)
    if form not in ("nt", "nn"):
        raise ValueError(f"qmatmul form is 'nt' (X . W^T) or 'nn' (X . W), not {form!r}")
    rows, cols, red = (M, N, K) if form == "nt" else (M, K, N)
    sx = rows * red if batch_stride_x is None else int(batch_stride_x)
    sc = rows * cols
    variant = variant or default_variant(dev)
    if form == "nt" and batch == 1 and 0 < M <= MV_ROWS and variant == "lvp" and K % 4 == 0:
        # decode-sized inputs: a tile of 16 rows would waste most of its work on M = 1
        name = f"qmatvec_{f.name}"
        kernel = _kernel(dev, "qmatvec.comp", name, dict(f.defines, MV_ROWS=MV_ROWS), 2 + len(f.arrays),
                         PUSH_FORMAT, (64, 1, 1))
        return QuantPlan(name=name, kernel=kernel, groups=_grid(-(-N // 4)), push=struct.pack(PUSH_FORMAT, M, N, K, 0, 0, 0),
                         fmt=f.name, N=N, K=K, bytes_x=4 * M * K, bytes_c=4 * M * N, flops=2 * M * N * K)
    vec = _widest([red, sx], lvp_widths(dev))
    name, defines, local, bm, bn = qmatmul_variant(dev, f, form, variant, vec, 4 if cols % 4 == 0 else 1)
    kernel = _kernel(dev, "qmatmul.comp", name, defines, 2 + len(f.arrays), PUSH_FORMAT, local)
    groups = (-(-cols // bn), -(-rows // bm), batch) if min(rows, batch) > 0 else (0, 0, 0)
    last = max(batch - 1, 0)
    return QuantPlan(name=name, kernel=kernel, groups=groups, push=struct.pack(PUSH_FORMAT, rows, cols, red, sx, 0, sc),
                     fmt=f.name, N=N, K=K, bytes_x=4 * (last * sx + rows * red), bytes_c=4 * (last * sc + rows * cols),
                     flops=2 * rows * cols * red * batch)


def _check_arrays(plan: QuantPlan, qbuffers):
    want = array_nbytes(plan.fmt, plan.N, plan.K)
    if len(qbuffers) != len(want):
        raise ValueError(f"{plan.name}: {plan.fmt} takes {len(want)} arrays "
                         f"({', '.join(get_format(plan.fmt).arrays)}), got {len(qbuffers)}")
    for name, b, n in zip(get_format(plan.fmt).arrays, qbuffers, want):
        if b.nbytes < n:
            raise ValueError(f"{plan.name}: array {name} holds {b.nbytes} bytes, the weight needs {n}")


def record_qmatmul(rec, plan: QuantPlan, C, X, *qbuffers):
    _check_arrays(plan, qbuffers)
    for what, buf, need in (("C", C, plan.bytes_c), ("X", X, plan.bytes_x)):
        if buf.nbytes < need:
            raise ValueError(f"{plan.name}: buffer {what} holds {buf.nbytes} bytes, the plan needs {need}")
    rec.dispatch(plan.kernel, [C, X, *qbuffers], plan.groups, plan.push, writes=[0])


def plan_dequant(dev, fmt, *, N: int, K: int) -> QuantPlan:
    f = get_format(fmt)
    _check_shape(f, N, K)
    kernel = _kernel(dev, "quant_dequant.comp", f"dequant_{f.name}", f.defines, 1 + len(f.arrays),
                     QUANT_PUSH_FORMAT, (64, 1, 1))
    return QuantPlan(name=f"dequant_{f.name}", kernel=kernel, groups=_grid(N * K // 32),
                     push=struct.pack(QUANT_PUSH_FORMAT, N, K), fmt=f.name, N=N, K=K, bytes_c=4 * N * K)


def record_dequant(rec, plan: QuantPlan, W, *qbuffers):
    """W (fp32 N x K) = the dequantized weight."""
    _check_arrays(plan, qbuffers)
    if W.nbytes < plan.bytes_c:
        raise ValueError(f"{plan.name}: output holds {W.nbytes} bytes, needs {plan.bytes_c}")
    rec.dispatch(plan.kernel, [W, *qbuffers], plan.groups, plan.push, writes=[0])


def plan_quantize(dev, fmt, *, N: int, K: int) -> QuantPlan:
    """fp32 -> int4 / int4_f16 / nf4 on the device, the same bytes as quantize_int4 / quantize_nf4."""
    f = get_format(fmt)
    _check_shape(f, N, K)
    push = struct.pack(QUANT_PUSH_FORMAT, N, K)
    groups = N * K // 64
    if f.name in ("int4", "int4_f16"):
        items = -(-groups // 2) if f.name == "int4_f16" else groups     # f16: a pair of groups each
        k = _kernel(dev, "quant_pack_int4.comp", f"quantize_{f.name}", {"INT4_F16": f.defines["INT4_F16"]}, 3,
                    QUANT_PUSH_FORMAT, (64, 1, 1))
        return QuantPlan(name=f"quantize_{f.name}", kernel=k, groups=_grid(items), push=push, fmt=f.name, N=N, K=K)
    if f.name == "nf4":
        k1 = _kernel(dev, "quant_pack_nf4.comp", "quantize_nf4_blocks", {"PASS": 1}, 5, QUANT_PUSH_FORMAT, (64, 1, 1))
        k2 = _kernel(dev, "quant_pack_nf4.comp", "quantize_nf4_scales", {"PASS": 2}, 5, QUANT_PUSH_FORMAT, (8, 1, 1))
        return QuantPlan(name="quantize_nf4", kernel=k1, groups=_grid(groups), push=push, fmt="nf4", N=N, K=K,
                         kernel2=k2, groups2=_grid(-(-groups // NF4_GROUP), 8), scratch_bytes=4 * groups)
    raise ValueError(f"no device quantizer for {f.name} (int4, int4_f16 and nf4 have one)")


def record_quantize(rec, plan: QuantPlan, W, *qbuffers, scratch=None):
    """qbuffers (the format's arrays, written) = quantize(W). nf4 needs a scratch buffer of
    plan.scratch_bytes (the fp32 block absmaxes between its two passes)."""
    _check_arrays(plan, qbuffers)
    if W.nbytes < 4 * plan.N * plan.K:
        raise ValueError(f"{plan.name}: W holds {W.nbytes} bytes, needs {4 * plan.N * plan.K}")
    n = len(qbuffers)
    if plan.kernel2 is None:
        rec.dispatch(plan.kernel, [*qbuffers, W], plan.groups, plan.push, writes=list(range(n)))
        return
    if scratch is None or scratch.nbytes < plan.scratch_bytes:
        raise ValueError(f"{plan.name}: needs a scratch buffer of {plan.scratch_bytes} bytes")
    bufs = [*qbuffers, W, scratch]
    rec.dispatch(plan.kernel, bufs, plan.groups, plan.push, writes=[2, 4])
    rec.dispatch(plan.kernel2, bufs, plan.groups2, plan.push, writes=[0, 1])



def builtin_variants(dev=None) -> list[str]:
    """Compile (to SPIR-V, no pipelines) every quantized-weight kernel this device can pick."""
    from .runtime import default_device
    dev = dev or default_device()
    jobs = []
    for f in FORMATS.values():
        for form in ("nt", "nn"):
            variants = [qmatmul_variant(dev, f, form, "gpu", 1, 1)]
            variants += [qmatmul_variant(dev, f, form, "lvp", vec, sv) for vec in lvp_widths(dev) for sv in (4, 1)]
            jobs += [("qmatmul.comp", name, d) for name, d, _, _, _ in variants]
        jobs.append(("quant_dequant.comp", f"dequant_{f.name}", f.defines))
    jobs += [("quant_pack_int4.comp", "quantize_int4", {"INT4_F16": 0}),
             ("quant_pack_int4.comp", "quantize_int4_f16", {"INT4_F16": 1}),
             ("quant_pack_nf4.comp", "quantize_nf4_blocks", {"PASS": 1}),
             ("quant_pack_nf4.comp", "quantize_nf4_scales", {"PASS": 2})]
    for source, name, defines in jobs:
        compile_glsl(name, kernel_source(source), defines)
    return [name for _, name, _ in jobs]

def _example_weight(fmt, w):
    if get_format(fmt).gguf:
        import gguf
        return from_gguf(gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, fmt.upper())), fmt)
    return quantize_nf4(w) if fmt == "nf4" else quantize_int4(w, np.float16 if fmt == "int4_f16" else np.float32)


def bench(M=256, K=576, N=1536, fmts=("q4_1",), forms=("nt", "nn"), rounds=5, dev=None):
    """Time of qmatmul against the fp32 matmul of the same shape (nt: x . W^T with W fp32 N x K;
    nn: g . W), interleaved so both see the same machine load; best of rounds x 5 submits."""
    import time

    from .matmul import plan_matmul, record_matmul
    from .runtime import Recording, default_device
    dev = dev or default_device()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((M, max(N, K))).astype(np.float32)
    X, W, C = Buffer(dev, x.nbytes), Buffer(dev, w.nbytes), Buffer(dev, 4 * M * max(N, K))
    X.write(x)
    W.write(w)
    rows = []
    for form in forms:
        pf = plan_matmul(dev, M=M, N=N if form == "nt" else K, K=K if form == "nt" else N, tb=form == "nt")
        rf = Recording(dev, 1)
        record_matmul(rf, pf, C, X, W)
        for fmt in fmts:
            qbufs = _example_weight(fmt, w).upload(dev)
            pq = plan_qmatmul(dev, fmt, M=M, N=N, K=K, form=form)
            rq = Recording(dev, 1)
            record_qmatmul(rq, pq, C, X, *qbufs)
            best = {}
            for _ in range(rounds):
                for tag, rec in (("fp32", rf), ("quant", rq)):
                    rec.submit_wait()
                    for _ in range(5):
                        t = time.perf_counter()
                        rec.submit_wait()
                        best[tag] = min(best.get(tag, float("inf")), time.perf_counter() - t)
            rq.release()
            rows.append({"form": form, "fmt": fmt, "kernel": pq.name, "fp32_kernel": pf.name,
                         "quant_ms": best["quant"] * 1e3, "fp32_ms": best["fp32"] * 1e3,
                         "ratio": best["quant"] / best["fp32"], "quant_gflops": pq.flops / best["quant"] / 1e9})
        rf.release()
    return rows


if __name__ == "__main__":
    # python -m vkdsl.quant [M,K,N] [formats] [forms]   e.g. python -m vkdsl.quant 256,576,1536 q4_1,nf4 nt
    import sys
    args = sys.argv[1:]
    M, K, N = (int(v) for v in args[0].split(",")) if args else (256, 576, 1536)
    fmts = tuple(args[1].split(",")) if len(args) > 1 else ("q4_1",)
    forms = tuple(args[2].split(",")) if len(args) > 2 else ("nt", "nn")
    for r in bench(M, K, N, fmts, forms):
        print(f"{r['form']} {r['fmt']:8s} M={M} K={K} N={N}: {r['kernel']} {r['quant_ms']:.2f} ms "
              f"({r['quant_gflops']:.1f} GFLOP/s), {r['fp32_kernel']} {r['fp32_ms']:.2f} ms, ratio {r['ratio']:.2f}",
              flush=True)
