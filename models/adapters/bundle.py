"""Finding and reading an adapter of either format (with its manifest), installing it on a
model, and what a training run saves (PEFT folder + GGUF file, one manifest)."""
from __future__ import annotations

from pathlib import Path

import vkdsl
from vkdsl.ops.lora import LoRA

from ..errors import ModelFileError
from ..manifest import MANIFEST_NAME, build_manifest, check_manifest, read_manifest
from . import gguf_lora, peft
from .common import AdapterWeights, adapter_mismatches, infer_hparams, model_adapter_arrays


def resolve_adapter_path(path) -> Path:
    """A PEFT folder, a GGUF adapter file, or a vkdsl run folder holding `adapter/`."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_dir():
        raise ModelFileError(f"{p}: no such adapter file or folder")
    if (p / peft.CONFIG).is_file():
        return p
    if (p / "adapter" / peft.CONFIG).is_file():
        return p / "adapter"
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1 and not (p / "config.json").is_file():
        return ggufs[0]
    raise ModelFileError(f"{p}: neither a PEFT adapter folder ({peft.CONFIG}), a run folder with "
                         f"adapter/{peft.CONFIG}, nor a GGUF adapter file")


def read_adapter(path, cfg) -> AdapterWeights:
    """Host-side adapter (checked against `cfg`, a LlamaConfig); finds the manifest beside it."""
    src = Path(path)
    p = resolve_adapter_path(src)
    aw = gguf_lora.read(p, cfg) if p.is_file() else peft.read(p, cfg)
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
    aw = read_adapter(path, model.cfg)
    base = model_path if model_path is not None else model.source
    if aw.manifest is not None and base is not None:
        check_manifest(aw.manifest, base, tokenizer, force=force,
                       source=aw.manifest_path or aw.source, more=adapter_mismatches(aw))
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
    arrays = model_adapter_arrays(model)
    r, alpha, rslora = infer_hparams(arrays, r, alpha, rslora)
    man = build_manifest(model_path, tokenizer,
                         target_modules=sorted({n.split(".")[2] for n in arrays}), r=r, alpha=alpha,
                         rslora=rslora, extra=extra)
    run_dir = Path(run_dir)
    folder = peft.save(model, run_dir / "adapter", r=r, alpha=alpha, rslora=rslora,
                     base_name=base_name or Path(model_path).name, manifest=man)
    g = gguf_lora.save(model, run_dir / "adapter.gguf", r=r, alpha=alpha, rslora=rslora,
                          base_name=base_name, manifest=man) if gguf else None
    return {"peft": folder, "gguf": g, "manifest": man}
