"""`vkdsl probe NAME`: the LoRA experiments of the probe essay (shared/seeds/004), each a
configuration of the trainer, evidence and op code plus a table, with its expectation stated next
to its measurement. A probe returns a Result; the CLI prints it, writes its report and exits
non-zero when a structural expectation fails.

Each probe declares its parameters with defaults sized for lavapipe on 2 cores; `--set k=v`
overrides them (the tests run every probe small on a tiny model)."""
from __future__ import annotations

from .base import (REGISTRY, Context, Expectation, Probe, ProbeError, Result, fmt,  # noqa: F401
                   parse_sets, probe)


def _load():
    from . import linear, model, runs  # noqa: F401  (each module registers its probes)


def get(name: str) -> Probe:
    _load()
    if name not in REGISTRY:
        raise ProbeError(f"unknown probe {name!r}; the probes are: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def all_probes() -> list[Probe]:
    _load()
    return list(REGISTRY.values())
