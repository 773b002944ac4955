"""Llama-family model files for vkdsl: GGUF and Hugging Face safetensors loaders (both give
GGUF names, (out, in) shapes and GGUF Q/K row order), the tokenizer and the chat template.

No Vulkan here: the device forward pass is built on top of these records.
"""
from __future__ import annotations

import os
from pathlib import Path

from .config import LlamaConfig
from .errors import ModelFileError
from .gguf_loader import config_from_gguf, load_gguf, open_gguf
from .safetensors_loader import (config_from_hf, gguf_name_to_hf, gguf_to_hf_rows,
                                 hf_name_to_gguf, hf_to_gguf_rows, load_hf)
from .tensors import SUPPORTED_TYPES, LlamaCheckpoint, TensorRecord, expected_shapes
from .tokenizer import Tokenizer, load_tokenizer


def load_checkpoint(path: str | os.PathLike) -> LlamaCheckpoint:
    """A .gguf file or a Hugging Face folder (config.json + safetensors)."""
    if Path(path).is_file() and Path(path).suffix == ".safetensors":
        raise ModelFileError(f"{path}: a bare .safetensors file holds weights only; pass the Hugging Face folder "
                             f"that holds it with config.json")
    return load_hf(path) if Path(path).is_dir() else load_gguf(path)


def load_model_files(path: str | os.PathLike) -> tuple[LlamaCheckpoint, Tokenizer]:
    """Checkpoint and tokenizer, reading a GGUF file once."""
    if Path(path).is_file() and Path(path).suffix == ".safetensors":
        raise ModelFileError(f"{path}: a bare .safetensors file holds weights only; pass the Hugging Face folder "
                             f"that holds it with config.json and tokenizer.json")
    if Path(path).is_dir():
        ck = load_hf(path)
        return ck, load_tokenizer(path, expected_vocab=ck.config.vocab_size)
    reader = open_gguf(path)
    ck = load_gguf(path, reader)
    return ck, load_tokenizer(path, expected_vocab=ck.config.vocab_size, reader=reader)


__all__ = ["LlamaConfig", "ModelFileError", "LlamaCheckpoint", "TensorRecord", "SUPPORTED_TYPES",
           "Tokenizer", "load_tokenizer", "load_checkpoint", "load_model_files", "load_gguf", "load_hf", "open_gguf",
           "config_from_gguf", "config_from_hf", "expected_shapes", "hf_to_gguf_rows",
           "gguf_to_hf_rows", "hf_name_to_gguf", "gguf_name_to_hf"]
