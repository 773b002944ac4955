"""The device model of a checkpoint, by family: Qwen3.5's hybrid or the Llama family's."""
from __future__ import annotations

from .llama import Llama
from .qwen35 import Qwen35
from .tensors import LlamaCheckpoint


def build_model(ckpt: LlamaCheckpoint, quant: str = "keep") -> Llama | Qwen35:
    return Qwen35(ckpt, quant) if ckpt.config.arch == "qwen35" else Llama(ckpt, quant)
