"""Shared test helpers. Tests run on the real Vulkan device vkdsl picks (lavapipe in CI).

One helper per kind of check:
- nmse: the comparison (vkdsl.verify's: NaN/Inf must match the reference's);
- fd: central finite differences of a float64 reference, the one gradient reference;
- check_op: a traced op (seeded inputs, sentinel words past every output to catch out-of-bounds
  writes) against its float64 reference, gradients against fd;
- check_grads: eager autodiff of a composition of ops against fd.
The tiny model and its data are in tests/fixtures (synthetic.py, train_data.py); `tiny_model` is the
default one (seed 0), built once per session."""
import math
import os

import numpy as np
import pytest

GUARD = 256          # bytes of sentinel words past each output

# The suite runs the default kernel choices whatever this machine's `vkdsl tune` wrote (CI has no
# tuning file; tests that name kernels would see tuned tiles); test_tuning.py switches it back on.
os.environ["VKDSL_TUNING"] = "0"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny random model of tests/fixtures/synthetic.build_tiny (seed 0, tied, Q8_0 GGUF and an HF
    folder), built once for the session: read it, never write into its folder."""
    from fixtures.synthetic import build_tiny
    return build_tiny(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def dev():
    from vkdsl.runtime import open_device
    return open_device()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def nmse(y, ref):
    """The one comparison (vkdsl.verify.compare): NMSE over finite entries, inf on a non-finite mismatch."""
    from vkdsl.verify import nmse as measure
    return measure(np.asarray(y), np.asarray(ref, np.float64))


def fd(ref, xs, i, g, h=1e-6):
    """Central differences of sum(ref(*xs) * g) w.r.t. xs[i], in float64."""
    x = xs[i].astype(np.float64)
    out = np.zeros_like(x)
    args = [a.astype(np.float64) if a.dtype.kind == "f" else a for a in xs]
    for j in np.ndindex(x.shape):
        step = h * max(1.0, abs(x[j]))
        old = x[j]
        x[j] = old + step
        args[i] = x
        up = math.fsum((np.asarray(ref(*args), np.float64) * g).ravel())
        x[j] = old - step
        down = math.fsum((np.asarray(ref(*args), np.float64) * g).ravel())
        x[j] = old
        out[j] = (up - down) / (2 * step)
    return out


def check_op(fn, ref, inputs, limit, grad_of=(), grad_limit=1e-6, seed=0):
    """fn(*Tensors) -> Tensor on the device; ref(*float64 arrays) -> array, the reference.
    inputs: numpy arrays (float32 / int32). grad_of: indices of inputs whose gradient of
    sum(out * g), g seeded, is checked against finite differences of ref."""
    import vkdsl
    from vkdsl.autograd import grad
    arrays = [np.asarray(a) for a in inputs]
    want = np.asarray(ref(*[a.astype(np.float64) if a.dtype.kind == "f" else a for a in arrays]), np.float64)
    g = np.random.default_rng(seed).standard_normal(want.shape).astype(np.float32)
    leaves = [vkdsl.tensor(a, requires_grad=i in grad_of) for i, a in enumerate(arrays)]

    @vkdsl.trace(guard_bytes=GUARD)
    def program(gt):
        out = fn(*leaves)
        gs = grad(out, [leaves[i] for i in grad_of], upstream=gt) if grad_of else []
        return [out, *gs]
    out, *gs = program(g)
    prog = program.program(g)
    assert prog.guards_intact(), "a kernel wrote past the end of its output"
    err = nmse(out, want)
    assert err <= limit, f"forward NMSE {err:.3g} > {limit:.3g}"
    for i, got in zip(grad_of, gs):
        want_g = fd(ref, arrays, i, g.astype(np.float64))
        gerr = nmse(got, want_g)
        assert gerr <= grad_limit, f"gradient of input {i}: NMSE {gerr:.3g} vs finite differences > {grad_limit:.3g}"
    return out, gs


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def check_grads(build, ref, arrays, wrt, rng, scalar=False, limit=1e-8):
    """build(*Tensors) -> Tensor, run eagerly; ref(*float64 arrays). The forward and the gradients
    of sum(out * g) (g seeded from rng; scalar: out itself) w.r.t. inputs wrt against fd, by NMSE."""
    import vkdsl
    from vkdsl.autograd import grad
    y_ref = np.asarray(ref(*arrays))
    g = None if scalar else rng.standard_normal(y_ref.shape)
    ts = [vkdsl.tensor(a, requires_grad=(i in wrt)) for i, a in enumerate(arrays)]
    out = build(*ts)
    grads = grad(out, [ts[i] for i in wrt], upstream=None if scalar else vkdsl.tensor(g.astype(np.float32)))
    assert nmse(out.numpy(), y_ref) < limit, "forward"
    for i, gd in zip(wrt, grads):
        want = fd(ref, arrays, i, 1.0 if scalar else g)
        err = nmse(gd.numpy(), want)
        assert err < limit, f"gradient of input {i}: nmse {err:.2e}"
