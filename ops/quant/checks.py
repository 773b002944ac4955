"""verify rows for quantization, all on the device: int4 and NF4 round trips (the device quantize
kernel, then the device dequantize kernel, in one recorded program) and the GGUF block
dequantizers (Q8_0, Q4_0, Q4_1) reading from_gguf arrays.

The goldens store 4-bit codes two per byte with the even element in the low nibble, int4 codes
as two's complement; vkdsl keeps GGUF's nibble order (element j and j + 16 of each 32) and int4
codes offset by 8. Codes read back from the device are re-laid out on the host (a bit
permutation, nothing recomputed) before they are compared."""
from __future__ import annotations

import numpy as np

import vkdsl
from vkdsl.precision import matmul_precision
from vkdsl.verify import fp16_unsupported, register

from .formats import NF4_GROUP, QuantizedWeight, from_gguf, pack_nibbles, unpack_nibbles
from .gather import qgather
from .linear import dequant, packed_arrays, qlinear, qlora_linear
from .roundtrip import roundtrip


# ---- host re-layout of device codes into the golden layout (golden/reference_train.py) --------

def pair_packed(codes: np.ndarray) -> np.ndarray:
    """(N, K) codes (low 4 bits used) -> (N, K/2) uint8, byte = c[2j] | c[2j+1] << 4."""
    c = codes.astype(np.int64) & 0xF
    return (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)


def codes_of(qw: QuantizedWeight) -> np.ndarray:
    """The 4-bit codes per element (N, K): int4 as -8..7, NF4 as codebook indices 0..15."""
    qs = qw.arrays[-1]
    c = unpack_nibbles(qs).astype(np.int64).reshape(qw.shape)
    return c - 8 if qw.fmt == "int4" else c


def _check_group(p, key, want):
    if key in p and int(p[key]) != want:
        raise ValueError(f"vkdsl's device format uses {key}={want}, the case asks for {p[key]}")


def _int4(i, p):
    _check_group(p, "group", 64)
    out, op = roundtrip(i[0], "int4")
    out.numpy()                                # runs quantize + dequantize on the device
    qw = op.packed()
    N, K = qw.shape
    scales = qw.arrays[0].view(np.float32)[:N * K // 64].reshape(N, K // 64)
    return {"out": out, "out_codes": vkdsl.tensor(pair_packed(codes_of(qw))),
            "out_scales": vkdsl.tensor(scales)}


def _nf4(i, p):
    _check_group(p, "block", 64)
    _check_group(p, "scale_block", NF4_GROUP)
    out, op = roundtrip(i[0], "nf4")
    out.numpy()
    qw = op.packed()
    N, K = qw.shape
    nb = N * K // 64
    res = {"out": out, "out_codes": vkdsl.tensor(pair_packed(codes_of(qw)))}
    if nb <= NF4_GROUP:
        # one double-quantization group: vkdsl's per-group offset is the golden's global one
        group = qw.arrays[1].view(np.float32).reshape(-1, 2)
        res.update(out_absmax_q=vkdsl.tensor(qw.arrays[0].view(np.int8)[:nb].astype(np.int32)),
                   out_absmax_scale=vkdsl.tensor(group[:, 0].copy()),
                   out_absmax_offset=vkdsl.tensor(np.float32(group[0, 1])))
    return res


def _gguf(fmt):
    def build(i, p):
        raw = i[0].numpy().astype(np.uint8)           # the case's bytes (one per int32 element)
        return dequant(from_gguf(raw, fmt, tuple(p["shape"])))
    return build


register("int4_roundtrip", _int4, 1e-12,
         "device quantize then dequantize: scale = absmax * fl(1/7) in fp32 vs the golden's "
         "fl(absmax/7) can differ by 1 ulp -> NMSE ~ eps32^2 = 1e-14 on out and out_scales; codes "
         "(re-laid out on the host) must agree: one code off changes a packed byte by >= 1, NMSE "
         ">= 1/(bytes * 255^2) >= 3e-8")
register("nf4_roundtrip", _nf4, 1e-5,
         "device quantize then dequantize; 4-bit codes compared too (a layout error gives NMSE ~ "
         "0.1; a single near-midpoint flip could hide under this limit: tests/test_ops_quant.py "
         "compares them exactly). Double quantization differs above 256 blocks: vkdsl keeps an "
         "offset per 256-block group, the golden one global offset, so absmax_q/scale/offset are "
         "compared only up to 256 blocks and the reconstructed absmax of each may sit scale/2 = "
         "max|absmax - offset|/254 away (<= 0.3% of a Gaussian block's absmax): NMSE <= "
         "(0.0083/2.6)^2 = 1e-5 worst case, 1.4e-6 measured on 257x64; up to 256 blocks the "
         "layouts agree and NMSE ~ 1e-15")
register("dequant_q8_0", _gguf("q8_0"), 0.0, "f16 d times an int8: a 19-bit product, exact in fp32")
register("dequant_q4_0", _gguf("q4_0"), 0.0, "f16 d times (q - 8): a 16-bit product, exact in fp32")
register("dequant_f16", _gguf("f16"), 0.0, "every f16 is exactly an fp32")
for _k in ("q4_k", "q5_k"):
    register(f"dequant_{_k}", _gguf(_k), 1.5e-14,
             "d * sc and dmin * m are exact in fp32 (11-bit times 6-bit); times q and minus the "
             "offset rounds once or twice (an FMA may fuse them): |err| <= 2^-23 |w| -> NMSE "
             "<= 1.4e-14")
register("dequant_q6_k", _gguf("q6_k"), 0.0,
         "d * sc (11-bit times 8-bit) times (q - 32) (7-bit): a 26-bit product, "
         "exact in fp32")
register("dequant_q4_1", _gguf("q4_1"), 1e-14,
         "d * q is exact in fp32, adding the f16 m rounds once: |err| <= 2^-24 |w| -> NMSE "
         "<= 3.6e-15")


def _qmatmul_fp16(i, p):
    qw = from_gguf(i[1].numpy().astype(np.uint8), p["fmt"], tuple(p["shape"]))
    with matmul_precision("fp16"):
        return qlinear(i[0], packed_arrays(qw, qw.fmt), qw.fmt, qw.shape, p["form"])


register("qmatmul_f16in", _qmatmul_fp16, 1e-8,
         "precision fp16 with a quantized weight, against the golden of X and the dequantized "
         "weight rounded to fp16: exact fp32 products, fp32 sums as in matmul (NMSE ~ n*eps32^2); "
         "the device's fp32 dequantization can round a Q4_1 weight to the other fp16 neighbour "
         "only at a tie (one element in thousands, NMSE < 1e-10); a kernel that kept fp32 inputs "
         "is off by ~1e-7", fp16_unsupported)


def _qgather(i, p):
    qw = from_gguf(i[0].numpy().astype(np.uint8), p["fmt"], tuple(p["shape"]))
    return qgather(i[1], packed_arrays(qw, qw.fmt), qw.fmt, qw.shape)


register("qgather", _qgather, 0.0,
         "rows of the table dequantized as they are gathered: the same exact products as "
         "dequant_*; the kernel's output is guarded, so a row written past the ids is a failure")


def case_weight(arrays, p) -> QuantizedWeight:
    """A case's packed weight in vkdsl's layout: GGUF bytes (one per int32 element), or the
    goldens' int4 (codes, scales) / NF4 (codes, absmax_q, scale, offset) arrays re-laid out —
    GGUF's nibble order, int4 codes offset by 8 — with nothing recomputed."""
    fmt, shape = p["fmt"], tuple(p["shape"])
    host = [a.numpy() for a in arrays]
    if fmt not in ("int4", "nf4"):
        return from_gguf(host[0].astype(np.uint8), fmt, shape)
    pairs = host[0].astype(np.uint8)
    codes = np.stack([pairs & 0xF, pairs >> 4], -1).reshape(shape)   # element 2j: the low nibble
    if fmt == "int4":                   # two's complement c -> c + 8: c with bit 3 flipped
        return QuantizedWeight("int4", shape, (host[1].astype(np.float32).ravel(),
                                               pack_nibbles(codes ^ 8)))
    if shape[0] * shape[1] // 64 > NF4_GROUP:
        raise ValueError(f"an NF4 case of {shape} has more than {NF4_GROUP} blocks: the goldens "
                         f"keep one offset, vkdsl one per {NF4_GROUP} blocks")
    group = np.array([[host[2][0], host[3][0]]], np.float32)     # (scale, offset) of one group
    return QuantizedWeight("nf4", shape, (host[1].astype(np.int8), group, pack_nibbles(codes)))


def _qlinear(i, p):
    qw = case_weight(i[1:], p)
    return qlinear(i[0], packed_arrays(qw, qw.fmt), qw.fmt, qw.shape)


register("qlinear", _qlinear, 1e-8,
         "a packed weight without an adapter, decoded in the product: fp32 dot products over K <= "
         "512 terms (NMSE ~ n eps32^2 ~ 1e-12), the input gradient the nn form of the same depth; "
         "a block decoded with the wrong scale or offset is off by 1e-3 or more")


def _qlora(i, p):
    qw = case_weight(i[1:-2], p)                    # x, the weight's arrays, A, B
    return qlora_linear(i[0], packed_arrays(qw, qw.fmt), qw.fmt, qw.shape, i[-2], i[-1], p["s"])


register("qlora_linear", _qlora, 1e-8,
         "LoRA on a packed weight, the adapter's term in the quantized product's epilogue: fp32 "
         "dot products over K + r <= 268 terms (NMSE ~ n eps32^2 ~ 4e-12), the gradients a "
         "backward of the same depth; a rank component left out of the epilogue is off by "
         "~1e-4 or more")
