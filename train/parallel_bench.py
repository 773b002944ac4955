"""`vkdsl bench parallel` (alone, or under `mpirun -np P`): data-parallel SFT step time on the
default run's model, data and adapters, with the global batch held at 4 rows (4 / P per rank):
per-step wall, compute and all-reduce seconds, the bytes each rank sends by the ring formula,
tokens/s. Steps are the first epoch's, as in the default run: each row's frozen prefix and base
logits are computed on its first visit."""
from __future__ import annotations

import tempfile
import time

import numpy as np

from .config import TrainConfig
from .distributed import group, ring_bytes
from .progress import Reporter
from .trainer import Run

GLOBAL_ROWS = 4


def bench_parallel(steps: int = 6) -> list[dict]:
    g = group("auto")
    if GLOBAL_ROWS % g.size:
        raise ValueError(f"{g.size} processes do not divide the global batch of {GLOBAL_ROWS} rows")
    cfg = TrainConfig(verify=False, quiet=True, batch_size=GLOBAL_ROWS // g.size,
                      steps=steps + 1).validate()
    r = Run(cfg, tempfile.mkdtemp(prefix=f"vkdsl-bench-rank{g.rank}-"), Reporter(None, quiet=True),
            group=g)
    walls, reduce, real = [], [], 0
    for s in range(steps + 1):
        idx = r.sampler.next()
        micro = r.micro_batches(idx)
        g.barrier()
        t = time.perf_counter()
        rec = r.stepper.step(micro, 1e-3, group=g)
        dt = time.perf_counter() - t
        if s:                                   # the first step compiles the programs
            walls.append(dt)
            reduce.append(rec.get("allreduce_s", 0.0))
            real += sum(len(r.train[i].ids) for i in idx)
    grad_bytes = 4 * sum(int(np.prod(p.shape)) for p in r.params)
    wall, red = float(np.median(walls)), float(np.median(reduce))
    rows = [{"ranks": g.size, "rows per rank": GLOBAL_ROWS // g.size, "step s (median)": wall,
             "compute s": wall - red, "all-reduce s": red, "communication share": red / wall,
             "gradient bytes": grad_bytes,
             "ring bytes sent per rank": ring_bytes(grad_bytes, g.size) if g.size > 1
             else 0.0, "tokens/s": real / sum(walls), "steps timed": steps}]
    return rows if g.root else []
