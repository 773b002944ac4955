"""Hugging Face PEFT adapters (`adapter_model.safetensors` + `adapter_config.json`), both ways.

lora_A (r, in) = A^T, lora_B (out, r) = B^T with q_proj/k_proj rows put back in HF order
(n_heads for q, n_kv_heads for k); PEFT computes y = x W^T + s (x A^T) B^T."""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np

from vkdsl.fileio import atomic_write
from vkdsl.ops.lora import lora_scale

from ..errors import ModelFileError
from ..identity import file_sha256
from ..manifest import write_manifest
from ..safetensors_loader import as_f32, read_safetensors, safetensors_bytes
from . import common

# GGUF module -> (HF submodule path, PEFT target_modules short name)
HF_MODULE = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             # Qwen3.5's Gated DeltaNet
             "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
             "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
             "ssm_out": "linear_attn.out_proj"}
HF_SHORT = {k: v.split(".")[1] for k, v in HF_MODULE.items()}
_FROM_HF = {v: k for k, v in HF_MODULE.items()}

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
_PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\."
                       r"((?:self_attn|mlp|linear_attn)\.\w+)"
                       r"\.lora_([AB])(?:\.default)?\.weight")


def _peft_tensors(arrays, cfg, scale: float) -> dict[str, np.ndarray]:
    """PEFT keys -> arrays; a module whose own scale differs from `scale` has it folded into B."""
    out = {}
    for name, (A, B, s) in arrays.items():
        i, m = int(name.split(".")[1]), name.split(".")[2]
        Bt = B.T * np.float32(s / scale) if s != scale else B.T      # (out, r)
        Bt = common.file_rows(cfg, m, Bt, "hf", to_file=True)
        key = f"base_model.model.model.layers.{i}.{HF_MODULE[m]}"
        A = common.file_cols(cfg, m, A, "hf", to_file=True)
        out[key + ".lora_A.weight"] = np.ascontiguousarray(A.T, np.float32)     # (r, in)
        out[key + ".lora_B.weight"] = np.ascontiguousarray(Bt, np.float32)      # (out, r)
    return out


def save(model, folder, *, r: int | None = None, alpha: float | None = None,
         rslora: bool = False, target_modules=None, base_name: str = "",
         manifest: dict | None = None) -> Path:
    """Write adapter_model.safetensors + adapter_config.json (+ vkdsl_manifest.json when
    `manifest` is given) into `folder`, each file atomically. Returns the folder."""
    folder = Path(folder)
    arrays = common.model_adapter_arrays(model)
    r, alpha, rslora = common.infer_hparams(arrays, r, alpha, rslora)
    scale = lora_scale(alpha, r, rslora)
    present = sorted({HF_SHORT[n.split(".")[2]] for n in arrays})
    if target_modules is None:
        target_modules = present
    else:
        target_modules = sorted({HF_SHORT.get(t, t) for t in target_modules})
        missing = set(present) - set(target_modules)
        if missing:
            raise ValueError(f"target_modules {target_modules} leave out adapted modules "
                             f"{sorted(missing)}")
    tensors = _peft_tensors(arrays, model.cfg, scale)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "use_rslora": rslora, "target_modules": target_modules,
        "base_model_name_or_path": base_name or (Path(model.source).name if model.source else ""),
        "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False,
        "revision": None,
    }
    folder.mkdir(parents=True, exist_ok=True)
    weights = safetensors_bytes(tensors, {"format": "pt"})
    atomic_write(folder / WEIGHTS, weights)
    atomic_write(folder / CONFIG, (json.dumps(config, indent=2) + "\n").encode())
    if manifest is not None:
        write_manifest(folder, {**manifest, "weights_sha256": hashlib.sha256(weights).hexdigest()})
    return folder


def _check_targets(targets, parts, cfg_path):
    """PEFT applies an adapter only to the modules target_modules matches (a list of module names,
    a regex over the full name, or "all-linear"): a tensor it would not match is refused, since
    vkdsl would apply more of the adapter than PEFT does."""
    if targets is None or targets == "all-linear":
        return
    if not (isinstance(targets, str) or isinstance(targets, list)
            and all(isinstance(t, str) for t in targets)):
        raise ModelFileError(f"{cfg_path}: target_modules = {json.dumps(targets)[:80]}, expected a "
                             f"list of module names or a regex")
    for module in parts:
        i, m = int(module.split(".")[1]), module.split(".")[2]
        full = f"model.layers.{i}.{HF_MODULE[m]}"
        try:
            hit = re.fullmatch(targets, full) if isinstance(targets, str) else \
                any(full == t or full.endswith("." + t) for t in targets)
        except re.error as e:
            raise ModelFileError(f"{cfg_path}: target_modules {targets!r} is not a valid "
                                 f"regex ({e})") from None
        if not hit:
            raise ModelFileError(f"{cfg_path}: target_modules {json.dumps(targets)} does not name "
                                 f"{HF_SHORT[m]} of layer {i}, which the weights adapt (PEFT would "
                                 f"leave it out)")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read(folder: Path, cfg) -> "common.AdapterWeights":
    cfg_path, w_path = folder / CONFIG, folder / WEIGHTS
    if not cfg_path.is_file():
        raise ModelFileError(f"{folder}: no {CONFIG} (not a PEFT adapter folder)")
    if not w_path.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise ModelFileError(f"{folder}: adapter_model.bin (pickle) is not read; save as "
                                 f"safetensors")
        raise ModelFileError(f"{folder}: no {WEIGHTS}")
    try:
        pc = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{cfg_path}: invalid JSON: {e}") from e
    if not isinstance(pc, dict):
        raise ModelFileError(f"{cfg_path}: expected a JSON object, got {type(pc).__name__}")
    if str(pc.get("peft_type", "")).upper() != "LORA":
        raise ModelFileError(f"{cfg_path}: peft_type is {pc.get('peft_type')!r}, expected 'LORA'")
    for k in ("r", "lora_alpha"):
        if k not in pc:
            raise ModelFileError(f"{cfg_path}: missing key {k!r}")
    for k in ("use_dora", "fan_in_fan_out"):
        if pc.get(k):
            raise ModelFileError(f"{cfg_path}: {k} = true is unsupported")
    for k in ("rank_pattern", "alpha_pattern"):
        if pc.get(k):
            raise ModelFileError(f"{cfg_path}: per-module {k} is unsupported")
    if pc.get("bias", "none") != "none":
        raise ModelFileError(f"{cfg_path}: bias = {pc['bias']!r} is unsupported (only 'none')")
    r, alpha, rslora = pc["r"], pc["lora_alpha"], pc.get("use_rslora", False)
    for k, v, ok, want in (("r", r, _number(r) and r >= 1 and float(r).is_integer(),
                            "an integer >= 1"),
                           ("lora_alpha", alpha, _number(alpha) and 0 < alpha < math.inf,
                            "a finite number > 0"),
                           ("use_rslora", rslora, isinstance(rslora, bool), "true or false")):
        if not ok:
            raise ModelFileError(f"{cfg_path}: {k} = {json.dumps(v)}, expected {want}")
    r, alpha = int(r), float(alpha)
    scale = lora_scale(alpha, r, rslora)
    raw = read_safetensors(w_path)
    parts: dict[str, dict[str, np.ndarray]] = {}
    for key, (dtype, shape, data) in raw.items():
        m = _PEFT_KEY.fullmatch(key)
        if m is None or m.group(2) not in _FROM_HF:
            raise ModelFileError(f"{w_path}: unexpected key {key!r} (not a LoRA A/B weight of "
                                 f"q/k/v/o/gate/up/down_proj or linear_attn's in_proj_*/out_proj)")
        i = int(m.group(1))
        if i >= cfg.n_layers:
            raise ModelFileError(f"{w_path}: {key}: layer {i} but the model has "
                                 f"{cfg.n_layers} layers")
        if len(shape) != 2:
            raise ModelFileError(f"{w_path}: {key}: shape {shape} is not a matrix")
        module = f"blk.{i}.{_FROM_HF[m.group(2)]}"
        parts.setdefault(module, {})[m.group(3)] = (key, as_f32(dtype, data, shape))
    if not parts:
        raise ModelFileError(f"{w_path}: no LoRA weights")
    _check_targets(pc.get("target_modules"), parts, cfg_path)
    modules = {}
    for module, ab in sorted(parts.items(), key=lambda kv: common.module_order(kv[0])):
        for x in "AB":
            if x not in ab:
                other = ab["B" if x == "A" else "A"][0]
                raise ModelFileError(f"{w_path}: missing key {other[:-len('lora_B.weight')]}"
                                     f"lora_{x}.weight (its lora_{'B' if x == 'A' else 'A'} "
                                     f"is present)")
        (ka, a), (kb, b) = ab["A"], ab["B"]
        if a.shape[0] != r:
            raise ModelFileError(f"{w_path}: {ka}: shape {a.shape}, expected (r={r}, in) "
                                 f"per {CONFIG}")
        A, Bt = a.T, b                                   # A (in, r); Bt (out, r) HF rows
        d_in, d_out = common.module_shape(cfg, module)
        if A.shape[0] != d_in:
            raise ModelFileError(f"{w_path}: {ka}: shape {a.shape}, expected ({r}, {d_in})")
        if Bt.shape != (d_out, r):
            raise ModelFileError(f"{w_path}: {kb}: shape {b.shape}, expected ({d_out}, {r})")
        Bt = common.file_rows(cfg, module, Bt, "hf", to_file=False)
        A = common.file_cols(cfg, module, A, "hf", to_file=False)
        modules[module] = (np.ascontiguousarray(A, np.float32),
                           np.ascontiguousarray(Bt.T, np.float32), scale)
    return common.AdapterWeights(modules, "peft", folder, r, alpha, rslora, config=pc,
                                 weights_sha256=file_sha256(w_path))


