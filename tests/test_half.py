"""float16 storage (Tensor.half / Tensor.float): values rounded to fp16 where they are stored, fp32
arithmetic on them everywhere else, and the generator's fp16 KV cache.

References: numpy's float32 -> float16 conversion (round to nearest even, overflow to inf) and
float64 sums of the rounded values; rounding must match exactly (IEEE conversion is correctly
rounded), sums to NMSE 1e-12 (fp32 accumulation). The fp16 KV cache against the fp32 one on the
same model: the cache's rounding (relative 2^-11 = 4.9e-4 per value) moves logits by about that
much; the test allows 1e-2 of the largest logit and asks for the same greedy tokens."""
import os
import subprocess
import sys

import numpy as np
import pytest

import vkdsl
from vkdsl.autograd import grad
from vkdsl.verify import nmse

SPECIALS = [65504.0, 65520.0, 1e6, -np.inf, np.nan, 2.0 ** -24, 2.0 ** -25, 1.0 + 2.0 ** -11, -0.0]


def values(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 5, shape)).astype(np.float32).reshape(-1)
    x[:len(SPECIALS)] = SPECIALS[:x.size]
    return x.reshape(shape)


@pytest.mark.parametrize("shape", [(1,), (3,), (7, 33), (4, 1024), (2, 3, 5)])   # odd sizes, vec4 and scalar kernels
def test_half_rounds_as_numpy_does_and_float_widens_exactly(shape):
    x = values(shape)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    h = vkdsl.tensor(x).half()
    got = h.numpy()
    assert got.dtype == np.float16 and got.shape == shape
    nan = np.isnan(want)                 # a NaN's payload is the driver's; that it is NaN is not
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))      # bit for bit, -0 too
    w = h.float().numpy()
    assert w.dtype == np.float32 and np.array_equal(w, want.astype(np.float32), equal_nan=True)


def test_a_cast_inside_a_fused_chain_rounds_even_when_nothing_is_stored():
    x = values((6, 64), 1)
    y = (vkdsl.tensor(x).half() * 3.0 + 1.0).numpy()          # fused: the fp16 value never hits memory
    assert y.dtype == np.float32
    with np.errstate(invalid="ignore", over="ignore"):
        want = x.astype(np.float16).astype(np.float32) * np.float32(3.0) + np.float32(1.0)
    assert np.array_equal(y, want, equal_nan=True)


def test_reductions_read_float16_storage():
    x = np.random.default_rng(2).standard_normal((9, 300)).astype(np.float32)
    h = vkdsl.tensor(x).half().contiguous()                     # a float16 buffer, read by the reduction
    got = h.sum(axis=1).numpy()
    assert nmse(got, x.astype(np.float16).astype(np.float64).sum(axis=1)) <= 1e-12


def test_arithmetic_is_float32_and_fp32_kernels_refuse_storage_in_one_line():
    h = vkdsl.tensor(np.ones((4, 4), np.float32)).half()
    assert (h + 1.0).dtype == "float32" and h.sum().dtype == "float32" and h.float().half() is not h
    with pytest.raises(TypeError, match=r"matmul: operand 1 is float16 storage \(4, 4\); widen it with .float\(\)"):
        h @ vkdsl.tensor(np.ones((4, 4), np.float32))
    with pytest.raises(TypeError, match="gather: operand 1 is float16 storage"):
        h.gather(vkdsl.tensor(np.array([0, 1])))
    target = vkdsl.tensor(np.zeros((4, 4), np.float32)).half()
    target.numpy()
    with pytest.raises(TypeError, match=r"assign: a float32 value into a float16 tensor \(4, 4\)"):
        target.assign(vkdsl.tensor(np.ones((4, 4), np.float32)) * 2.0)
    target.assign((h * 2.0).half())
    assert np.array_equal(target.numpy(), np.full((4, 4), 2.0, np.float16))


def test_the_gradient_passes_through_the_rounding():
    x = vkdsl.tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), requires_grad=True)
    g = np.arange(12, dtype=np.float32).reshape(3, 4)
    (gx,) = grad(x.half().float() * 2.0, [x], upstream=vkdsl.tensor(g))
    assert np.array_equal(gx.numpy(), 2.0 * g)


def test_a_device_without_16_bit_storage_refuses_in_one_line():
    code = "import numpy as np, vkdsl; vkdsl.tensor(np.ones(8, np.float32)).half().numpy()"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, VKDSL_PROFILE="minimal"))
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1].startswith("ValueError: elementwise_8: float16 tensors need 16-bit "
                                                        "storage (storageBuffer16BitAccess)")


def test_the_fp16_kv_cache_halves_the_cache_and_keeps_greedy_tokens(tmp_path):
    from fixtures import synthetic
    from vkdsl.models import load_model_files
    from vkdsl.models.generate import Generator
    from vkdsl.models.llama import Llama
    tiny = synthetic.build_tiny(tmp_path, seed=4)
    ck, _ = load_model_files(str(tiny.gguf_path))
    model = Llama(ck)
    ids = [5, 17, 200, 33, 9, 1, 2, 250, 44]
    out, logits, size = {}, {}, {}
    for dt in ("float32", "float16"):
        gen = Generator(model, 40, kv_dtype=dt)
        out[dt] = gen.generate(ids, 12, 0.0, 1.0, 0)[0]
        logits[dt] = np.concatenate([gen.logits_prefill(ids), gen.logits_step(out[dt][0], len(ids))[None]])
        size[dt] = gen.cache.nbytes()
    assert size["float16"] * 2 == size["float32"]
    assert out["float16"] == out["float32"]
    diff = np.abs(logits["float16"] - logits["float32"]).max()
    assert 0 < diff <= 1e-2 * np.abs(logits["float32"]).max()          # it really rounded, and only that much
    with pytest.raises(ValueError, match="KV cache dtype 'bfloat16'"):
        Generator(model, 40, kv_dtype="bfloat16")
