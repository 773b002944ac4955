"""Llama-family model files for vkdsl: GGUF and Hugging Face safetensors loaders (both give
GGUF names, (out, in) shapes and GGUF Q/K row order), the tokenizer and the chat template.

No Vulkan here: the device forward pass is built on top of these records.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from . import qwen35_files
from .config import LlamaConfig
from .errors import ModelFileError
from .gguf_loader import config_from_gguf, load_gguf, open_gguf
from .safetensors_loader import (config_from_hf, gguf_name_to_hf, gguf_to_hf_rows,
                                 hf_name_to_gguf, hf_to_gguf_rows, load_hf)
from .tensors import SUPPORTED_TYPES, LlamaCheckpoint, TensorRecord, expected_shapes
from .tokenizer import Tokenizer, load_tokenizer


def _load_folder(path) -> LlamaCheckpoint:
    """A Hugging Face folder of either computation: Qwen3.5's hybrid or the Llama family's."""
    config = Path(path) / "config.json"
    if config.is_file():
        try:
            raw = json.loads(config.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ModelFileError(f"{config}: not JSON ({e})") from None
        if isinstance(raw, dict) and qwen35_files.is_qwen35(raw):
            return qwen35_files.load_hf(Path(path), raw, config)
    return load_hf(path)


def _load_file(path, reader=None) -> LlamaCheckpoint:
    """A GGUF file of either computation."""
    reader = reader if reader is not None else open_gguf(path)
    field = reader.fields.get("general.architecture")
    if field is not None and field.contents() == "qwen35":
        return qwen35_files.load_gguf(reader, Path(path))
    return load_gguf(path, reader)


def load_checkpoint(path: str | os.PathLike) -> LlamaCheckpoint:
    """A .gguf file or a Hugging Face folder (config.json + safetensors)."""
    if Path(path).is_file() and Path(path).suffix == ".safetensors":
        raise ModelFileError(f"{path}: a bare .safetensors file holds weights only; pass the "
                             f"Hugging Face folder that holds it with config.json")
    return _load_folder(path) if Path(path).is_dir() else _load_file(path)


def load_model_files(path: str | os.PathLike) -> tuple[LlamaCheckpoint, Tokenizer]:
    """Checkpoint and tokenizer, reading a GGUF file once."""
    if Path(path).is_file() and Path(path).suffix == ".safetensors":
        raise ModelFileError(f"{path}: a bare .safetensors file holds weights only; pass the "
                             f"Hugging Face folder that holds it with config.json and "
                             f"tokenizer.json")
    if Path(path).is_dir():
        ck = _load_folder(path)
        return ck, load_tokenizer(path, expected_vocab=ck.config.vocab_size)
    reader = open_gguf(path)
    ck = _load_file(path, reader)
    return ck, load_tokenizer(path, expected_vocab=ck.config.vocab_size, reader=reader)


__all__ = ["LlamaConfig", "ModelFileError", "LlamaCheckpoint", "TensorRecord", "SUPPORTED_TYPES",
           "Tokenizer", "load_tokenizer", "load_checkpoint", "load_model_files", "load_gguf",
           "load_hf", "open_gguf", "config_from_gguf", "config_from_hf", "expected_shapes",
           "hf_to_gguf_rows", "gguf_to_hf_rows", "hf_name_to_gguf", "gguf_name_to_hf"]
