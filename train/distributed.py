"""Data parallelism over MPI: P processes (Open MPI, through mpi4py), each driving its own Vulkan
device, train one adapter. Only adapter gradients cross processes: each rank sums its share of a
step's micro-batches, already scaled by 1/(the global supervised-token count), into one flat fp32
buffer; Allreduce(SUM) makes the step's gradient on every rank, so clipping and AdamW then run
identically everywhere. mpi4py is imported only when asked for (launched under mpirun, or
--distributed mpi): single-process users load none of it.

A rank that raises calls MPI_Abort, so the others stop at once instead of waiting in a collective;
a rank that is killed is noticed by mpirun, which ends the job and names the rank."""
from __future__ import annotations

import os
import sys
import time

import numpy as np

# what Open MPI (and PMIx-based launchers) put in each rank's environment
_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE")


class DistributedError(RuntimeError):
    pass


class Single:
    """One process: every collective is the identity."""
    rank, size, root = 0, 1, True

    def allreduce_sum(self, buf: np.ndarray) -> np.ndarray:
        return buf

    def allgather(self, obj) -> list:
        return [obj]

    def bcast(self, obj):
        return obj

    def from_root(self, fn, *args):
        return fn(*args)

    def barrier(self):
        pass


class MPIGroup:
    """COMM_WORLD of the running job."""

    def __init__(self):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise DistributedError(f"--distributed mpi needs mpi4py ({e}); install it with "
                                   f"./setup.sh --mpi") from None
        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.root = self.rank == 0
        _abort_on_exception(self)

    def allreduce_sum(self, buf: np.ndarray) -> np.ndarray:
        buf = np.ascontiguousarray(buf)
        out = np.empty_like(buf)
        self.comm.Allreduce(buf, out, op=self.MPI.SUM)
        return out

    def allgather(self, obj) -> list:
        return self.comm.allgather(obj)

    def bcast(self, obj):
        """Rank 0's obj on every rank."""
        return self.comm.bcast(obj, root=0)

    def from_root(self, fn, *args):
        """fn(*args) computed by rank 0 alone and handed to every rank: what only rank 0 can read
        (the run folder's caches), or work that gains nothing from sharding."""
        return self.bcast(fn(*args) if self.root else None)

    def barrier(self):
        self.comm.Barrier()


def launched_under_mpi() -> bool:
    return any(v in os.environ for v in _LAUNCH_VARS)


_WORLD = []


def group(mode: str = "auto"):
    """auto: MPI when this process was started by mpirun, else one process; mpi; none."""
    if mode not in ("auto", "mpi", "none"):
        raise DistributedError(f"--distributed {mode!r}: expected auto, mpi or none")
    if mode == "mpi" or (mode == "auto" and launched_under_mpi()):
        if not _WORLD:
            _WORLD.append(MPIGroup())
        return _WORLD[0]
    return Single()


def ring_bytes(nbytes: int, size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of nbytes: 2 (P - 1) / P x nbytes."""
    return 2.0 * (size - 1) / size * nbytes


def sum_over_ranks(g, arrays: list, scalars: list) -> tuple[list, list, dict]:
    """Sum arrays (a step's gradients) and scalars (its loss sums) over the ranks in one all-reduce
    of one flat fp32 buffer -> (arrays, scalars, {allreduce_s, ring_bytes})."""
    flat = np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays]
                          + [np.asarray(scalars, np.float32)])
    t = time.perf_counter()
    flat = g.allreduce_sum(flat)
    info = {"allreduce_s": time.perf_counter() - t, "ring_bytes": ring_bytes(flat.nbytes, g.size)}
    out, k = [], 0
    for a in arrays:
        out.append(flat[k:k + a.size].reshape(a.shape))
        k += a.size
    return out, [float(x) for x in flat[k:]], info


def my_share(items: list, g) -> list:
    """Rank r's items of a step: r, r + P, r + 2P, ... (every item exactly once over the ranks)."""
    return items[g.rank::g.size]


def check_replicas(g, checksum: str, step: int):
    """Every rank must hold the same adapter after the same steps: compare checksums."""
    sums = g.allgather(checksum)
    if len(set(sums)) > 1:
        bad = [r for r, s in enumerate(sums) if s != sums[0]]
        raise DistributedError(f"after step {step} the adapter replicas differ: rank(s) {bad} hold "
                               f"{sums[bad[0]]}, rank 0 holds {sums[0]}")


def same_settings(g, settings: str):
    """Every rank must run the same job: a rank given other settings is named before any work."""
    import hashlib
    mine = hashlib.sha256(settings.encode()).hexdigest()[:16]
    sums = g.allgather(mine)
    bad = [r for r, s in enumerate(sums) if s != sums[0]]
    if bad:
        raise DistributedError(f"rank(s) {bad} were started with other settings than rank 0 (every "
                               f"rank of one job needs the same command line, config and "
                               f"VKDSL_PROFILE)")


def parallel():
    """The MPI group when this process is one rank of several, else None."""
    return _WORLD[0] if _WORLD and _WORLD[0].size > 1 else None


def stop_job(code: int):
    """This rank stopped on an error it has reported: end the whole job (the other ranks would
    wait in a collective for it); one process simply returns."""
    if parallel():
        sys.stderr.flush()
        parallel().comm.Abort(code)


def pick_device(g):
    """Rank r uses $VKDSL_DEVICE when set, else the r-th device of the preferred kind (modulo
    their count: several ranks may share one device)."""
    if g.size == 1 or os.environ.get("VKDSL_DEVICE"):
        return
    from vkdsl.runtime.device import ranked_devices
    devs = ranked_devices()
    if devs:
        os.environ["VKDSL_DEVICE"] = str(devs[g.rank % len(devs)].index)


def _abort_on_exception(g):
    """An uncaught exception on one rank aborts the job (the others would wait in a collective)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.write(f"vkdsl: rank {g.rank} of {g.size} failed ({kind.__name__}: {value}); "
                         f"aborting every rank\n")
        sys.stderr.flush()
        g.comm.Abort(1)
    sys.excepthook = hook
