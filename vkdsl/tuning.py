"""Per-device tuning: the measured winner per (op, shape class), kept in one file per driver build
and read by the planners. Without a file or a shipped table (below), or with VKDSL_TUNING=0, every
planner keeps its default, deterministically.

What is tuned: the tile of the register-blocked CPU kernels (fp32 `matmul` and the packed-weight
`qmatmul`): rows x columns of C per invocation. A tile changes which invocation computes which
outputs, never the order of any output's sum, so a tuned plan's results are bitwise those of the
default (`vkdsl tune` checks each candidate against the default's output before keeping it).

The file, <SPIR-V cache>/tuning/<driver>.json, names the device and driver it was measured on;
one from another driver or version, or a damaged one, is said in one line and not used (and
`vkdsl tune` measures afresh over it). `vkdsl tune` (ops/tune.py) writes it.

On a CPU driver the device is the processor as much as the driver: the identity names the CPU
too (vendor and model, `cpu()`), so a file measured on another machine that shares the cache
folder is not used here.

The package ships tables measured on reference machines (vkdsl/tuned/: one per exact device and
driver build, e.g. Debian 12's lavapipe, and on a CPU driver per CPU vendor: the file and its
identity name the vendor, not the model). The tiles one vendor's CPU prefers are not another's:
on Debian's lavapipe the AMD table's tiles ran the large packed products 20-26% slower than the
default tile on an Intel Xeon (BENCHMARKS.md). A device with no file of its own takes the
shipped table of its build and vendor, if there is one, and a local file's entries override it
class by class."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys

from .fileio import atomic_write
from .handwritten import DEFAULT_TILE

FORMAT = 1
# candidate tiles (rows, columns): columns a multiple of 4 (vec4 accumulators), at most 512
# accumulators (larger spilled on lavapipe: 32x32 ran at ~25 GFLOP/s against ~43 for 16x32)
TILES = ((16, 32), (8, 32), (32, 16), (16, 16), (8, 16), (4, 32), (16, 8), (8, 8), (32, 8), (4, 16))
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")
_files: dict[str, dict] = {}             # path -> entries (read once per process)


@functools.lru_cache(maxsize=1)      # identity() runs at every matmul plan: read the file once
def cpu() -> str:
    """'vendor model' of this machine's processor (/proc/cpuinfo; elsewhere what platform says)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = info.get("model name") or platform.processor() or platform.machine()
    return f"{info.get('vendor_id', '')} {model}".strip()


def identity(dev) -> dict:
    """What a tuning is valid for: the device and its driver build (and the CPU a CPU driver runs
    on)."""
    i = dev.info
    return {"device": i.name, "driver": i.driver, "driver_info": i.driver_info,
            "api": i.api_version, "profile": i.profile,
            **({"cpu": cpu()} if i.kind == "cpu" else {})}


def _build(ident: dict) -> dict:
    return {k: v for k, v in ident.items() if k != "cpu"}


def path(dev, ident: dict | None = None) -> str:
    from .compiler.cache import cache_dir
    text = json.dumps(ident or identity(dev), sort_keys=True)
    slug = "".join(c if c.isalnum() else "-" for c in dev.info.name)[:40]
    return os.path.join(cache_dir(), "tuning",
                        f"{slug}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json")


def shape_class(op: str, form: str, M: int, N: int, K: int) -> str:
    """Shapes within the same powers of two share a tuning: 'qmatmul:q4_1 nt 1024x576x1024'."""
    def up(x):
        return 1 << max(0, int(x) - 1).bit_length()
    return f"{op} {form} {up(M)}x{up(N)}x{up(K)}"


def shipped_identity(dev) -> dict:
    """What a shipped table for this device names: the driver build and, on a CPU driver, the
    CPU's vendor (its first word) rather than its model."""
    here = identity(dev)
    return {**_build(here), **({"cpu": here["cpu"].split()[0]} if here.get("cpu") else {})}


def _check(data, dev, shipped: bool = False) -> dict:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"expected an object with format {FORMAT}")
    if data.get("identity") != (shipped_identity(dev) if shipped else identity(dev)):
        raise ValueError(f"measured on {data.get('identity')}, not this device and driver")
    entries = data.get("entries")
    if not isinstance(entries, dict):
        raise ValueError("'entries' is not an object")
    for k, e in entries.items():
        if not (isinstance(e, dict) and isinstance(e.get("tile"), list)
                and tuple(e["tile"]) in TILES):
            raise ValueError(f"entries[{k!r}] has no tile among {list(TILES)}")
    return entries


def _read(p: str, dev, shipped: bool = False) -> dict:
    if p not in _files:
        _files[p] = {}
        try:
            with open(p) as f:
                _files[p] = _check(json.load(f), dev, shipped)
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            print(f"vkdsl: ignoring the tuning file {p} ({str(e)[:160]}); defaults until "
                  f"`vkdsl tune` measures again", file=sys.stderr)
    return _files[p]


def shipped_path(dev) -> str:
    """Where the package's table for this device, driver build (and CPU vendor) would be: named
    by the build's identity, then the vendor."""
    ident = shipped_identity(dev)
    name = os.path.basename(path(dev, _build(ident)))
    return os.path.join(SHIPPED, name[:-5] + f"-{ident['cpu']}.json" if "cpu" in ident else name)


def shipped_vendors(dev) -> list[str]:
    """The CPU vendors this driver build has tables shipped for."""
    stem = os.path.basename(path(dev, _build(identity(dev))))[:-5]
    return sorted(f[len(stem) + 1:-5] for f in os.listdir(SHIPPED) if f.startswith(stem + "-"))


def local_entries(dev) -> dict:
    """What `vkdsl tune` measured on this machine ({} without a usable file: said once)."""
    return _read(path(dev), dev)


def shipped_entries(dev) -> dict:
    """The package's table for this exact device and driver build ({} where it ships none)."""
    return _read(shipped_path(dev), dev, shipped=True)


def entries(dev) -> dict:
    """The tuned entries for this device: the shipped table, overridden by this machine's."""
    return {**shipped_entries(dev), **local_entries(dev)}


def tile(dev, op: str, form: str, M: int, N: int, K: int, fits=lambda t: True) -> tuple[int, int]:
    """(rows, columns) per invocation for this op and shape on this device: tuned (when the kernel
    can take that tile: fits), else the default. $VKDSL_TUNE_RECORD=FILE lists the shapes asked
    for."""
    record = os.environ.get("VKDSL_TUNE_RECORD")
    if record:
        _record(record, op, form, M, N, K)
    if os.environ.get("VKDSL_TUNING") == "0":
        return DEFAULT_TILE
    key = shape_class(op, form, M, N, K)       # looked up, not merged: planners ask per product
    e = local_entries(dev).get(key) or shipped_entries(dev).get(key)
    return tuple(e["tile"]) if e and fits(tuple(e["tile"])) else DEFAULT_TILE


_recorded: set = set()


def _record(where: str, *shape):
    """One line per distinct shape a process plans (appended: several ranks may share the file)."""
    if shape in _recorded or min(shape[2:]) <= 0:
        return
    _recorded.add(shape)
    with open(where, "a") as f:
        f.write(json.dumps(list(shape)) + "\n")


def save(dev, new: dict) -> str:
    """Merge new entries {class: {"tile": [r, c], ...}} into this device's file -> its path."""
    p = path(dev)
    merged = {**local_entries(dev), **new}
    atomic_write(p, json.dumps({"format": FORMAT, "identity": identity(dev), "entries": merged},
                               indent=1, sort_keys=True).encode())
    _files[p] = merged
    return p


def forget():
    """Drop what was read (tests, and `vkdsl tune` after writing)."""
    _files.clear()
