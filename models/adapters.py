"""LoRA adapters in formats other tools load, and back.

vkdsl keeps, per module `blk.{i}.{attn_q|...}`, A (in, r), B (r, out) with out in the GGUF
Q/K row order and y = x W^T + s (x A) B.

- Hugging Face PEFT (`adapter_model.safetensors` + `adapter_config.json`): lora_A (r, in) =
  A^T, lora_B (out, r) = B^T with q_proj/k_proj rows put back in HF order (n_heads for q,
  n_kv_heads for k); PEFT computes y = x W^T + s (x A^T) B^T.
- GGUF LoRA for llama.cpp `--lora` (as convert_lora_to_gguf.py writes it): general.type =
  adapter, adapter.type = lora, adapter.lora.alpha; `blk.{i}.attn_q.weight.lora_a` numpy
  (r, in) (GGUF dims [in, r]), `.lora_b` numpy (out, r) (dims [r, out]), rows in GGUF order
  (llama.cpp applies adapters to its permuted weights). llama.cpp scales by alpha / r, so
  the alpha written is s * r (for rsLoRA that is alpha * sqrt(r)); the trainer's own alpha
  and rsLoRA flag are kept under vkdsl.lora.*.
"""
from __future__ import annotations

from vkdsl.fileio import commit_temp

import json
import math
import os
import re
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ModelFileError
from .manifest import MANIFEST_NAME, atomic_write_bytes, check_manifest, read_manifest
from .safetensors_loader import gguf_to_hf_rows, hf_to_gguf_rows, read_safetensors

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# GGUF module -> (HF submodule path, PEFT target_modules short name)
HF_MODULE = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
HF_SHORT = {k: v.split(".")[1] for k, v in HF_MODULE.items()}
_FROM_HF = {v: k for k, v in HF_MODULE.items()}

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
_PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.((?:self_attn|mlp)\.\w+)"
                       r"\.lora_([AB])(?:\.default)?\.weight")


def scale_of(alpha: float, r: int, rslora: bool = False) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


def module_shape(cfg, module: str) -> tuple[int, int]:
    """(in, out) of a linear module (`attn_q` or `blk.3.attn_q`)."""
    m = module.split(".")[-1]
    return {"attn_q": (cfg.dim, cfg.q_dim), "attn_k": (cfg.dim, cfg.kv_dim),
            "attn_v": (cfg.dim, cfg.kv_dim), "attn_output": (cfg.q_dim, cfg.dim),
            "ffn_gate": (cfg.dim, cfg.ffn_dim), "ffn_up": (cfg.dim, cfg.ffn_dim),
            "ffn_down": (cfg.ffn_dim, cfg.dim)}[m]


def _heads(cfg, module: str) -> int | None:
    m = module.split(".")[-1]
    return cfg.n_heads if m == "attn_q" else cfg.n_kv_heads if m == "attn_k" else None


@dataclass
class AdapterWeights:
    """Host copy of an adapter in vkdsl's convention: {module: (A (in, r), B (r, out) GGUF
    rows, scale)}."""
    modules: dict[str, tuple[np.ndarray, np.ndarray, float]]
    format: str                       # "peft" or "gguf"
    source: Path
    r: int
    alpha: float
    rslora: bool
    manifest: dict | None = None
    manifest_path: Path | None = None
    config: dict = field(default_factory=dict)

    @property
    def target_modules(self) -> list[str]:
        return sorted({n.split(".")[-1] for n in self.modules})


# ----------------------------------------------------------------------------- safetensors io

_ST_DTYPE = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16"}


def safetensors_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors format: u64 header length, JSON header (8-byte aligned), raw data."""
    header, chunks, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _ST_DTYPE:
            a = a.astype("<f4")
        b = a.tobytes()
        header[name] = {"dtype": _ST_DTYPE[a.dtype], "shape": list(a.shape),
                        "data_offsets": [off, off + len(b)]}
        chunks.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(chunks)


def _as_f32(dtype: str, raw: np.ndarray, shape) -> np.ndarray:
    if dtype == "F32":
        return raw.view("<f4").reshape(shape).astype(np.float32)
    if dtype == "F16":
        return raw.view("<f2").reshape(shape).astype(np.float32)
    if dtype == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    raise ModelFileError(f"unsupported dtype {dtype}")


# ----------------------------------------------------------------------------- from the model

def model_adapter_arrays(model) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """{module: (A (in, r), B (r, out), scale)} read back from the device."""
    if not model.lora:
        raise ValueError("the model has no LoRA adapters to save")
    out = {}
    for name in sorted(model.lora, key=_module_order):
        lo = model.lora[name]
        A = np.asarray(lo.A.numpy(), np.float32)
        B = np.asarray(lo.B.numpy(), np.float32)
        out[name] = (A, B, float(lo.scale))
    return out


def _module_order(name: str):
    parts = name.split(".")
    return (int(parts[1]), LINEARS.index(parts[2]) if parts[2] in LINEARS else 99, name)


def _infer_hparams(arrays, r, alpha, rslora):
    ranks = {A.shape[1] for A, _, _ in arrays.values()}
    if len(ranks) != 1:
        raise ValueError(f"adapters have different ranks {sorted(ranks)}; one rank is required")
    rank = ranks.pop()
    if r is not None and int(r) != rank:
        raise ValueError(f"r={r} but the adapters have rank {rank}")
    scales = {s for _, _, s in arrays.values()}
    if alpha is None:
        if len(scales) != 1:
            raise ValueError("adapters have different scales; pass alpha explicitly")
        s = next(iter(scales))
        alpha = s * math.sqrt(rank) if rslora else s * rank
    return rank, float(alpha), bool(rslora)


def _peft_tensors(arrays, cfg, scale: float) -> dict[str, np.ndarray]:
    """PEFT keys -> arrays; a module whose own scale differs from `scale` has it folded into B."""
    out = {}
    for name, (A, B, s) in arrays.items():
        i, m = int(name.split(".")[1]), name.split(".")[2]
        Bt = B.T * np.float32(s / scale) if s != scale else B.T      # (out, r)
        h = _heads(cfg, m)
        if h is not None:
            Bt = gguf_to_hf_rows(Bt, h, axis=0)
        key = f"base_model.model.model.layers.{i}.{HF_MODULE[m]}"
        out[key + ".lora_A.weight"] = np.ascontiguousarray(A.T, np.float32)     # (r, in)
        out[key + ".lora_B.weight"] = np.ascontiguousarray(Bt, np.float32)      # (out, r)
    return out


def save_peft(model, folder, *, r: int | None = None, alpha: float | None = None,
              rslora: bool = False, target_modules=None, base_name: str = "",
              manifest: dict | None = None) -> Path:
    """Write adapter_model.safetensors + adapter_config.json (+ vkdsl_manifest.json when
    `manifest` is given) into `folder`, each file atomically. Returns the folder."""
    folder = Path(folder)
    arrays = model_adapter_arrays(model)
    r, alpha, rslora = _infer_hparams(arrays, r, alpha, rslora)
    scale = scale_of(alpha, r, rslora)
    present = sorted({HF_SHORT[n.split(".")[2]] for n in arrays})
    if target_modules is None:
        target_modules = present
    else:
        target_modules = sorted({HF_SHORT.get(t, t) for t in target_modules})
        missing = set(present) - set(target_modules)
        if missing:
            raise ValueError(f"target_modules {target_modules} leave out adapted modules {sorted(missing)}")
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
    atomic_write_bytes(folder / PEFT_WEIGHTS, safetensors_bytes(tensors, {"format": "pt"}))
    atomic_write_bytes(folder / PEFT_CONFIG, (json.dumps(config, indent=2) + "\n").encode())
    if manifest is not None:
        from .manifest import write_manifest
        write_manifest(folder, manifest)
    return folder


def save_gguf_adapter(model, path, *, r: int | None = None, alpha: float | None = None,
                      rslora: bool = False, base_name: str = "", manifest: dict | None = None,
                      dtype: str = "f32") -> Path:
    """Write a llama.cpp LoRA adapter GGUF (atomically). The manifest, when given, is embedded
    as the string key vkdsl.manifest (a GGUF adapter is a single file)."""
    from gguf import GGUFType, GGUFWriter, Keys
    path = Path(path)
    arrays = model_adapter_arrays(model)
    r, alpha, rslora = _infer_hparams(arrays, r, alpha, rslora)
    scale = scale_of(alpha, r, rslora)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        w = GGUFWriter(tmp, "llama")
        w.add_type(GGUFType.ADAPTER)
        w.add_string(Keys.Adapter.TYPE, "lora")
        w.add_float32(Keys.Adapter.LORA_ALPHA, float(scale * r))   # llama.cpp: s = alpha / r
        if base_name or model.source:
            w.add_string("general.base_model.0.name", base_name or Path(model.source).name)
        w.add_float32("vkdsl.lora.alpha", alpha)
        w.add_bool("vkdsl.lora.rslora", rslora)
        w.add_uint32("vkdsl.lora.r", r)
        if manifest is not None:
            w.add_string("vkdsl.manifest", json.dumps(manifest, sort_keys=True, default=str))
        ft = np.float16 if dtype == "f16" else np.float32
        for name, (A, B, s) in arrays.items():
            Bs = B * np.float32(s / scale) if s != scale else B
            w.add_tensor(f"{name}.weight.lora_a", np.ascontiguousarray(A.T, ft))   # (r, in)
            w.add_tensor(f"{name}.weight.lora_b", np.ascontiguousarray(Bs.T, ft))  # (out, r)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        commit_temp(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


# ----------------------------------------------------------------------------- reading

def _check_shapes(source, key, cfg, module, A, B):
    d_in, d_out = module_shape(cfg, module)
    r = A.shape[1]
    if A.shape[0] != d_in:
        raise ModelFileError(f"{source}: {key}: lora A has input width {A.shape[0]}, "
                             f"module {module} expects {d_in}")
    if B.shape != (r, d_out):
        raise ModelFileError(f"{source}: {key}: lora B is {B.shape[::-1]} (out, r) but module "
                             f"{module} with rank {r} needs ({d_out}, {r})")


def _read_peft(folder: Path, cfg) -> AdapterWeights:
    cfg_path, w_path = folder / PEFT_CONFIG, folder / PEFT_WEIGHTS
    if not cfg_path.is_file():
        raise ModelFileError(f"{folder}: no {PEFT_CONFIG} (not a PEFT adapter folder)")
    if not w_path.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise ModelFileError(f"{folder}: adapter_model.bin (pickle) is not read; save as safetensors")
        raise ModelFileError(f"{folder}: no {PEFT_WEIGHTS}")
    try:
        pc = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{cfg_path}: invalid JSON: {e}") from e
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
    r, alpha, rslora = int(pc["r"]), float(pc["lora_alpha"]), bool(pc.get("use_rslora", False))
    scale = scale_of(alpha, r, rslora)
    raw = read_safetensors(w_path)
    parts: dict[str, dict[str, np.ndarray]] = {}
    for key, (dtype, shape, data) in raw.items():
        m = _PEFT_KEY.fullmatch(key)
        if m is None or m.group(2) not in _FROM_HF:
            raise ModelFileError(f"{w_path}: unexpected key {key!r} (not a LoRA A/B weight of "
                                 f"q/k/v/o/gate/up/down_proj)")
        i = int(m.group(1))
        if i >= cfg.n_layers:
            raise ModelFileError(f"{w_path}: {key}: layer {i} but the model has {cfg.n_layers} layers")
        if len(shape) != 2:
            raise ModelFileError(f"{w_path}: {key}: shape {shape} is not a matrix")
        module = f"blk.{i}.{_FROM_HF[m.group(2)]}"
        parts.setdefault(module, {})[m.group(3)] = (key, _as_f32(dtype, data, shape))
    if not parts:
        raise ModelFileError(f"{w_path}: no LoRA weights")
    modules = {}
    for module, ab in sorted(parts.items(), key=lambda kv: _module_order(kv[0])):
        for x in "AB":
            if x not in ab:
                other = ab["B" if x == "A" else "A"][0]
                raise ModelFileError(f"{w_path}: missing key {other[:-len('lora_B.weight')]}"
                                     f"lora_{x}.weight (its lora_{'B' if x == 'A' else 'A'} is present)")
        (ka, a), (kb, b) = ab["A"], ab["B"]
        if a.shape[0] != r:
            raise ModelFileError(f"{w_path}: {ka}: shape {a.shape}, expected (r={r}, in) per {PEFT_CONFIG}")
        A, Bt = a.T, b                                   # A (in, r); Bt (out, r) HF rows
        d_in, d_out = module_shape(cfg, module)
        if A.shape[0] != d_in:
            raise ModelFileError(f"{w_path}: {ka}: shape {a.shape}, expected ({r}, {d_in})")
        if Bt.shape != (d_out, r):
            raise ModelFileError(f"{w_path}: {kb}: shape {b.shape}, expected ({d_out}, {r})")
        h = _heads(cfg, module)
        if h is not None:
            Bt = hf_to_gguf_rows(Bt, h, axis=0)
        modules[module] = (np.ascontiguousarray(A, np.float32),
                           np.ascontiguousarray(Bt.T, np.float32), scale)
    return AdapterWeights(modules, "peft", folder, r, alpha, rslora, config=pc)


def _read_gguf_adapter(path: Path, cfg) -> AdapterWeights:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:
        raise ModelFileError(f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from e

    def key(name, default=None):
        f = reader.fields.get(name)
        return default if f is None else f.contents()

    if key("general.type") != "adapter" or key("adapter.type") != "lora":
        raise ModelFileError(f"{path}: not a GGUF LoRA adapter (general.type = "
                             f"{key('general.type')!r}, adapter.type = {key('adapter.type')!r})")
    if key("general.architecture") != "llama":
        raise ModelFileError(f"{path}: general.architecture is {key('general.architecture')!r}, expected 'llama'")
    alpha_cpp = key("adapter.lora.alpha")
    if alpha_cpp is None:
        raise ModelFileError(f"{path}: missing key 'adapter.lora.alpha'")
    parts: dict[str, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        m = re.fullmatch(r"(blk\.(\d+)\.(\w+))\.weight\.lora_([ab])", t.name)
        if m is None or m.group(3) not in LINEARS:
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
    for module, ab in sorted(parts.items(), key=lambda kv: _module_order(kv[0])):
        for x in "ab":
            if x not in ab:
                raise ModelFileError(f"{path}: missing tensor {module}.weight.lora_{x}")
        (ka, a), (kb, b) = ab["a"], ab["b"]
        r = a.shape[0]
        d_in, d_out = module_shape(cfg, module)
        if a.shape != (r, d_in):
            raise ModelFileError(f"{path}: {ka}: shape {a.shape}, expected (r, {d_in})")
        if b.shape != (d_out, r):
            raise ModelFileError(f"{path}: {kb}: shape {b.shape}, expected ({d_out}, {r})")
        ranks.add(r)
        modules[module] = (np.ascontiguousarray(a.T), np.ascontiguousarray(b.T),
                           float(alpha_cpp) / r)
    r = ranks.pop() if len(ranks) == 1 else 0
    rslora = bool(key("vkdsl.lora.rslora", False))
    alpha = float(key("vkdsl.lora.alpha", alpha_cpp))
    manifest = None
    if key("vkdsl.manifest") is not None:
        try:
            manifest = json.loads(key("vkdsl.manifest"))
        except json.JSONDecodeError as e:
            raise ModelFileError(f"{path}: vkdsl.manifest is not valid JSON: {e}") from e
    return AdapterWeights(modules, "gguf", path, r, alpha, rslora, manifest=manifest,
                          manifest_path=path if manifest is not None else None)


def resolve_adapter_path(path) -> Path:
    """A PEFT folder, a GGUF adapter file, or a vkdsl run folder holding `adapter/`."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_dir():
        raise ModelFileError(f"{p}: no such adapter file or folder")
    if (p / PEFT_CONFIG).is_file():
        return p
    if (p / "adapter" / PEFT_CONFIG).is_file():
        return p / "adapter"
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1 and not (p / "config.json").is_file():
        return ggufs[0]
    raise ModelFileError(f"{p}: neither a PEFT adapter folder ({PEFT_CONFIG}), a run folder with "
                         f"adapter/{PEFT_CONFIG}, nor a GGUF adapter file")


def read_adapter(path, cfg) -> AdapterWeights:
    """Host-side adapter (checked against `cfg`, a LlamaConfig); finds the manifest beside it."""
    src = Path(path)
    p = resolve_adapter_path(src)
    aw = _read_gguf_adapter(p, cfg) if p.is_file() else _read_peft(p, cfg)
    if aw.manifest is None:
        if p.is_file():
            cands = [p.parent / MANIFEST_NAME]           # beside a GGUF adapter without one inside
        elif p != src:
            cands = [p / MANIFEST_NAME, src / MANIFEST_NAME]   # run folder: adapter/ then the run
        else:
            cands = [p / MANIFEST_NAME]
        for cand in cands:
            if cand.is_file():
                aw.manifest, aw.manifest_path = read_manifest(cand), cand
                break
    return aw


def load_adapter(model, path, tokenizer=None, force: bool = False, model_path=None,
                 trainable: bool = False) -> AdapterWeights:
    """Read an adapter (PEFT folder, GGUF adapter or run folder), check its manifest (when
    present) against the model's base file and `tokenizer`, and install it as model.lora
    (replacing any adapters there). Returns the AdapterWeights (with .manifest)."""
    import vkdsl
    from vkdsl.ops.lora import LoRA
    aw = read_adapter(path, model.cfg)
    base = model_path if model_path is not None else model.source
    if aw.manifest is not None and base is not None:
        check_manifest(aw.manifest, base, tokenizer, force=force, source=aw.manifest_path or aw.source)
    lora = {}
    for name, (A, B, s) in aw.modules.items():
        lora[name] = LoRA(vkdsl.tensor(A, requires_grad=trainable, name=f"{name}.lora_A"),
                          vkdsl.tensor(B, requires_grad=trainable, name=f"{name}.lora_B"), s)
    model.lora = lora
    return aw


def save_adapter_bundle(model, run_dir, *, model_path, tokenizer, r: int | None = None,
                        alpha: float | None = None, rslora: bool = False, base_name: str = "",
                        extra: dict | None = None, gguf: bool = True) -> dict:
    """What a training run saves: run_dir/adapter/ (PEFT + vkdsl_manifest.json) and
    run_dir/adapter.gguf (llama.cpp LoRA with the same manifest embedded). `extra` goes into
    the manifest (data hashes and row counts, seeds, objective, metrics, gates, device...).
    Returns {"peft": folder, "gguf": file or None, "manifest": dict}."""
    from .manifest import build_manifest
    arrays = model_adapter_arrays(model)
    r, alpha, rslora = _infer_hparams(arrays, r, alpha, rslora)
    man = build_manifest(model_path, tokenizer, target_modules=sorted({n.split(".")[2] for n in arrays}),
                         r=r, alpha=alpha, rslora=rslora, extra=extra)
    run_dir = Path(run_dir)
    peft = save_peft(model, run_dir / "adapter", r=r, alpha=alpha, rslora=rslora,
                     base_name=base_name or Path(model_path).name, manifest=man)
    g = save_gguf_adapter(model, run_dir / "adapter.gguf", r=r, alpha=alpha, rslora=rslora,
                          base_name=base_name, manifest=man) if gguf else None
    return {"peft": peft, "gguf": g, "manifest": man}
