"""How a program's values share buffers: decided from its schedule before anything is allocated,
so a traced function's memory is known (Traced.plan) before its program exists."""
from __future__ import annotations

import bisect
import math

from .graph import ITEMSIZE, reshape_base


def value_bytes(t) -> int:
    """Bytes of a tensor's buffer: whole 32-bit words (a float16 tensor of odd size rounds up)."""
    return -(-math.prod(t.shape) * ITEMSIZE[t.dtype] // 4) * 4


def buffer_slots(steps, outputs) -> tuple[dict, list]:
    """The buffers a program's steps get, decided without allocating any: (slot of each computed
    node's id, [(bytes, 'output' | 'temp')] per slot). Outputs (and what they alias through
    reshapes) keep slots of their own. A temporary lives from its step to its last reader's; the
    temporaries are placed largest first, each in the smallest slot no value alive at the same time
    holds, else in a new slot of its size (greedy by size, as TFLite's planner shares objects), so
    a slot's bytes are its first value's and the total comes near the peak of what is alive. int32
    values share only slots of exactly their size (a kernel may size its loop by the binding).
    Program allocates exactly these; Traced.plan sums them."""
    computed = {id(s.node) for s in steps if s.kind != "assign"}

    def owner(x):
        """The node whose slot x reads: x, or what it reshapes, down to a computed node (a reshape
        of a view is computed into a slot of its own)."""
        while x.op == "reshape" and id(x) not in computed:
            x = x.src[0]
        return id(x)
    out_ids = ({id(o) for o in outputs} | {id(reshape_base(o)) for o in outputs}
               | {owner(o) for o in outputs})
    last_use = {}
    for i, s in enumerate(steps):
        for x in s.inputs:
            last_use[owner(x)] = i
    slot_of, slots, temps = {}, [], []
    for i, s in enumerate(steps):
        if s.kind == "assign":
            continue
        if id(s.node) in out_ids:
            slot_of[id(s.node)] = len(slots)
            slots.append((value_bytes(s.node), "output"))
        else:
            temps.append((value_bytes(s.node), i, max(i, last_use.get(id(s.node), i)), id(s.node),
                          s.node.dtype == "int32"))
    # per slot: (starts, ends) of its values' lives, sorted, disjoint
    lives = [([], []) for _ in slots]
    for nb, start, end, key, exact in sorted(temps, key=lambda v: (-v[0], v[1])):
        for k in range(len(slots) - 1, -1, -1):         # newest first: the smallest slots
            size, kind = slots[k]
            if kind != ("temp-int32" if exact else "temp") or size < nb or (exact and size != nb):
                continue
            starts, ends = lives[k]
            j = bisect.bisect_right(starts, end)
            if j == 0 or ends[j - 1] < start:           # no value of this slot alive meanwhile
                starts.insert(j, start)
                ends.insert(j, end)
                break
        else:
            k = len(slots)
            slots.append((nb, "temp-int32" if exact else "temp"))
            lives.append(([start], [end]))
        slot_of[key] = k
    return slot_of, [(nb, "temp" if kind == "temp-int32" else kind) for nb, kind in slots]
