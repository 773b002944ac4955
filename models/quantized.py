"""Packed weights: placeholder until the quantized matmul kernels land (keeps everything dense)."""


def wants_packed(rec, quant):
    return False
