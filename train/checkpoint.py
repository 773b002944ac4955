"""Crash-consistent checkpoints and the base-model identity.

One checkpoint is one file, `checkpoint.npz`, written in one atomic replace: the adapter
tensors, the optimizer state and a `meta` member (JSON: step, modules, sampler state, identity,
sha256 of every array). A kill leaves the previous checkpoint or the new one, never a mix.
Loading verifies the members against their checksums and the step against the optimizer's
step count; the trainer also replays the data order to the saved step and compares. Anything
that disagrees is refused with a message naming the file and what disagrees."""
from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import numpy as np

from vkdsl.fileio import atomic_write

from .evidence import Evidence

NAME = "checkpoint.npz"
# the DPO stage's own checkpoint, beside the SFT stage's finished one
DPO = "dpo_checkpoint.npz"
BASE_EVAL = "base_eval.json"      # the base model's evaluation, keyed by what it depends on
LEGACY = "checkpoint.json"        # the two-file format of earlier versions: never resumed from
# 3: the identity of models.identity (one tokenizer_sha256 everywhere)
FORMAT = 3


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged or inconsistent: resuming from it is refused."""


def _digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    return hashlib.sha256(str((a.dtype.str, a.shape)).encode() + a.tobytes()).hexdigest()


def save(run_dir, step, names, params, opt_state, sampler_state, identity, name=NAME) -> Path:
    arrays = {f"p{i}": np.asarray(p) for i, p in enumerate(params)}
    arrays.update({f"opt_{k}": np.asarray(v) for k, v in opt_state.items()})
    meta = {"format": FORMAT, "step": step, "modules": names, "sampler": sampler_state, **identity,
            "sha256": {k: _digest(v) for k, v in arrays.items()}}
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    return atomic_write(Path(run_dir) / name, buf.getvalue())


def saved_step(run_dir, name=NAME):
    """The step of the run folder's checkpoint, or None (for messages; not verified)."""
    try:
        return load(run_dir, name)[0]["step"]
    except (CheckpointError, FileNotFoundError):
        return None


def load(run_dir, name=NAME):
    """(meta, params, optimizer state) of a verified checkpoint."""
    run_dir = Path(run_dir)
    path = run_dir / name
    if not path.is_file():
        if name == NAME and (run_dir / LEGACY).is_file():
            raise CheckpointError(f"{run_dir / LEGACY}: a checkpoint of the old two-file format, "
                                  f"which a kill can leave half-written; it cannot be resumed "
                                  f"safely (start a new run)")
        raise FileNotFoundError(f"{path}: no checkpoint to resume from")
    try:
        with np.load(path, allow_pickle=False) as z:
            members = {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError, NotImplementedError,
            RuntimeError) as e:
        # zipfile raises NotImplementedError / RuntimeError on damaged flags (compression,
        # encryption)
        raise CheckpointError(f"{path}: truncated or corrupt ({type(e).__name__}: {e})") from None
    try:
        meta = json.loads(members.pop("meta").tobytes())
    except (KeyError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: no readable meta member "
                              f"({type(e).__name__}: {e})") from None
    fmt = meta.get("format") if isinstance(meta, dict) else "?"
    if fmt == 2:
        raise CheckpointError(f"{path}: a checkpoint of format 2, whose base and tokenizer hashes "
                              f"are not this version's (format {FORMAT}): it cannot be resumed "
                              f"exactly (start a new run)")
    if fmt != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {fmt}, expected {FORMAT}")
    want = meta.get("sha256", {})
    if set(want) != set(members):
        raise CheckpointError(f"{path}: members {sorted(members)} do not match the ones its meta "
                              f"lists {sorted(want)}")
    for k, a in members.items():
        if _digest(a) != want[k]:
            raise CheckpointError(f"{path}: member {k} does not match its sha256 (damaged)")
    n = sum(1 for k in members if k.startswith("p"))
    params = [members[f"p{i}"] for i in range(n)]
    opt = {k[4:]: v for k, v in members.items() if k.startswith("opt_")}
    if n != 2 * len(meta.get("modules", [])):
        raise CheckpointError(f"{path}: {n} adapter tensors for "
                              f"{len(meta.get('modules', []))} modules")
    if "t" in opt and int(opt["t"]) != meta["step"]:
        raise CheckpointError(f"{path}: step {meta['step']} but the optimizer has taken "
                              f"{int(opt['t'])} steps")
    return meta, params, opt


def check_order(path, meta, fresh, what):
    """A stage's data order is a function of (seed, steps taken): replay a fresh one to the saved
    step and compare it with the saved state; `what` says what the order depends on."""
    for _ in range(meta["step"]):
        fresh.next()
    if json.dumps(fresh.state(), sort_keys=True) != json.dumps(meta["sampler"], sort_keys=True):
        raise CheckpointError(f"{path}: its data-order state is not the one of step {meta['step']} "
                              f"with {what}")


# what each identity key names, in a refusal (models.identity.of_run)
IDENTITY = {"base_sha256": "the base model", "tokenizer_sha256": "the tokenizer",
            "chat_template_sha256": "the chat template",
            "special_tokens": "the special tokens (bos, eos, pad, end of turn)",
            "quant": "the base's storage (quant)", "precision": "the matmul precision",
            "train_file_sha256": "the train_file's content",
            "dpo_train_file_sha256": "the dpo_train_file's content"}


def check_identity(meta, identity):
    """A resume must compute as the run did, on the same rows: refuse any difference, naming it."""
    for k, what in IDENTITY.items():
        if meta.get(k) != identity.get(k):
            def show(v):
                return f"{v[:12]}..." if isinstance(v, str) and len(v) == 64 else repr(v)
            raise CheckpointError(f"refusing to resume: {what} differs from the run's ({k} "
                                  f"{show(meta.get(k))} then, {show(identity.get(k))} now); start "
                                  f"a new run for new data or settings")


def remove_stale_temps(run_dir) -> list[Path]:
    """Temp files (.NAME.*.tmp) that a killed atomic write left behind: removed at the next
    start."""
    stale = [p for p in Path(run_dir).rglob(".*.tmp") if p.is_file()]
    for p in stale:
        p.unlink()
    return stale


def cached_base(path: Path, key: str):
    """The cached base evaluation (Evidence) when it was computed for exactly this key and reads
    as the type a run writes, else None: measured again."""
    try:
        saved = json.loads(path.read_text())
        if isinstance(saved, dict) and saved.get("key") == key and saved.get("base"):
            return Evidence.from_json(saved.get("base"))
    except (OSError, ValueError):
        pass
    return None
