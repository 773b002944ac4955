"""vkdsl.Tensor: a lazy graph over a small closed set of primitives. Nothing runs until a
result is asked for (.numpy()); then the graph is scheduled into kernels (see schedule.py)."""
from __future__ import annotations

import math

import numpy as np

from . import precision, realize
from .graph import DTYPES, MatmulArg
from .shapes import ShapeError, axes_tuple, broadcast_shape, norm_axis, varargs  # noqa: F401


class Tensor:
    __slots__ = ("op", "src", "arg", "shape", "dtype", "buffer", "requires_grad", "grad", "name",
                 "backward", "__weakref__")

    def __init__(self, op, src=(), arg=None, shape=(), dtype="float32", buffer=None,
                 requires_grad=False, name=None):
        self.op, self.src, self.arg, self.dtype = op, tuple(src), arg, dtype
        self.shape = tuple(int(s) for s in shape)
        self.buffer, self.requires_grad, self.grad, self.name = buffer, requires_grad, None, name
        self.backward = None  # (sources, rule): an explicit gradient (vkdsl.autograd.with_gradient)

    # ---- construction -------------------------------------------------------------
    @staticmethod
    def from_numpy(a, requires_grad=False, name=None, device=None) -> "Tensor":
        a = np.asarray(a)
        if a.dtype.kind == "f":
            a = a.astype(np.float32, copy=False)
        elif a.dtype.kind in "iub":
            if a.size and (a.min() < -2**31 or a.max() >= 2**31):
                raise ValueError(f"integer tensor {name or ''} has values outside int32")
            a = a.astype(np.int32, copy=False)
        else:
            raise TypeError(f"vkdsl tensors hold float32 or int32; got numpy dtype {a.dtype}")
        return Tensor("buffer", shape=a.shape, dtype=DTYPES[a.dtype],
                      buffer=realize.upload(a, device, name), requires_grad=requires_grad,
                      name=name)

    @staticmethod
    def const(value: float, shape=()) -> "Tensor":
        c = Tensor("const", arg=float(value), shape=())
        return c.expand(shape) if tuple(shape) else c

    @staticmethod
    def arange(n: int) -> "Tensor":
        """0, 1, ..., n-1 as float32 (exact below 2**24), computed inside the consuming kernel."""
        if n > 2**24:
            raise ShapeError(f"arange({n}): float32 cannot hold indices above 2**24 exactly")
        return Tensor("iota", arg=n, shape=(n,))

    @staticmethod
    def zeros(shape) -> "Tensor":
        return Tensor.const(0.0, shape)

    # ---- properties -------------------------------------------------------------------
    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    @property
    def T(self):
        return self.transpose(-1, -2)

    def __repr__(self):
        grad = ", grad" if self.requires_grad else ""
        return f"Tensor({self.op}, shape={self.shape}, dtype={self.dtype}{grad})"

    def numpy(self) -> np.ndarray:
        return realize.realize([self])[0]

    def item(self) -> float:
        a = self.numpy()
        if a.size != 1:
            raise ShapeError(f"item() needs a 1-element tensor, got shape {self.shape}")
        return float(a.reshape(-1)[0])

    # ---- elementwise ------------------------------------------------------------------
    def _unary(self, op):
        self._need_float(op)
        return Tensor(op, (self,), shape=self.shape, requires_grad=self.requires_grad)

    def _need_float(self, op, i=1, storage_ok=True):
        """Arithmetic takes float32, and float16 storage read as fp32; kernels that bind their
        operands' buffers as fp32 (matmul, gather) take float32 only."""
        if self.dtype == "float16" and not storage_ok:
            raise TypeError(f"{op}: operand {i} is float16 storage {self.shape}; widen it with "
                            f".float() first")
        if self.dtype not in ("float32", "float16"):
            raise TypeError(f"{op}: expected a float32 tensor for operand {i}, got {self.dtype} "
                            f"{self.shape}")

    def half(self) -> "Tensor":
        """This value rounded to fp16 (round to nearest even) and stored in 16 bits where it is
        materialized: half the bytes of fp32 (needs the device's 16-bit storage)."""
        self._need_float("half")
        if self.dtype == "float16":
            return self
        return Tensor("cast", (self,), "float16", shape=self.shape, dtype="float16",
                      requires_grad=self.requires_grad)

    def float(self) -> "Tensor":
        """float16 storage widened to float32 (exact); a float32 tensor is returned as it is."""
        self._need_float("float")
        if self.dtype == "float32":
            return self
        return Tensor("cast", (self,), "float32", shape=self.shape,
                      requires_grad=self.requires_grad)

    def _binary(self, op, other, reverse=False):
        other = other if isinstance(other, Tensor) else Tensor.const(other)
        a, b = (other, self) if reverse else (self, other)
        if op not in ("cmplt", "cmpeq"):
            a._need_float(op, 1)
            b._need_float(op, 2)
        shape = broadcast_shape(a.shape, b.shape, what=op)
        return Tensor(op, (a.expand(shape), b.expand(shape)), shape=shape,
                      requires_grad=a.requires_grad or b.requires_grad)

    def __add__(self, o): return self._binary("add", o)
    def __radd__(self, o): return self._binary("add", o, True)
    def __sub__(self, o): return self._binary("sub", o)
    def __rsub__(self, o): return self._binary("sub", o, True)
    def __mul__(self, o): return self._binary("mul", o)
    def __rmul__(self, o): return self._binary("mul", o, True)
    def __truediv__(self, o): return self._binary("div", o)
    def __rtruediv__(self, o): return self._binary("div", o, True)
    def __neg__(self): return self._unary("neg")
    def __lt__(self, o): return self._binary("cmplt", o)
    def __gt__(self, o): return self._binary("cmplt", o, True)
    def eq(self, o): return self._binary("cmpeq", o)
    def maximum(self, o): return self._binary("max", o)
    def minimum(self, o): return -((-self).maximum(-o if isinstance(o, Tensor) else -o))
    def exp(self): return self._unary("exp")
    def log(self): return self._unary("log")
    def sqrt(self): return self._unary("sqrt")
    def rsqrt(self): return self._unary("rsqrt")
    def tanh(self): return self._unary("tanh")
    def sin(self): return self._unary("sin")
    def cos(self): return self._unary("cos")
    def reciprocal(self): return self._unary("recip")
    def relu(self): return self.maximum(0.0)
    def square(self): return self * self

    def where(self, x, y):
        """self != 0 ? x : y (self is the condition)."""
        x = x if isinstance(x, Tensor) else Tensor.const(x)
        y = y if isinstance(y, Tensor) else Tensor.const(y)
        x._need_float("where", 2)
        y._need_float("where", 3)
        shape = broadcast_shape(self.shape, x.shape, y.shape, what="where")
        return Tensor("where", (self.expand(shape), x.expand(shape), y.expand(shape)), shape=shape,
                      requires_grad=x.requires_grad or y.requires_grad)

    def contiguous(self):
        """Force this value into its own buffer (a fusion boundary)."""
        return Tensor("contiguous", (self,), shape=self.shape, dtype=self.dtype,
                      requires_grad=self.requires_grad)

    # ---- views ------------------------------------------------------------------------
    def reshape(self, *shape):
        shape = varargs(shape)
        if shape.count(-1) > 1:
            raise ShapeError(f"reshape {self.shape} -> {shape}: at most one -1")
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            if known == 0 or self.size % known:
                raise ShapeError(f"reshape {self.shape} -> {shape}: {self.size} elements "
                                 f"do not fit")
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.size or any(s < 0 for s in shape):
            raise ShapeError(f"reshape {self.shape} -> {shape}: {self.size} elements vs "
                             f"{math.prod(shape)}")
        if shape == self.shape:
            return self
        return Tensor("reshape", (self,), shape, shape=shape, dtype=self.dtype,
                      requires_grad=self.requires_grad)

    def permute(self, *axes):
        axes = varargs(axes)
        axes = tuple(norm_axis(a, self.ndim, "permute") for a in axes)
        if sorted(axes) != list(range(self.ndim)):
            raise ShapeError(f"permute: {axes} is not a permutation of the {self.ndim} axes of "
                             f"{self.shape}")
        if axes == tuple(range(self.ndim)):
            return self
        if self.op == "permute":  # compose: a permute of a permute is one permute
            return self.src[0].permute(tuple(self.arg[a] for a in axes))
        return Tensor("permute", (self,), axes, shape=tuple(self.shape[a] for a in axes),
                      dtype=self.dtype, requires_grad=self.requires_grad)

    def transpose(self, a=-1, b=-2):
        axes = list(range(self.ndim))
        a, b = norm_axis(a, self.ndim, "transpose"), norm_axis(b, self.ndim, "transpose")
        axes[a], axes[b] = axes[b], axes[a]
        return self.permute(axes)

    def expand(self, shape):
        shape = tuple(shape)
        if shape == self.shape:
            return self
        if len(shape) < self.ndim:
            raise ShapeError(f"expand {self.shape} -> {shape}: cannot drop axes")
        src = (self.reshape((1,) * (len(shape) - self.ndim) + self.shape) if len(shape) > self.ndim
               else self)
        for s, d in zip(src.shape, shape):
            if s != d and s != 1:
                raise ShapeError(f"expand {self.shape} -> {shape}: size {s} cannot grow to {d}")
        if src.shape == shape:
            return src
        return Tensor("expand", (src,), shape, shape=shape, dtype=self.dtype,
                      requires_grad=self.requires_grad)

    def __getitem__(self, idx):
        """Basic slicing with non-negative unit-step slices and integers."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        if Ellipsis in idx:
            at = idx.index(Ellipsis)
            idx = idx[:at] + (slice(None),) * (self.ndim - len(idx) + 1) + idx[at + 1:]
        if len(idx) > self.ndim:
            raise IndexError(f"{len(idx)} indices for a {self.ndim}-d tensor")
        starts, sizes, drop = [], [], []
        for d, s in enumerate(self.shape):
            i = idx[d] if d < len(idx) else slice(None)
            if isinstance(i, int):
                if not -s <= i < s:
                    raise IndexError(f"index {i} out of range for axis {d} of size {s}")
                starts.append(i % s); sizes.append(1); drop.append(d)
            elif isinstance(i, slice):
                a, b, st = i.indices(s)
                if st != 1:
                    raise ShapeError("only unit-step slices are supported")
                starts.append(a); sizes.append(max(b - a, 0))
            else:
                raise TypeError(f"unsupported index {i!r}")
        out = self
        if tuple(sizes) != self.shape:
            out = Tensor("slice", (self,), tuple(starts), shape=tuple(sizes), dtype=self.dtype,
                         requires_grad=self.requires_grad)
        return out.reshape(tuple(s for d, s in enumerate(sizes) if d not in drop)) if drop else out

    def pad(self, widths):
        """Zero padding: widths = ((before, after), ...) per axis."""
        widths = tuple((int(a), int(b)) for a, b in widths)
        if len(widths) != self.ndim or any(a < 0 or b < 0 for a, b in widths):
            raise ShapeError(f"pad: need one non-negative (before, after) per axis of "
                             f"{self.shape}, got {widths}")
        if all(a == 0 and b == 0 for a, b in widths):
            return self
        shape = tuple(s + a + b for s, (a, b) in zip(self.shape, widths))
        return Tensor("pad", (self,), widths, shape=shape, dtype=self.dtype,
                      requires_grad=self.requires_grad)

    # ---- reductions -------------------------------------------------------------------
    def _reduce(self, kind, axis=None, keepdim=False):
        self._need_float(kind)
        if axis is None:
            flat = self.reshape(-1) if self.ndim != 1 else self
            r = flat._reduce(kind, 0, keepdim=False)
            return r.reshape((1,) * self.ndim) if keepdim else r.reshape(())
        axes = sorted({norm_axis(a, self.ndim, kind) for a in axes_tuple(axis)}, reverse=True)
        out = self
        for ax in axes:
            if out.shape[ax] == 0 and kind != "sum":
                raise ShapeError(f"{kind} over an empty axis {ax} of shape {out.shape} "
                                 f"has no value")
            shape = out.shape[:ax] + (1,) + out.shape[ax + 1:]
            out = Tensor("reduce", (out,), (kind, ax), shape=shape, requires_grad=out.requires_grad)
        if not keepdim:
            out = out.reshape(tuple(s for d, s in enumerate(out.shape) if d not in axes))
        return out

    def sum(self, axis=None, keepdim=False): return self._reduce("sum", axis, keepdim)
    def max(self, axis=None, keepdim=False): return self._reduce("max", axis, keepdim)

    def mean(self, axis=None, keepdim=False):
        n = self.size if axis is None else math.prod(self.shape[norm_axis(a, self.ndim, "mean")]
                                                     for a in axes_tuple(axis))
        if n == 0:
            raise ShapeError(f"mean over zero elements of shape {self.shape}")
        return self.sum(axis, keepdim) * (1.0 / n)

    # ---- matmul and gather ---------------------------------------------------------------
    def matmul(self, other: "Tensor") -> "Tensor":
        return matmul(self, other)

    __matmul__ = matmul

    def gather(self, idx: "Tensor", base: int = 0, total: int | None = None) -> "Tensor":
        """Rows of a (V, D) table: out[i] = self[idx[i]] (embedding lookup); an index outside the
        table gives a NaN row. A table that is rows [base, base + V) of a larger one of `total`
        rows (a weight split over bindings) gives 0 for the other parts' rows, NaN outside total."""
        if self.ndim != 2:
            raise ShapeError(f"gather: the table must be 2-d (V, D), got {self.shape}")
        if idx.dtype != "int32":
            raise TypeError(f"gather: indices must be int32, got {idx.dtype}")
        self._need_float("gather", storage_ok=False)
        total = self.shape[0] if total is None else int(total)
        if base or total != self.shape[0]:
            if self.requires_grad:
                raise ValueError("gather: a part of a split table takes no gradient")
            if not 0 <= base <= total - self.shape[0]:
                raise ShapeError(f"gather: rows [{base}, {base + self.shape[0]}) do not lie in a "
                                 f"table of {total}")
            arg = (int(base), total)
        else:
            arg = None  # the whole table (one kernel source for every unsplit gather)
        return Tensor("gather", (self, idx), arg, shape=idx.shape + self.shape[1:],
                      requires_grad=self.requires_grad)

    # ---- in-place update (parameters, optimizer state) -------------------------------------
    def assign(self, value: "Tensor") -> "Tensor":
        """Write value into this realized tensor's buffer. Inside a trace the write happens at the
        end of each replay (reads in the traced function see the values from before the call)."""
        if self.op != "buffer":
            raise ValueError("assign() needs a realized tensor (one made by from_numpy or already "
                             "computed)")
        value = value if isinstance(value, Tensor) else Tensor.const(value, self.shape)
        if value.shape != self.shape:
            raise ShapeError(f"assign: value of shape {value.shape} into tensor of shape "
                             f"{self.shape}")
        if (value.dtype != self.dtype
            and not (value.op == "const" or value.op == "expand" and value.src[0].op == "const")):
            raise TypeError(f"assign: a {value.dtype} value into a {self.dtype} tensor "
                            f"{self.shape}: convert it (.half() / .float()) first")
        realize.assign(self, value)
        return self


SKINNY = 32          # outputs narrower than one register tile's 32 columns are computed transposed


def _peel_transpose(t: Tensor):
    """A last-two-axes transpose view costs nothing to matmul: pass a flag instead of copying."""
    if (t.op == "permute" and t.ndim >= 2
        and t.arg == tuple(range(t.ndim - 2)) + (t.ndim - 1, t.ndim - 2)):
        return t.src[0], True
    return t, False


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """(..., M, K) @ (..., K, N); batch axes broadcast. 1-d operands are not promoted."""
    a._need_float("matmul", 1, storage_ok=False)
    b._need_float("matmul", 2, storage_ok=False)
    if a.ndim < 2 or b.ndim < 2:
        raise ShapeError(f"matmul needs operands of at least 2 dims, got {a.shape} and {b.shape}")
    (M, K), (K2, N) = a.shape[-2:], b.shape[-2:]
    if K != K2:
        raise ShapeError(f"matmul: inner sizes differ: {a.shape} @ {b.shape} (K={K} vs {K2})")
    batch = broadcast_shape(a.shape[:-2], b.shape[:-2], what="matmul batch")
    out_shape = batch + (M, N)
    if M == 0 or N == 0:
        raise ShapeError(f"matmul: {a.shape} @ {b.shape} has a zero-length axis (M={M}, N={N}): "
                         f"nothing to compute")
    if K == 0:
        return Tensor.zeros(out_shape)
    if N < SKINNY and M >= 2 * N:
        # A product only a few columns wide (a LoRA x.A, its gradients) leaves most of a kernel
        # tile idle: compute C^T = B^T . A^T instead; transposes are flags, so this is free. On
        # lavapipe (384 x 576) . (576 x 8) takes 23 ms one way and 4.6 ms the other.
        return matmul(b.transpose(-1, -2), a.transpose(-1, -2)).transpose(-1, -2)
    # Operands are flattened to (B, M, K) / (B, K, N) with B = 1 meaning "shared across the batch".
    nb = math.prod(batch)

    def prep(t):
        lead = t.shape[:-2]
        if lead and math.prod(lead) > 1 and tuple((1,) * (len(batch) - len(lead)) + lead) != batch:
            t = t.expand(batch + t.shape[-2:])
        t, tr = _peel_transpose(t)
        return t, tr, (math.prod(t.shape[:-2]) if t.ndim > 2 else 1)
    a2, ta, ba = prep(a)
    b2, tb, bb = prep(b)
    return Tensor("matmul", (a2, b2), MatmulArg(ta, tb, nb, ba, bb, precision.current()),
                  shape=out_shape, requires_grad=a.requires_grad or b.requires_grad)
