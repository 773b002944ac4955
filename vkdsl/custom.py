"""Hand-written kernels as graph nodes. A CustomOp records its own dispatches into the
program's command buffer and states its own gradient; the scheduler treats it like matmul:
its sources get buffers, its output gets a buffer."""
from __future__ import annotations

from .tensor import Tensor


class CustomOp:
    name = "custom"

    def record(self, rec, out, srcs):
        """Dispatch into rec (a runtime.Recording): out and srcs are runtime Buffers."""
        raise NotImplementedError

    def backward(self, node: Tensor, g: Tensor, *srcs: Tensor):
        """One gradient per source (None where there is none)."""
        raise NotImplementedError(f"{self.name} has no gradient")


def custom(op: CustomOp, srcs, shape, dtype="float32", requires_grad=None) -> Tensor:
    srcs = tuple(srcs)
    rg = any(s.requires_grad for s in srcs) if requires_grad is None else requires_grad
    return Tensor("custom", srcs, op, shape=shape, dtype=dtype, requires_grad=rg)


def glsl_kernel(device, name: str, source: str, n_buffers: int, push_size: int = 0,
                local_size=(64, 1, 1)):
    """A hand-written GLSL compute shader (source text) as a kernel of device: compiled once (the
    SPIR-V cache and bundles apply) and its pipeline built once per device. Dispatch it from a
    CustomOp's record: rec.dispatch(kernel, [out, *srcs], groups, push_bytes)."""
    from .compiler import compile_glsl
    from .runtime import get_kernel
    return get_kernel(device, name, compile_glsl(name, source), n_buffers=n_buffers,
                      push_size=push_size, local_size=tuple(local_size))
