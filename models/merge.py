"""Merge a LoRA adapter into its base: W' = W + s (A B)^T in the (out, in) layout.

GGUF bases give a GGUF (all metadata and untouched tensors copied byte for byte; merged
tensors as F32, F16, or 'keep': requantized to their original block type, with the part of
the update lost to requantization measured). Hugging Face bases give a safetensors folder.
`compare_logits` runs the merged model and base+adapter on the device and reports the gap.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from vkdsl.fileio import atomic_path, atomic_write

from .adapters import adapter_mismatches, read_adapter
from .adapters.common import file_cols, file_rows
from .errors import ModelFileError
from .manifest import check_manifest

OUT_TYPES = ("f32", "f16", "keep")


def _delta(A: np.ndarray, B: np.ndarray, s: float) -> np.ndarray:
    """s (A B)^T, (out, in), float64."""
    return s * (A.astype(np.float64) @ B.astype(np.float64)).T


def merge(model_path, adapter_path, out_path, out_type: str = "f32", force: bool = False,
          tokenizer=None) -> dict:
    """Write base+adapter merged to out_path; return a report dict."""
    from . import load_model_files
    if out_type not in OUT_TYPES:
        raise ValueError(f"out_type must be one of {OUT_TYPES}, got {out_type!r}")
    model_path, out_path = Path(model_path), Path(out_path)
    ck, tok = load_model_files(model_path)
    if out_path.exists() and out_path.resolve() == model_path.resolve():
        raise ModelFileError(f"{out_path}: the base itself; the merged model goes elsewhere")
    if ck.format == "gguf" and out_path.is_dir():
        raise ModelFileError(f"{out_path}: a folder; a GGUF base merges into one .gguf file")
    aw = read_adapter(adapter_path, ck.config)
    forced = []
    if aw.manifest is not None:
        forced = check_manifest(aw.manifest, model_path, tokenizer or tok, force=force,
                                source=aw.manifest_path or aw.source, more=adapter_mismatches(aw))
    report = {"base": str(model_path), "adapter": str(aw.source), "adapter_format": aw.format,
              "out": str(out_path), "out_type": out_type, "merged_modules": len(aw.modules),
              "r": aw.r, "alpha": aw.alpha, "rslora": aw.rslora, "manifest_mismatches": forced,
              "tensors": {}}
    if ck.format == "gguf":
        _merge_gguf(model_path, ck.config, aw, out_path, out_type, report)
    else:
        _merge_hf(model_path, ck, aw, out_path, out_type, report)
    errs = [t["requant_rel_err"] for t in report["tensors"].values() if "requant_rel_err" in t]
    report["max_requant_rel_err"] = max(errs) if errs else 0.0
    report["mean_requant_rel_err"] = float(np.mean(errs)) if errs else 0.0
    if report["max_requant_rel_err"] > 0.5:
        report["warning"] = (f"storing the merged weights as {out_type!r} loses up to "
                             f"{100 * report['max_requant_rel_err']:.0f}% of the adapter's update "
                             f"(relative Frobenius error); merge to f16 or f32, or apply the "
                             f"adapter separately")
    return report


def _merge_gguf(model_path: Path, cfg, aw, out_path: Path, out_type: str, report: dict) -> None:
    from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize
    reader = GGUFReader(model_path, "r")
    arch = reader.fields["general.architecture"].contents()
    with atomic_path(out_path) as tmp:
        w = GGUFWriter(tmp, arch)
        for name, f in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            if name == "general.file_type" and out_type != "keep":
                continue          # the merged file's dominant type changed
            vtype = GGUFValueType(int(f.types[0]))
            sub = (GGUFValueType(int(f.types[-1])) if vtype == GGUFValueType.ARRAY
                   and len(f.types) > 1 else None)
            w.add_key_value(name, f.contents(), vtype, sub_type=sub)
        w.add_string("vkdsl.merged_adapter", str(aw.source))
        for t in reader.tensors:
            mod = t.name[:-len(".weight")] if t.name.endswith(".weight") else None
            if mod not in aw.modules:
                w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
                continue
            A, B, s = aw.modules[mod]
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            W = np.asarray(dequantize(np.asarray(t.data), t.tensor_type), np.float64).reshape(shape)
            d = file_rows(cfg, mod, _delta(A, B, s), "gguf", to_file=True)   # the file's row order
            d = file_cols(cfg, mod, d.T, "gguf", to_file=True).T
            merged = (W + d).astype(np.float32)
            info = {"base_type": t.tensor_type.name, "update_norm": float(np.linalg.norm(d))}
            if out_type == "f32" or (out_type == "keep" and t.tensor_type == Q.F32):
                w.add_tensor(t.name, merged)
                info["type"] = "F32"
                stored = merged
            elif out_type == "f16" or (out_type == "keep" and t.tensor_type == Q.F16):
                stored16 = merged.astype(np.float16)
                w.add_tensor(t.name, stored16)
                info["type"] = "F16"
                stored = stored16.astype(np.float32)
            else:
                qt = t.tensor_type
                packed = quantize(merged, qt)
                w.add_tensor(t.name, packed, raw_dtype=qt)
                info["type"] = qt.name
                stored = np.asarray(dequantize(packed, qt), np.float32).reshape(shape)
            lost = (stored.astype(np.float64) - W) - d
            info["requant_rel_err"] = float(np.linalg.norm(lost) / max(np.linalg.norm(d), 1e-30))
            info["update_rel_to_weight"] = float(np.linalg.norm(d) / max(np.linalg.norm(W), 1e-30))
            report["tensors"][t.name] = info
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def _merge_hf(model_path: Path, ck, aw, out_path: Path, out_type: str, report: dict) -> None:
    from . import qwen35_files
    from .safetensors_loader import (as_f32, hf_name_to_gguf, read_safetensors, safetensors_bytes,
                                     weight_files)
    if out_path.exists() and not out_path.is_dir():
        raise ModelFileError(f"{out_path}: exists and is not a folder (a HF base merges into "
                             f"a folder)")
    out_path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in weight_files(model_path):
        for hf_name, (dtype, shape, raw) in read_safetensors(file).items():
            arr = as_f32(dtype, raw, shape)
            g = qwen35_files.hf_name_to_gguf(hf_name, ck.config) if ck.config.arch == "qwen35" \
                else hf_name_to_gguf(hf_name)
            mod = g[:-len(".weight")] if g and g.endswith(".weight") else None
            if mod in aw.modules:
                A, B, s = aw.modules[mod]
                d = file_rows(ck.config, mod, _delta(A, B, s), "hf", to_file=True)
                d = file_cols(ck.config, mod, d.T, "hf", to_file=True).T
                merged = (arr.astype(np.float64) + d).astype(np.float32)
                t = {"f32": "F32", "f16": "F16"}.get(out_type, dtype if dtype != "BF16" else "F32")
                stored = merged.astype(np.float16) if t == "F16" else merged
                tensors[hf_name] = stored
                lost = (stored.astype(np.float64) - arr) - d
                report["tensors"][hf_name] = {
                    "base_type": dtype, "type": t, "update_norm": float(np.linalg.norm(d)),
                    "requant_rel_err": float(np.linalg.norm(lost) / max(np.linalg.norm(d), 1e-30))}
            else:
                tensors[hf_name] = arr.astype(np.float16) if dtype == "F16" else arr
    atomic_write(out_path / "model.safetensors", safetensors_bytes(tensors, {"format": "pt"}))
    for f in model_path.iterdir():
        if (f.is_file()
            and not (f.name.endswith(".safetensors") or f.name == "model.safetensors.index.json")):
            shutil.copyfile(f, out_path / f.name)


def compare_logits(base_path, adapter_path, merged_path, ids, quant: str = "keep",
                   force: bool = False) -> dict:
    """Device logits of base+adapter (separate path) vs the merged model on token ids
    (list or (B, T) array): max |diff|, its size relative to max |logit|, argmax agreement."""
    from . import load_model_files
    from .adapters import load_adapter
    from .build import build_model
    from .llama import LogitsFn
    ids = np.atleast_2d(np.asarray(ids, np.int32))
    ck, tok = load_model_files(base_path)
    sep = build_model(ck, quant=quant)
    load_adapter(sep, adapter_path, tok, force=force, model_path=base_path)
    a = LogitsFn(sep)(ids)
    mck, _ = load_model_files(merged_path)
    mer = build_model(mck, quant=quant)
    b = LogitsFn(mer, adapters_on=False)(ids)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = float(np.abs(a - b).max())
    scale = float(np.abs(a).max())
    return {"max_abs_diff": diff, "max_abs_logit": scale, "rel_diff": diff / max(scale, 1e-30),
            "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
            "positions": int(a.shape[0] * a.shape[1])}
