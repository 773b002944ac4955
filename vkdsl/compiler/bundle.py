"""SPIR-V bundles: a folder of compiled kernels that lets vkdsl run where no shader compiler is.

DIR/index.json maps each kernel's source key (sha256 of its expanded GLSL, which does not depend on
the compiler) to DIR/<name>-<key>.spv and its sha256 (and, where recorded, the gzipped source beside
it, so `check` can recompile it), and says what the bundle was built for: the vkdsl version, the
compiler, the device and the jobs recorded into it. Generated kernels have their shapes baked in, so
a job's kernels depend on its model, batch sizes and data lengths: a bundle holds the built-in
kernels plus whatever the recorded jobs compiled ($VKDSL_SPIRV_RECORD=DIR, or `vkdsl compile
--bundle DIR --for "COMMAND"`). Every write is a whole file moved into place (the .spv before the
index that names it), under a lock, so a killed recording leaves a valid bundle and several ranks
may record into one folder."""
from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import re

from ..fileio import atomic_write
from .cache import valid_spirv
from .errors import NoCompiler

INDEX = "index.json"
ENTRY = ("name", "file", "sha256")      # the fields of each kernel's entry in the index
_read: dict[str, dict] = {}          # bundle folder -> its index (read once per process)


def read_index(root: str) -> dict:
    """The bundle's index: {"format", "kernels": {key: {name, file, sha256}}, "built": {...}}."""
    try:
        with open(os.path.join(root, INDEX)) as f:
            index = json.load(f)
        if not isinstance(index.get("kernels"), dict):
            raise ValueError("no 'kernels' object")
        for key, entry in index["kernels"].items():
            if not (isinstance(entry, dict) and all(isinstance(entry.get(f), str) for f in ENTRY)):
                raise ValueError(f"kernels[{key!r}] is {json.dumps(entry)[:60]}, not an object "
                                 f"of strings {', '.join(ENTRY)}")
            for f in (entry["file"], entry.get("source", "")):
                if (not isinstance(f, str) or os.path.isabs(f)
                    or ".." in f.replace("\\", "/").split("/")):
                    raise ValueError(f"kernels[{key!r}] names {f!r}, not a file inside the bundle")
        built = index.get("built", {})
        if not isinstance(built, dict) or not (isinstance(built.get("jobs", []), list)
                                               and all(isinstance(j, str)
                                                       for j in built.get("jobs", []))):
            raise ValueError("'built' is not an object whose 'jobs' is a list of command lines")
    except (OSError, ValueError, AttributeError) as e:
        raise NoCompiler(f"SPIR-V bundle {root}: cannot read {INDEX} ({e})") from None
    return index


def lookup(root: str, key: str) -> bytes | None:
    """A kernel's SPIR-V from the bundle, None when the bundle does not hold it."""
    if root not in _read:
        _read[root] = read_index(root)
    entry = _read[root]["kernels"].get(key)
    if entry is None:
        return None
    path = os.path.join(root, entry["file"])
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise NoCompiler(f"SPIR-V bundle {root}: {entry['file']} is named in {INDEX} but cannot be "
                         f"read ({e})") from None
    if hashlib.sha256(blob).hexdigest() != entry["sha256"] or not valid_spirv(blob):
        raise NoCompiler(f"SPIR-V bundle file {path} does not match its sha256 in {INDEX}; rebuild "
                         f"the bundle")
    return blob


def describe(root: str) -> str:
    """What the bundle was built for, in one clause (for the missing-kernel error)."""
    built = _read.get(root, {}).get("built") or {}
    jobs = built.get("jobs") or []
    return (f"built by vkdsl {built.get('vkdsl', '?')} on "
            f"{built.get('device', 'an unrecorded device')}"
            + (f" for {'; '.join(repr(j) for j in jobs)}" if jobs
               else " with the built-in kernels only"))


@contextlib.contextmanager
def _locked(root: str):
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _current(root: str) -> dict:
    if not os.path.exists(os.path.join(root, INDEX)):
        return {"format": 1, "kernels": {}, "built": {}}
    return read_index(root)


def add(root: str, kernels: dict[str, tuple[str, bytes, str]], built: dict | None = None) -> int:
    """Put kernels {key: (name, spirv, expanded source)} into the bundle (merging with what it
    holds) and update what it was built for: built's "jobs" are appended, its other fields replace.
    -> kernels held."""
    with _locked(root):
        index = _current(root)
        for key, (name, blob, src) in sorted(kernels.items()):
            if key in index["kernels"]:
                continue
            fname = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:60]}-{key[:12]}.spv"
            # mtime=0: the same source gives the same bytes, so a rebuilt bundle diffs only where it
            # changed
            atomic_write(os.path.join(root, fname + ".glsl.gz"),
                         gzip.compress(src.encode(), 9, mtime=0))
            atomic_write(os.path.join(root, fname), blob)
            index["kernels"][key] = {"name": name, "file": fname,
                                     "sha256": hashlib.sha256(blob).hexdigest(),
                                     "source": fname + ".glsl.gz"}
        if built:
            old = index.setdefault("built", {})
            jobs = (old.get("jobs", [])
                    + [j for j in built.get("jobs", []) if j not in old.get("jobs", [])])
            old.update({k: v for k, v in built.items() if k != "jobs"}, jobs=jobs)
        atomic_write(os.path.join(root, INDEX),
                     json.dumps(index, indent=1, sort_keys=True).encode())
        _read.pop(root, None)
        return len(index["kernels"])


def check(root: str, compile_source, keys=None) -> list[str]:
    """Recompile the bundle's recorded sources (all, or those of keys) with compile_source(name,
    src) -> SPIR-V and say, one line each, where the bundle differs: a source whose hash is not its
    key, a missing source, or SPIR-V other than what the compiler makes of that source."""
    from .cache import key as source_key
    index, bad = read_index(root), []
    for k in sorted(keys if keys is not None else index["kernels"]):
        entry = index["kernels"][k]
        if "source" not in entry:
            bad.append(f"{entry['file']}: no recorded source")
            continue
        with open(os.path.join(root, entry["source"]), "rb") as f:
            src = gzip.decompress(f.read()).decode()
        if source_key(src, "target=vulkan1.2") != k:
            bad.append(f"{entry['source']}: its source does not hash to its key {k[:12]}")
        elif hashlib.sha256(compile_source(entry["name"], src)).hexdigest() != entry["sha256"]:
            bad.append(f"{entry['file']}: differs from what the compiler makes of "
                       f"{entry['source']}")
    return bad
