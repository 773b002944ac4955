"""GGUF LoRA adapters for llama.cpp `--lora` (as convert_lora_to_gguf.py writes them), both ways.

general.type = adapter, adapter.type = lora, adapter.lora.alpha; `blk.{i}.attn_q.weight.lora_a`
numpy (r, in) (GGUF dims [in, r]), `.lora_b` numpy (out, r) (dims [r, out]), rows in the base GGUF's
order (llama.cpp applies adapters to the file's weights: Llama's Q/K rows permuted, Qwen's not);
general.architecture is the base's (llama.cpp refuses an adapter of another). llama.cpp scales by
alpha / r (alpha 0: scale 1), so the alpha written is s * r (rsLoRA: alpha * sqrt(r)); the
trainer's own alpha and rsLoRA flag are kept under vkdsl.lora.*. The manifest, when given, is
embedded as vkdsl.manifest."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from vkdsl.fileio import atomic_path
from vkdsl.ops.lora import lora_scale

from ..config import MODULES
from ..errors import ModelFileError
from ..gguf_loader import open_gguf, read_key
from . import common


def save(model, path, *, r: int | None = None, alpha: float | None = None,
         rslora: bool = False, base_name: str = "", manifest: dict | None = None,
         dtype: str = "f32") -> Path:
    """Write a llama.cpp LoRA adapter GGUF (atomically). The manifest, when given, is embedded
    as the string key vkdsl.manifest (a GGUF adapter is a single file)."""
    from gguf import GGUFType, GGUFWriter, Keys
    path = Path(path)
    arrays = common.model_adapter_arrays(model)
    r, alpha, rslora = common.infer_hparams(arrays, r, alpha, rslora)
    scale = lora_scale(alpha, r, rslora)
    with atomic_path(path) as tmp:
        w = GGUFWriter(tmp, model.cfg.gguf_arch)
        w.add_type(GGUFType.ADAPTER)
        w.add_string(Keys.Adapter.TYPE, "lora")
        w.add_float32(Keys.Adapter.LORA_ALPHA, float(scale * r))   # llama.cpp: s = alpha / r
        if base_name or model.source:
            w.add_string("general.base_model.0.name", base_name or Path(model.source).name)
        w.add_float32("vkdsl.lora.alpha", alpha)
        w.add_bool("vkdsl.lora.rslora", rslora)
        w.add_uint32("vkdsl.lora.r", r)
        ft = np.float16 if dtype == "f16" else np.float32
        tensors = []
        for name, (A, B, s) in arrays.items():
            Bs = B * np.float32(s / scale) if s != scale else B
            Bt = common.file_rows(model.cfg, name, Bs.T, "gguf", to_file=True)
            A = common.file_cols(model.cfg, name, A, "gguf", to_file=True)
            tensors += [(f"{name}.weight.lora_a", np.ascontiguousarray(A.T, ft)),       # (r, in)
                        (f"{name}.weight.lora_b", np.ascontiguousarray(Bt, ft))]        # (out, r)
        if manifest is not None:
            manifest = {**manifest, "weights_sha256": common.tensors_sha256(tensors)}
            w.add_string("vkdsl.manifest", json.dumps(manifest, sort_keys=True, default=str))
        for name, a in tensors:
            w.add_tensor(name, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path


def read(path: Path, cfg) -> "common.AdapterWeights":
    """The adapter of a GGUF LoRA file; anything damaged is a ModelFileError naming the file."""
    try:
        return _read(path, cfg)
    except ModelFileError:
        raise
    # the gguf reader on damaged bytes
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
        raise ModelFileError(f"{path}: damaged GGUF adapter ({type(e).__name__}: {e})") from None


def _read(path: Path, cfg) -> "common.AdapterWeights":
    from gguf.quants import dequantize
    reader = open_gguf(path)

    def key(name, default=None):
        return read_key(reader, name, default, path=path)

    if key("general.type") != "adapter" or key("adapter.type") != "lora":
        raise ModelFileError(f"{path}: not a GGUF LoRA adapter (general.type = "
                             f"{key('general.type')!r}, adapter.type = {key('adapter.type')!r})")
    if key("general.architecture") != cfg.gguf_arch:
        raise ModelFileError(f"{path}: general.architecture is {key('general.architecture')!r}, "
                             f"but the model's is {cfg.gguf_arch!r}")
    alpha_cpp = key("adapter.lora.alpha")
    if alpha_cpp is None:
        raise ModelFileError(f"{path}: missing key 'adapter.lora.alpha'")
    if (not isinstance(alpha_cpp, (int, float)) or isinstance(alpha_cpp, bool)
            or not 0 <= alpha_cpp < math.inf):
        raise ModelFileError(f"{path}: adapter.lora.alpha = {alpha_cpp!r}, expected a finite "
                             f"number >= 0")
    parts: dict[str, dict[str, np.ndarray]] = {}
    raw = []
    for t in reader.tensors:
        raw.append((t.name, np.asarray(t.data)))
        m = re.fullmatch(r"(blk\.(\d+)\.(\w+))\.weight\.lora_([ab])", t.name)
        if m is None or m.group(3) not in MODULES:
            raise ModelFileError(f"{path}: unexpected tensor {t.name!r}")
        if int(m.group(2)) >= cfg.n_layers:
            raise ModelFileError(f"{path}: {t.name}: layer {m.group(2)} but the model has "
                                 f"{cfg.n_layers} layers")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = np.asarray(dequantize(np.asarray(t.data), t.tensor_type), np.float32).reshape(shape)
        parts.setdefault(m.group(1), {})[m.group(4)] = (t.name, arr)
    if not parts:
        raise ModelFileError(f"{path}: no LoRA tensors")
    modules, ranks = {}, set()
    for module, ab in sorted(parts.items(), key=lambda kv: common.module_order(kv[0])):
        for x in "ab":
            if x not in ab:
                raise ModelFileError(f"{path}: missing tensor {module}.weight.lora_{x}")
        (ka, a), (kb, b) = ab["a"], ab["b"]
        r = a.shape[0]
        d_in, d_out = common.module_shape(cfg, module)
        if a.shape != (r, d_in):
            raise ModelFileError(f"{path}: {ka}: shape {a.shape}, expected (r, {d_in})")
        if b.shape != (d_out, r):
            raise ModelFileError(f"{path}: {kb}: shape {b.shape}, expected ({d_out}, {r})")
        ranks.add(r)
        b = common.file_rows(cfg, module, b, "gguf", to_file=False)
        a = common.file_cols(cfg, module, a.T, "gguf", to_file=False).T
        # llama.cpp's rule: scale = alpha / r, and alpha 0 means no scaling (scale 1)
        modules[module] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T),
                           float(alpha_cpp) / r if alpha_cpp else 1.0)
    r = ranks.pop() if len(ranks) == 1 else 0
    rslora = bool(key("vkdsl.lora.rslora", False))
    alpha = float(key("vkdsl.lora.alpha", alpha_cpp or r))
    manifest = None
    if key("vkdsl.manifest") is not None:
        try:
            manifest = json.loads(key("vkdsl.manifest"))
        except json.JSONDecodeError as e:
            raise ModelFileError(f"{path}: vkdsl.manifest is not valid JSON: {e}") from e
    return common.AdapterWeights(modules, "gguf", path, r, alpha, rslora,
                                 weights_sha256=common.tensors_sha256(raw), manifest=manifest,
                          manifest_path=path if manifest is not None else None)


