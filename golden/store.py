"""Read golden cases: manifest validation and sha256-checked npz loading.

Layout: <root>/v<version>/manifest.json and the npz files it names; root defaults to the
`data` folder next to this file. Any problem (malformed manifest, missing file, wrong
hash, missing arrays) raises GoldenError naming the file, what was expected and what was found.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterator

import numpy as np

DATA_ROOT = Path(__file__).resolve().parent / "data"
MANIFEST = "manifest.json"

# key -> type every case entry must have (the manifest schema, version 1)
CASE_KEYS = {"name": str, "op": str, "params": dict, "inputs": list, "outputs": list,
             "upstream": (str, type(None)), "file": str, "sha256": str}
_SAFE_FILE = re.compile(r"^[A-Za-z0-9_.+-]+\.npz$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class GoldenError(ValueError):
    """A golden file or manifest is missing, malformed or does not match its hash."""


def data_dir(version: int = 1, root: str | Path | None = None) -> Path:
    """Folder that holds one version's manifest and npz files."""
    return Path(root if root is not None else DATA_ROOT) / f"v{version}"


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_case(path: Path, i: int, case) -> None:
    """Validate one manifest entry's keys, types and values."""
    where = f"{path}: cases[{i}]"
    if not isinstance(case, dict):
        raise GoldenError(f"{where}: expected an object, found {type(case).__name__}")
    for key, typ in CASE_KEYS.items():
        if key not in case:
            raise GoldenError(f"{where}: expected key {key!r}, found keys {sorted(case)}")
        if not isinstance(case[key], typ):
            raise GoldenError(f"{where} ({case.get('name')!r}): expected {key!r} of type "
                              f"{typ}, found {type(case[key]).__name__}")
    if not _SAFE_FILE.match(case["file"]):
        raise GoldenError(f"{where}: expected a plain .npz file name, found {case['file']!r}")
    if not _HEX64.match(case["sha256"]):
        raise GoldenError(f"{where}: expected a 64-hex-digit sha256, found {case['sha256']!r}")
    names = case["inputs"] + case["outputs"]
    if not all(isinstance(n, str) for n in names) or "out" not in case["outputs"]:
        raise GoldenError(f"{where}: expected string array names with 'out' among outputs, "
                          f"found inputs={case['inputs']} outputs={case['outputs']}")


def load_manifest(version: int = 1, root: str | Path | None = None) -> dict:
    """Parse and validate <root>/v<version>/manifest.json."""
    path = data_dir(version, root) / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GoldenError(f"{path}: missing file (expected the golden manifest)") from None
    except UnicodeDecodeError as e:
        raise GoldenError(f"{path}: expected UTF-8 JSON, found byte 0x{e.object[e.start]:02x} at "
                          f"offset {e.start}") \
            from None
    try:
        man = json.loads(text)
    except json.JSONDecodeError as e:
        raise GoldenError(f"{path}: expected JSON, found a parse error: {e}") from None
    if not isinstance(man, dict) or not isinstance(man.get("cases"), list):
        raise GoldenError(f"{path}: expected an object with a 'cases' list, found "
                          f"{type(man).__name__} with keys "
                          f"{sorted(man) if isinstance(man, dict) else '-'}")
    if man.get("version") != version:
        raise GoldenError(f"{path}: expected version {version}, found {man.get('version')!r}")
    seen_names, seen_files = set(), set()
    for i, case in enumerate(man["cases"]):
        _check_case(path, i, case)
        for key, seen in (("name", seen_names), ("file", seen_files)):
            if case[key] in seen:
                raise GoldenError(f"{path}: expected unique {key}s, found {case[key]!r} twice")
            seen.add(case[key])
    return man


def iter_cases(version: int = 1, root: str | Path | None = None,
               match: str | None = None) -> Iterator[dict]:
    """Manifest entries (copies, with an added absolute "path"), optionally those whose name
    contains `match`."""
    folder = data_dir(version, root)
    for case in load_manifest(version, root)["cases"]:
        if match is None or match in case["name"]:
            yield {**case, "path": str(folder / case["file"])}


def load_case(case: dict, version: int = 1,
              root: str | Path | None = None) -> dict[str, np.ndarray]:
    """Arrays of one case after checking the file's sha256 and array names; uses case["path"] if
    present."""
    path = Path(case["path"]) if "path" in case else data_dir(version, root) / case["file"]
    if not path.is_file():
        raise GoldenError(f"{path}: missing file (expected by case {case['name']!r}, "
                          f"sha256 {case['sha256']})")
    found = sha256_file(path)
    if found != case["sha256"]:
        raise GoldenError(f"{path}: sha256 mismatch for case {case['name']!r}: "
                          f"expected {case['sha256']}, found {found}")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # a file with the right hash should never get here
        raise GoldenError(f"{path}: expected an npz archive, found an unreadable "
                          f"file: {e}") from None
    want = (set(case["inputs"]) | set(case["outputs"])
            | ({case["upstream"]} if case["upstream"] else set()))
    if want != set(arrays):
        raise GoldenError(f"{path}: expected arrays {sorted(want)}, found {sorted(arrays)}")
    return arrays


def check_all(version: int = 1, root: str | Path | None = None) -> int:
    """Load every case (checking hashes and array names); returns the number of cases."""
    n = 0
    for case in iter_cases(version, root):
        load_case(case)
        n += 1
    return n
