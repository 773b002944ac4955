"""What a compute module asks of the device, read from its SPIR-V before a pipeline is built: the
workgroup size written into the shader (a user's `local_size_x = 512`, which no specialization
changes) and the bytes of its `shared` variables. A kernel whose needs exceed the device's limits
is refused naming the limit; a driver given one may fail or crash inside the dispatch.

Only the module's preamble is read (types, constants, decorations, globals come before the first
function), so this costs well under a millisecond a kernel."""
from __future__ import annotations

_MAGIC = 0x07230203
_OP_EXECUTION_MODE, _OP_TYPE_INT, _OP_TYPE_FLOAT = 16, 21, 22
_OP_TYPE_VECTOR, _OP_TYPE_MATRIX, _OP_TYPE_BOOL, _OP_TYPE_ARRAY = 23, 24, 20, 28
_OP_TYPE_STRUCT, _OP_TYPE_POINTER = 30, 32
_OP_CONSTANT, _OP_SPEC_CONSTANT, _OP_FUNCTION, _OP_VARIABLE, _OP_DECORATE = 43, 50, 54, 59, 71
_OP_SPEC_COMPOSITE = 51
_LOCAL_SIZE, _BUILTIN, _WORKGROUP_SIZE, _WORKGROUP = 17, 11, 25, 4


def needs(spirv: bytes) -> tuple[tuple[int, int, int] | None, int]:
    """(the workgroup size fixed in the module, or None when it comes from specialization
    constants; the bytes of workgroup-shared variables)."""
    n = len(spirv) // 4
    words = memoryview(spirv)[:4 * n].cast("I")     # no copy: only the preamble is read
    if n < 5 or words[0] != _MAGIC:
        raise ValueError(f"not a SPIR-V module ({len(spirv)} bytes"
                         + (f", first word {words[0]:#x})" if n else ")"))
    size: dict[int, int] = {}          # type id -> bytes
    const: dict[int, int] = {}         # constant id -> value (a spec constant's default)
    pointee: dict[int, int] = {}       # pointer type id -> pointee type id, Workgroup only
    spec_composites: set[int] = set()
    local, size_id, shared, i = None, None, 0, 5
    while i < n:
        count, op = words[i] >> 16, words[i] & 0xFFFF
        a = words[i + 1:i + count]
        if count == 0 or op == _OP_FUNCTION:
            break
        if op == _OP_EXECUTION_MODE and a[1] == _LOCAL_SIZE:
            local = tuple(a[2:5])
        elif op == _OP_DECORATE and a[1] == _BUILTIN and a[2] == _WORKGROUP_SIZE:
            size_id = a[0]             # gl_WorkGroupSize: it overrides LocalSize when present
        elif op == _OP_SPEC_COMPOSITE:
            spec_composites.add(a[1])
        elif op in (_OP_TYPE_INT, _OP_TYPE_FLOAT):
            size[a[0]] = a[1] // 8
        elif op == _OP_TYPE_BOOL:
            size[a[0]] = 4
        elif op in (_OP_TYPE_VECTOR, _OP_TYPE_MATRIX):
            size[a[0]] = size.get(a[1], 0) * a[2]
        elif op == _OP_TYPE_ARRAY:
            size[a[0]] = size.get(a[1], 0) * const.get(a[2], 0)
        elif op == _OP_TYPE_STRUCT:
            size[a[0]] = sum(size.get(m, 0) for m in a[1:])
        elif op == _OP_TYPE_POINTER and a[1] == _WORKGROUP:
            pointee[a[0]] = a[2]
        elif op in (_OP_CONSTANT, _OP_SPEC_CONSTANT) and len(a) >= 3:
            const[a[1]] = a[2]
        elif op == _OP_VARIABLE and a[2] == _WORKGROUP:
            shared += size.get(pointee.get(a[0], -1), 0)
        i += count
    # a specialized size is the one the pipeline passes, checked by the Kernel itself
    return (None if size_id in spec_composites else local), shared


def workgroup_beyond(local, limits) -> bool:
    """Whether a workgroup of this size exceeds the device's per-axis or total invocations."""
    return (local[0] * local[1] * local[2] > limits.max_workgroup_invocations
            or any(a > b for a, b in zip(local, limits.max_workgroup_size)))


def refuse_beyond(name: str, spirv: bytes, limits) -> None:
    """Raise ValueError naming the limit when the module's own workgroup size or shared memory
    exceeds the device's."""
    local, shared = needs(spirv)
    if local is not None and workgroup_beyond(local, limits):
        raise ValueError(f"kernel {name}: its shader fixes workgroup {local}, beyond the device's "
                         f"maxComputeWorkGroupSize {tuple(limits.max_workgroup_size)} / "
                         f"maxComputeWorkGroupInvocations {limits.max_workgroup_invocations}")
    if shared > limits.max_shared_memory:
        raise ValueError(f"kernel {name}: {shared} bytes of shared memory, beyond the device's "
                         f"maxComputeSharedMemorySize of {limits.max_shared_memory}")
