"""vkdsl: a traced tensor DSL that compiles to Vulkan compute."""
from .precision import matmul_precision
from .runtime import list_devices, open_device
from .tensor import ShapeError, Tensor
from .trace import trace

from .version import __version__  # noqa: F401


def tensor(a, requires_grad=False, name=None) -> Tensor:
    """A realized device tensor from a numpy array (float -> float32, integers -> int32)."""
    return Tensor.from_numpy(a, requires_grad=requires_grad, name=name)


__all__ = ["Tensor", "tensor", "trace", "open_device", "list_devices", "ShapeError",
           "matmul_precision"]
