"""Goldens of kernel cases: a case's arrays (vkdsl.cases.references) stored in vkdsl's golden
format for devices without the reference at hand, read back, and checked for staleness against
the case's generator."""
from __future__ import annotations

import hashlib
import json

from .cases import Case, CaseError, draw_inputs, references
from .fileio import atomic_write


def stale(case: Case, arrays: dict) -> str:
    """Why a stored golden no longer belongs to its case ('' when its inputs are the
    generator's)."""
    ins, rng = draw_inputs(case)
    stored = sorted(k for k in arrays if k.startswith("in") and k[2:].isdigit())
    if len(stored) != len(ins) or any(arrays[f"in{i}"].dtype != a.dtype
                                      or arrays[f"in{i}"].shape != a.shape
                                      or arrays[f"in{i}"].tobytes() != a.tobytes()
                                      for i, a in enumerate(ins)):
        return ("stale golden: its inputs are not what the case's generator draws now (make the "
                "golden again)")
    return ""


def params_json(case: Case) -> dict:
    """The case's params as a golden manifest stores them (JSON), or one line naming the case."""
    try:
        return json.loads(json.dumps(case.params))
    except (TypeError, ValueError) as e:
        raise CaseError(f"{case.where}: case {case.name!r}: params must be JSON values to be "
                        f"stored ({e})") from None


def with_references(cases: list[Case]) -> list[tuple]:
    """(case, its arrays computed here, '') for each case: a check against the float64 reference."""
    return [(c, references(c), "") for c in cases]


def with_goldens(cases: list[Case], root=None) -> list[tuple]:
    """(case, its stored golden, '' or why the golden is stale) for each case, from root's v1/
    (default: the goldens installed with vkdsl). A missing, altered or unreadable golden is one
    GoldenError line naming the file and the case."""
    from vkdsl_golden import store
    folder = store.data_dir(1, root)
    entries = {e["name"]: e for e in store.load_manifest(1, root)["cases"]}
    out = []
    for c in cases:
        if c.name not in entries:
            raise store.GoldenError(f"{folder / store.MANIFEST}: no golden for case {c.name!r} of "
                                    f"{c.where} (make them: vkdsl golden make --cases {c.where} "
                                    f"--out DIR)")
        e = entries[c.name]
        arrays = store.load_case({**e, "path": str(folder / e["file"])})
        out.append((c, arrays, stale(c, arrays)))
    return out


def make_goldens(cases: list[Case], root) -> dict:
    """Store each case's arrays (references()) under root/v1/ in vkdsl's golden format: one npz per
    case and a sha256 manifest, each written atomically; npz files of other cases there are removed.
    Returns the manifest."""
    from vkdsl_golden import store
    from vkdsl_golden.generate import file_name, manifest_text, npz_bytes
    folder = store.data_dir(1, root)
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for c in cases:
        arrays = references(c)
        data = npz_bytes(arrays)
        n_in = sum(1 for k in arrays if k.startswith("in") and k[2:].isdigit())
        entries.append({"name": c.name, "op": c.op, "params": params_json(c),
                        "inputs": [f"in{i}" for i in range(n_in)],
                        "outputs": [k for k in arrays if k != "gout"
                                    and not (k.startswith("in") and k[2:].isdigit())],
                        "upstream": "gout" if "gout" in arrays else None, "file": file_name(c.name),
                        "sha256": hashlib.sha256(data).hexdigest(), "measure": c.measure})
        atomic_write(folder / entries[-1]["file"], data)
    files = [e["file"] for e in entries]
    if len(set(files)) != len(files):
        raise CaseError(f"{cases[0].where}: two cases map to one golden file name: rename one")
    man = {"version": 1, "generator": "vkdsl golden make", "cases": entries}
    atomic_write(folder / store.MANIFEST, manifest_text(man).encode())
    for old in folder.glob("*.npz"):
        if old.name not in files:
            old.unlink()
    store.load_manifest(1, root)               # what was written must pass the reader's checks
    return man
