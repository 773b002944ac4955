"""What every hand-written kernel (a .comp file in kernels/) needs from the core: the variant as
one object (`KernelVariant`: what a planner picks, a bundle compiles and a device builds, once),
the registry of every family's variants, a push-constant layout declared once and checked against
its GLSL block, a workgroup grid folded under the device's own limit, and the choice between the
CPU-driver (lvp) and GPU variants. The matmul here and the op library's kernels use it."""
from __future__ import annotations

import contextlib
import contextvars
import re
import struct
from dataclasses import dataclass, field
from typing import Callable

from .compiler import compile_glsl, kernel_source
from .runtime import get_kernel

# lavapipe tile: 16 rows x 32 columns per invocation, 8 invocations (one SIMD program) a workgroup.
# Measured at 1024^3 on 2 cores with this loop structure (best of 3): 16x32 and 32x16 ~43 GFLOP/s,
# 8x16 ~30, 32x32 ~25 (accumulators spill). llvmpipe vectorizes a workgroup along x only: (4, 2, 1)
# ran at 0.6x and (2, 4, 1) at 0.35x of (8, 1, 1) on the same tiles.
LVP_TILE = dict(TM=16, TN=32, LOCAL=(8, 1, 1))
DEFAULT_TILE = (LVP_TILE["TM"], LVP_TILE["TN"])


@dataclass(frozen=True, eq=False)
class KernelVariant:
    """One form of a hand-written kernel: its source and name, the defines it is compiled with, its
    workgroup size, the block of the output one workgroup covers (tiled products; with linear, the
    block one invocation covers, blocks numbered row by row over the grid: matmul_tile.glsl's
    tile_origin), the bindings read as texel buffers (binding -> format) and whether it needs
    cooperative matrices. A planner picks one and builds it on the device; bundles compile every
    one a family registers."""
    source: str
    name: str
    defines: dict
    local: tuple
    rows: int = 1
    cols: int = 1
    texels: dict = field(default_factory=dict)
    coopmat: bool = False
    linear: bool = False

    def build(self, dev, n_buffers: int, push: "PushLayout | int"):
        """Its pipeline on this device, built once (the device's own table: a closed device takes
        its pipelines along)."""
        push_size = push if isinstance(push, int) else push.size
        texels = tuple(sorted(self.texels.items()))
        key = ("variant", self.source, self.name, tuple(sorted(self.defines.items())),
               tuple(self.local), push_size, n_buffers, texels)
        if key not in dev.kernels:
            dev.kernels[key] = get_kernel(dev, self.name, self.spirv(), n_buffers=n_buffers,
                                          push_size=push_size, local_size=tuple(self.local),
                                          texels=texels)
        return dev.kernels[key]

    def spirv(self) -> bytes:
        return compile_glsl(self.name, kernel_source(self.source), self.defines,
                            coopmat=self.coopmat)

    def grid(self, dev, rows: int, cols: int, batch: int = 1, what: str = "") -> tuple:
        """Workgroups of a tiled product writing batch x rows x cols, one block of self.rows x
        self.cols each (linear: one block an invocation, folded over x and y), none when nothing
        is written (the runtime skips the dispatch), checked against the device's limit."""
        if min(rows, cols, batch) <= 0:
            return (0, 0, 0)
        if self.linear:
            tiles = -(-rows // self.rows) * -(-cols // self.cols)
            groups = grid_for(dev, tiles, self.local[0])[:2] + (batch,)
        else:
            groups = (-(-cols // self.cols), -(-rows // self.rows), batch)
        limit = tuple(dev.limits.max_workgroup_count)
        if any(g > lim for g, lim in zip(groups, limit)):
            raise ValueError(f"{what or f'{self.name} {rows}x{cols}'} batch {batch}: {groups} "
                             f"workgroups exceed the device limit {limit}")
        return groups


FAMILIES: dict[str, Callable] = {}


def variant_family(name: str):
    """Register f(dev) -> [KernelVariant], every variant of a kernel family that this device's
    planners can pick; the planners sit beside it and build the same objects."""
    def wrap(fn):
        FAMILIES[name] = fn
        return fn
    return wrap


def builtin_variants(dev) -> list[str]:
    """Compile (to SPIR-V, no pipelines) every registered family's variants for this device: what
    bundles hold besides the kernels their jobs record. Families register on import (the matmul
    here; vkdsl.ops its own)."""
    variants = [v for family in FAMILIES.values() for v in family(dev)]
    for v in variants:
        v.spirv()
    return [v.name for v in variants]


def lvp_variant(source: str, prefix: str, base: dict, vec: int, sv: int,
                tile: tuple = DEFAULT_TILE, texels: dict | None = None) -> KernelVariant:
    """A register-tiled CPU-driver product (matmul_lvp.glsl, qmatmul_lvp.glsl): VEC-wide loads,
    SV-wide stores, a (rows, columns) tile per invocation, tiles numbered linearly, its operands
    read as texel buffers where texels names them.
    Named {prefix}_lvp_{t|v}{VEC}s{SV}[_{TM}x{TN}]."""
    tm, tn = tile
    d = dict(base, VEC=vec, SV=sv, TM=tm, TN=tn, **({"TEXEL": 1} if texels else {}))
    name = (f"{prefix}_lvp_{'t' if texels else 'v'}{vec}s{sv}"
            + (f"_{tm}x{tn}" if tuple(tile) != DEFAULT_TILE else ""))
    return KernelVariant(source, name, d, LVP_TILE["LOCAL"], tm, tn, texels or {}, linear=True)


def default_variant(dev) -> str:
    """lvp (register-blocked, no shared memory) on CPU drivers, gpu (shared-memory tiles) elsewhere;
    a capability profile may ask for either (runtime.profiles)."""
    return dev.info.variant or ("lvp" if dev.info.kind == "cpu" else "gpu")


def texel_limit(dev) -> int:
    """Elements an operand may hold and still be read as a uniform texel buffer by the CPU-driver
    kernel family (generated kernels, fused attention): on lavapipe a texel fetch is a vector
    gather where a storage load whose address differs between lanes is a loop over the lanes.
    0 on GPUs, GPU profiles, and devices without the texel formats (runtime.memory)."""
    cpu = default_variant(dev) == "lvp" and dev.info.kind == "cpu"
    return dev.limits.max_texel_elements if cpu else 0


def texel_reads(dev, *elements: int) -> bool:
    """Whether operands of these many elements are read as texel buffers (texel_limit)."""
    return 0 < max(elements) <= texel_limit(dev)


def texel_fits(dev, *elements: int) -> bool:
    """Whether an lvp variant asked for by name (matmul, qmatmul) reads operands of these many
    floats as texel buffers: on CPU drivers, within maxTexelBufferElements (the r32f fallback's
    unit). Unlike texel_reads it holds under a GPU profile too, where a caller may still ask for
    the lvp kernel on lavapipe."""
    lim = dev.limits.max_texel_elements
    return dev.info.kind == "cpu" and lim > 0 and max(elements) <= lim


def has_int64(dev) -> bool:
    """shaderInt64, needed by 8-wide loads (enabled at device creation when present)."""
    return dev.limits.int64


def lvp_widths(dev) -> tuple:
    """Load widths (floats) the lvp kernels can use on this device, widest first."""
    return (8, 4, 1) if has_int64(dev) else (4, 1)


def widest(values, widths) -> int:
    """The widest load width that divides every value."""
    return next(w for w in widths if all(v % w == 0 for v in values))


# The shared-memory kernels' blocks, largest first: (rows = columns of C, BK, rows = columns per
# thread).
GPU_BLOCKS = ((128, 8, 8), (64, 16, 4), (32, 16, 4))
# Workgroups a grid should have before a larger block is worth it: a large GPU runs one block per
# compute unit at a time (an H200 has 132), so a 1024 x 576 product in 128-blocks (40 of them)
# leaves two thirds idle where 64-blocks (144) fill it. Small GPUs are full either way.
GPU_FILL = 128
_block = contextvars.ContextVar("gpu_block", default=0)


def gpu_configs(dev) -> list[dict]:
    """Every block of GPU_BLOCKS that fits the device: 256 threads or fewer within its workgroup
    limits, both slices in its shared memory, a whole number of subgroups."""
    lim, out = dev.limits, []
    for bm, bk, t in GPU_BLOCKS:
        threads = (bm // t) ** 2
        shared = 2 * bk * (bm + 1) * 4
        if (threads <= lim.max_workgroup_invocations and bm // t <= min(lim.max_workgroup_size[:2])
                and shared <= lim.max_shared_memory and threads % max(lim.subgroup_size, 1) == 0):
            out.append(dict(BM=bm, BN=bm, BK=bk, TM=t, TN=t, LOCAL=(bm // t, bm // t, 1)))
    if not out:
        raise RuntimeError(f"{dev.info.name}: no shared-memory tile fits the device limits")
    return out


@contextlib.contextmanager
def gpu_block(rows: int):
    """Inside, the shared-memory kernels use this block (128, 64 or 32) whatever the shape: verify's
    rows reach every block the shape rule can pick on a device, and tests compare them. It acts
    where a product is planned — when its program is built — so realize lazy tensors inside."""
    token = _block.set(int(rows))
    try:
        yield
    finally:
        _block.reset(token)


def each_gpu_block(dev):
    """Every block that fits the device, the loop's body inside its gpu_block (bundles list them
    all)."""
    for cfg in gpu_configs(dev):
        with gpu_block(cfg["BM"]):
            yield cfg


def gpu_config(dev, rows: int = 0, cols: int = 0, batch: int = 1) -> dict:
    """The block for a rows x cols output (times batch): the largest that fits the device and still
    gives GPU_FILL workgroups, else the smallest that fits; without a shape, the largest. Inside
    gpu_block(B), block B (refused, naming the device, where it does not fit)."""
    cfgs = gpu_configs(dev)
    if _block.get():
        cfg = next((c for c in cfgs if c["BM"] == _block.get()), None)
        if cfg is None:
            raise ValueError(f"gpu block {_block.get()} does not fit {dev.info.name} "
                             f"(fitting: {', '.join(str(c['BM']) for c in cfgs)})")
        return cfg
    if rows <= 0:
        return cfgs[0]
    fills = (c for c in cfgs if -(-rows // c["BM"]) * -(-cols // c["BN"]) * batch >= GPU_FILL)
    return next(fills, cfgs[-1])


def push_block_size(source: str) -> int:
    """Bytes of the push-constant block declared in a GLSL source (uint/int/float members only)."""
    body = re.search(r"layout\(push_constant\)\s*uniform\s+\w+\s*\{(.*?)\}", source, re.S).group(1)
    n = 0
    for decl in body.split(";"):
        m = re.match(r"\s*(uint|int|float)\s+(.+)", decl.strip())
        if m:
            n += len(m.group(2).split(","))
        elif decl.strip():
            raise ValueError(f"unexpected push-constant member {decl.strip()!r}")
    return 4 * n


class PushLayout:
    """A push-constant block declared once in GLSL; `fmt` is its struct packing, checked on
    creation."""

    def __init__(self, fmt: str, glsl_file: str):
        self.fmt, self.size = fmt, struct.calcsize(fmt)
        declared = push_block_size(kernel_source(glsl_file))
        if self.size != declared:
            raise AssertionError(f"push layout {fmt} packs {self.size} bytes; {glsl_file} declares "
                                 f"{declared}")

    def pack(self, *values) -> bytes:
        return struct.pack(self.fmt, *values)


def fold_grid(dev, n_groups: int) -> tuple:
    """A 1-d workgroup count spread over x and y when it exceeds the device's per-axis limit
    (kernels rebuild the index as x + y * gl_NumWorkGroups.x)."""
    if n_groups <= 0:
        return (0, 0, 0)
    lim = dev.limits.max_workgroup_count[0]
    gx = min(n_groups, lim)
    return (gx, -(-n_groups // gx), 1)


def grid_for(dev, items: int, local: int = 64) -> tuple:
    """Workgroups covering `items` invocations of a 1-d kernel with `local` invocations each."""
    return fold_grid(dev, -(-items // local))
