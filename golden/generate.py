"""The one generator of golden data:  python -m vkdsl_golden.generate  |  python golden/generate.py

Deterministic: every case draws from its own numpy Generator seeded with crc32(case name),
so adding or removing a case never changes another. npz files are uncompressed with a
fixed array order (in0.., gout, outputs) and zip entries carry numpy's fixed timestamp,
so re-running gives byte-identical files. Every file and the manifest are written
atomically (temp file in the same folder + os.replace).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    # run as a script: import this folder as package "golden" so the relative imports work
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "golden"
    import golden  # noqa: F401

from .cases import Case, N
from .cases_gpu import every_case
from .dispatch import BACKWARD_OPS, evaluate
from .store import DATA_ROOT, MANIFEST, data_dir, load_manifest

GENERATOR = "golden/generate.py"
VERSION = 1


# ---------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------

def file_name(name: str) -> str:
    """Case name -> safe npz file name: add[33x1023+1023] -> add_33x1023+1023.npz."""
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", name).strip("_") + ".npz"


def seed_of(name: str) -> int:
    """Stable per-case seed (crc32 of the name)."""
    return zlib.crc32(name.encode("utf-8"))


def build(case: Case) -> tuple[dict, dict[str, np.ndarray]]:
    """(manifest entry without file/sha256, arrays in file order) for one case."""
    rng = np.random.default_rng(seed_of(case.name))
    inputs = [np.asarray(a) for a in case.make(rng)]
    for i, a in enumerate(inputs):
        assert a.dtype in (np.float32, np.int32, np.uint8), f"{case.name}: in{i} is {a.dtype}"
    gout = None
    if case.op in BACKWARD_OPS:
        gout = N(rng, case.gout_shape)
    res = evaluate(case.op, inputs, case.params, gout)
    arrays = {f"in{i}": a for i, a in enumerate(inputs)}
    if gout is not None:
        arrays["gout"] = gout
    arrays.update(res)
    entry = {"name": case.name, "op": case.op, "params": case.params,
             "inputs": [f"in{i}" for i in range(len(inputs))], "outputs": list(res),
             "upstream": "gout" if gout is not None else None}
    return entry, arrays


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """Uncompressed npz in the dict's order (deterministic bytes)."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _atomic_write(path: Path, data: bytes) -> None:
    """Write via a temp file in the same folder, then os.replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def manifest_text(man: dict) -> str:
    """The manifest as stored: one case per line (readable diffs), key order kept."""
    head = {k: v for k, v in man.items() if k != "cases"}
    lines = [json.dumps(c) for c in man["cases"]]
    return (json.dumps(head)[:-1] + ', "cases": [\n ' + ",\n ".join(lines) + "\n]}\n")


def generate(root: str | Path | None = None, version: int = VERSION, verbose: bool = False,
             match: str | None = None, skip: tuple[str, ...] = ()) -> dict:
    """Write every case (or those whose name contains match, less those containing any of skip)
    and the manifest under <root>/v<version>; remove stale npz files; returns the manifest."""
    if version != VERSION:
        raise ValueError(f"this generator writes version {VERSION} only")
    folder = data_dir(version, root)
    folder.mkdir(parents=True, exist_ok=True)
    entries, files = [], set()
    for case in every_case():
        if (match is not None and match not in case.name) or any(x in case.name for x in skip):
            continue
        entry, arrays = build(case)
        data = npz_bytes(arrays)
        entry["file"] = file_name(case.name)
        entry["sha256"] = hashlib.sha256(data).hexdigest()
        if entry["file"] in files:
            raise ValueError(f"two cases map to file {entry['file']}")
        files.add(entry["file"])
        _atomic_write(folder / entry["file"], data)
        entries.append(entry)
        if verbose:
            print(f"{len(data):>9}  {case.name}")
    man = {"version": version, "generator": GENERATOR, "cases": entries}
    _atomic_write(folder / MANIFEST, manifest_text(man).encode("utf-8"))
    for stale in folder.glob("*.npz"):
        if stale.name not in files:
            stale.unlink()
    load_manifest(version, root)   # what we wrote must pass the reader's validation
    return man


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Generate vkdsl golden data (numpy float64 "
                                             "references).")
    ap.add_argument("--root", default=str(DATA_ROOT),
                    help="folder holding v<version>/ (default: package data)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temp folder and compare with the stored manifest")
    ap.add_argument("--match", default=None,
                    help="with --check: only the cases whose name contains this")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.match is not None and not args.check:
        ap.error("--match goes with --check (a partial generation would drop the other "
                 "cases' files)")
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            new = {c["name"]: c for c in generate(tmp, match=args.match)["cases"]}
        old = {c["name"]: c for c in load_manifest(VERSION, args.root)["cases"]
               if args.match is None or args.match in c["name"]}
        diff = sorted(n for n in set(new) | set(old) if new.get(n) != old.get(n))
        same = bool(new) and not diff
        print("golden data up to date" if same else f"golden data differs: {diff[:20]}")
        return 0 if same else 1
    man = generate(args.root, verbose=args.verbose)
    folder = data_dir(VERSION, args.root)
    total = sum((folder / c["file"]).stat().st_size for c in man["cases"])
    print(f"wrote {len(man['cases'])} cases, {total / 1e6:.2f} MB, to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
