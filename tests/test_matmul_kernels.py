"""fp32 matmul kernels (vkdsl/matmul.py, kernels/matmul*.glsl) against numpy float64.

Every form (nn, nt, tn) x the variants (lvp: register-blocked, reading its operands as texel
buffers on a CPU driver, or as storage buffers ("lvp-storage", and on GPUs); gpu: shared-memory
tiles; all run on any device) x odd shapes that take each load width (VEC 8 / 4 / 1) and store
width, batched with broadcast operands, with sentinels after the output.
Run: pytest tests/test_matmul_kernels.py
"""

import numpy as np
import pytest

import vkdsl.matmul as mm
from vkdsl.handwritten import PushLayout, gpu_block
from vkdsl.matmul import PUSH, plan_matmul, record_matmul
from vkdsl.runtime import Buffer, Recording

SENTINEL = np.float32(-12345.5)
U32 = 2.0 ** -24            # unit roundoff of float32


def reference(a, b, ta, tb):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    a64 = np.swapaxes(a64, -1, -2) if ta else a64
    b64 = np.swapaxes(b64, -1, -2) if tb else b64
    return a64 @ b64, np.abs(a64) @ np.abs(b64)


def run(dev, M, N, K, ta=False, tb=False, variant=None, batch=None, bcast=None, seed=0):
    """C = op(A) . op(B) on the device; batch=None: 2-D; bcast='a'|'b': that operand is 2-D with
    batch stride 0; variant 'lvp-storage': the lvp kernel with storage-buffer loads. Returns
    (device result, float64 reference, |A|.|B| in float64, the plan)."""
    if variant == "lvp-storage":
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(mm, "texel_fits", lambda *a: False)
            return run(dev, M, N, K, ta, tb, "lvp", batch, bcast, seed)
    rng = np.random.default_rng(seed)
    nb = batch or 1
    sa, sb = ((K, M) if ta else (M, K)), ((N, K) if tb else (K, N))
    a = rng.standard_normal(((1 if bcast == "a" else nb),) + sa).astype(np.float32)
    b = rng.standard_normal(((1 if bcast == "b" else nb),) + sb).astype(np.float32)
    p = plan_matmul(dev, M=M, N=N, K=K, batch=nb, ta=ta, tb=tb, variant=variant,
                    batch_stride_a=0 if bcast == "a" else None, batch_stride_b=0 if bcast == "b" else None)
    A, B = Buffer(dev, a.nbytes), Buffer(dev, b.nbytes)
    A.write(a)
    B.write(b)
    n = nb * M * N
    C = Buffer(dev, 4 * (n + 64))            # 64 sentinel floats after the output
    C.write(np.full(n + 64, SENTINEL, np.float32))
    rec = Recording(dev, 1)
    record_matmul(rec, p, C, A, B)
    rec.submit_wait()
    rec.release()
    out = C.read(np.float32, n + 64)
    assert np.all(out[n:] == SENTINEL), f"{p.name} wrote past the end of C"
    ref, mag = reference(a, b, ta, tb)
    ref, mag = np.broadcast_to(ref, (nb, M, N)), np.broadcast_to(mag, (nb, M, N))
    got = out[:n].reshape(nb, M, N)
    return (got if batch else got[0]), (ref if batch else ref[0]), (mag if batch else mag[0]), p


def assert_close(got, ref, mag, K, name):
    # fp32 products summed in fp32, in any order: |error| <= gamma_K * sum_k |a_k b_k| with
    # gamma_K = K u / (1 - K u) (Higham, Accuracy and Stability, 3.1). The bound is rigorous, so any
    # excess is a bug (a wrong or missing term), not rounding.
    gamma = K * U32 / (1 - K * U32)
    assert np.all(np.isfinite(got)), f"{name}: non-finite output"
    excess = np.abs(got - ref) - gamma * mag - 1e-30
    assert excess.max() <= 0, f"{name}: error {np.abs(got - ref).max():.3g} beyond gamma_K bound"


FORMS = [(False, False), (False, True), (True, False)]
FORM_ID = {(False, False): "nn", (False, True): "nt", (True, False): "tn"}
# (M, N, K): 1s; primes; multiples of 8 (VEC 8), of 4 only (VEC 4); 1023 in each position;
# a tile-spanning 64^3
SHAPES = [(1, 1, 1), (3, 7, 5), (33, 40, 24), (12, 20, 12), (16, 24, 40), (7, 1023, 9), (1023, 3, 17),
          (5, 9, 1023), (64, 64, 64)]


VARIANTS = ["lvp", "lvp-storage", "gpu"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", FORMS, ids=lambda f: FORM_ID[f])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_forms(dev, variant, form, shape):
    M, N, K = shape
    got, ref, mag, p = run(dev, M, N, K, *form, variant=variant)
    assert variant[:3] in p.name and FORM_ID[form] in p.name
    assert ("_lvp_v" in p.name) == (variant == "lvp-storage" or (variant == "lvp" and dev.info.kind != "cpu"))
    assert_close(got, ref, mag, K, p.name)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", FORMS, ids=lambda f: FORM_ID[f])
@pytest.mark.parametrize("bcast", [None, "a", "b"])
def test_matmul_batched(dev, variant, form, bcast):
    got, ref, mag, p = run(dev, 20, 24, 16, *form, variant=variant, batch=3, bcast=bcast, seed=1)
    assert_close(got, ref, mag, 16, p.name)


@pytest.mark.parametrize("form", FORMS, ids=lambda f: FORM_ID[f])
def test_matmul_many_tiles(dev, form):
    # several workgroups in x and y, and the widest loads (VEC 8) on the default variant
    got, ref, mag, p = run(dev, 192, 520, 136, *form, seed=2)
    assert_close(got, ref, mag, 136, p.name)


def test_lvp_tiles_folded_past_the_workgroup_limit(dev):
    # the CPU kernel numbers its tiles row by row over a grid folded into y once x is full: a
    # 1 x 4 tile on 1024 x 4100 is 1,049,600 tiles, 131,200 workgroups of 8 (x stops at 65,535)
    M, N, K = 1024, 4100, 8
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    p = plan_matmul(dev, M=M, N=N, K=K, variant="lvp", tile=(1, 4))
    assert p.groups[1] > 1 and p.groups[0] <= dev.limits.max_workgroup_count[0]
    A, B, C = Buffer(dev, a.nbytes), Buffer(dev, b.nbytes), Buffer(dev, 4 * (M * N + 64))
    A.write(a)
    B.write(b)
    C.write(np.full(M * N + 64, SENTINEL, np.float32))
    rec = Recording(dev, 1)
    record_matmul(rec, p, C, A, B)
    rec.submit_wait()
    rec.release()
    out = C.read(np.float32, M * N + 64)
    assert np.all(out[M * N:] == SENTINEL), "stores past the end of C"
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert_close(out[:M * N].reshape(M, N), ref, np.abs(a).astype(np.float64) @ np.abs(b), K, p.name)


@pytest.mark.parametrize("variant", ["lvp", "gpu"])
def test_matmul_tt(dev, variant):
    # both operands transposed: not a training form, but the kernels take any TA/TB pair
    got, ref, mag, p = run(dev, 12, 20, 16, True, True, variant=variant, seed=4)
    assert "_tt_" in p.name
    assert_close(got, ref, mag, 16, p.name)


def test_variant_choice(dev):
    p = plan_matmul(dev, M=64, N=64, K=64)
    assert ("lvp" if dev.info.kind == "cpu" else "gpu") in p.name
    if dev.info.kind == "cpu":       # lavapipe: texel-buffer loads, vec4 where the shapes allow
        assert plan_matmul(dev, M=8, N=8, K=8).name.endswith("_t4s4")
        assert plan_matmul(dev, M=3, N=5, K=7).name.endswith("_t1s1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mm, "texel_fits", lambda *a: False)
        assert plan_matmul(dev, M=8, N=8, K=8, variant="lvp").name.endswith("_v8s4" if dev.limits.int64 else "_v4s4")
        assert plan_matmul(dev, M=3, N=5, K=7, variant="lvp").name.endswith("_v1s1")


def test_texel_loads_stop_at_the_device_limit(dev, monkeypatch):
    # an operand longer than maxTexelBufferElements falls back to storage-buffer loads
    if dev.info.kind != "cpu" or not dev.limits.max_texel_elements:
        pytest.skip("texel loads are a CPU-driver choice")
    lim = dev.limits.max_texel_elements
    assert "_lvp_t" in plan_matmul(dev, M=1, N=64, K=lim // 64).name
    assert "_lvp_v" in plan_matmul(dev, M=1, N=64, K=lim // 64 + 1).name


def test_without_int64_loads_are_vec4(dev, monkeypatch):
    # devices without shaderInt64 get vec4 loads at most; same results
    import vkdsl.handwritten as hw
    monkeypatch.setattr(hw, "has_int64", lambda d: False)
    for form in FORMS:
        got, ref, mag, p = run(dev, 16, 24, 40, *form, variant="lvp-storage", seed=3)
        assert "_v4" in p.name
        assert_close(got, ref, mag, 40, p.name)


def test_push_layout_matches_shader():
    # six uint32 in MatmulPush; PushLayout itself refuses a format the GLSL block does not match
    assert PUSH.size == 24
    with pytest.raises(AssertionError, match="declares 24"):
        PushLayout("<5I", "matmul_common.glsl")


def test_refuses_small_buffers_and_unknown_variant(dev):
    p = plan_matmul(dev, M=4, N=4, K=4)
    rec = Recording(dev, 1)
    small, ok = Buffer(dev, 32), Buffer(dev, 64)
    with pytest.raises(ValueError, match="buffer C"):
        record_matmul(rec, p, small, ok, ok)
    with pytest.raises(ValueError, match="buffer B"):
        record_matmul(rec, p, ok, ok, small)
    rec.release()
    with pytest.raises(ValueError, match="variant"):
        plan_matmul(dev, M=4, N=4, K=4, variant="cuda")
    over = dev.limits.max_workgroup_count[2] + 1         # refused at planning, with the shape
    with pytest.raises(ValueError, match=rf"matmul 32x8x8 batch {over}: .* exceed the device"):
        plan_matmul(dev, M=32, N=8, K=8, batch=over)


def test_empty_and_k0(dev):
    assert plan_matmul(dev, M=0, N=5, K=3).groups == (0, 0, 0)
    got, ref, mag, p = run(dev, 5, 6, 0)             # K = 0: C is all zeros
    assert np.all(got == 0)


@pytest.mark.parametrize("block", [128, 64, 32])
@pytest.mark.parametrize("form", FORMS + [(True, True)], ids=lambda f: FORM_ID.get(f, "tt"))
def test_every_gpu_block(dev, form, block):
    # each block of the shared-memory kernel (the shape rule alone picks 32 on shapes this small),
    # batched, with edges cut in both directions
    with gpu_block(block):
        got, ref, mag, p = run(dev, 133, 70, 45, *form, variant="gpu", batch=2, seed=block)
    assert p.name.endswith(f"_gpu{block}") and p.groups == (-(-70 // block), -(-133 // block), 2)
    assert_close(got, ref, mag, 45, p.name)
