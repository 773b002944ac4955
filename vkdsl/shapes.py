"""Shape rules of vkdsl.Tensor: broadcasting, axis arguments and the error they raise."""
from __future__ import annotations


class ShapeError(ValueError):
    pass


def norm_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < max(ndim, 1):
        raise ShapeError(f"{what}: axis {axis} is out of range for a {ndim}-d tensor")
    return axis % max(ndim, 1)


def varargs(a: tuple) -> tuple:
    """f(2, 3) and f((2, 3)) alike."""
    return tuple(a[0]) if len(a) == 1 and isinstance(a[0], (tuple, list)) else tuple(a)


def axes_tuple(axis) -> tuple:
    return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


def broadcast_shape(*shapes, what="broadcast") -> tuple:
    nd = max(len(s) for s in shapes)
    out = []
    for dims in zip(*[(1,) * (nd - len(s)) + tuple(s) for s in shapes]):
        big = {d for d in dims if d != 1}
        if len(big) > 1:
            raise ShapeError(f"{what}: shapes {' and '.join(str(tuple(s)) for s in shapes)} do not "
                             f"broadcast (sizes {sorted(big)} meet on one axis)")
        out.append(big.pop() if big else 1)
    return tuple(out)
