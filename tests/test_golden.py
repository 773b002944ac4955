"""Tests for vkdsl.golden: the stored data, the loader's error paths, the generator's
determinism, and the reference functions against independent computations."""
from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vkdsl.golden import generate as G
from vkdsl.golden import reference as R
from vkdsl.golden import reference_train as T
from vkdsl.golden.dispatch import BACKWARD_OPS, OPS, evaluate
from vkdsl.golden.store import (DATA_ROOT, GoldenError, check_all, iter_cases, load_case,
                                load_manifest, sha256_file)

GOLDEN_DIR = Path(G.__file__).resolve().parent
REPO = GOLDEN_DIR.parent
V1 = DATA_ROOT / "v1"
f64 = np.float64

PHASE1_OPS = {"neg", "exp", "log", "sqrt", "rsqrt", "tanh", "add", "sub", "mul", "div",
              "maximum", "cmplt", "where", "sum", "max", "mean", "matmul", "permute", "gather",
              "fused_chain", "softmax", "log_softmax"}
PHASE2_OPS = {"cross_entropy", "lora_linear", "rmsnorm", "rope", "silu", "swiglu", "attention",
              "kl", "tmkl", "dpo", "adamw", "clip_grad_norm", "int4_roundtrip", "nf4_roundtrip",
              "dequant_q8_0", "dequant_q4_0", "dequant_q4_1"}


def cases(op=None):
    """Stored cases, optionally of one op."""
    return [c for c in iter_cases() if op is None or c["op"] == op]


def ids(c):
    """pytest id of a case parameter: its name."""
    return c["name"]


# =======================================================================================
# stored data and manifest
# =======================================================================================

def test_stored_files_match_manifest():
    man = load_manifest()
    assert man["version"] == 1 and man["generator"] == "golden/generate.py"
    assert check_all() == len(man["cases"]) > 150
    on_disk = {p.name for p in V1.glob("*.npz")}
    assert on_disk == {c["file"] for c in man["cases"]}, "stray or missing npz files"
    for c in man["cases"]:
        assert sha256_file(V1 / c["file"]) == c["sha256"]
        assert c["file"] == G.file_name(c["name"])


def test_case_contents_and_dtypes():
    for c in iter_cases():
        a = load_case(c)
        for k in c["inputs"]:
            assert a[k].dtype in (np.float32, np.int32, np.uint8), (c["name"], k, a[k].dtype)
        assert a["out"].dtype == np.float64, c["name"]
        grads = [k for k in c["outputs"] if k.startswith("grad_")]
        if c["op"] in BACKWARD_OPS:
            assert c["upstream"] == "gout" and a["gout"].shape == a["out"].shape
            assert a["gout"].dtype == np.float32 and grads
            for k in grads:
                src = "in" + k[len("grad_in"):]
                assert a[k].shape == a[src].shape and a[k].dtype == np.float64
        else:
            assert c["upstream"] is None and not grads


def test_every_op_has_cases_and_phase1_sizes():
    by_op = {}
    for c in iter_cases():
        by_op.setdefault(c["op"], []).append(c)
    assert set(by_op) == PHASE1_OPS | PHASE2_OPS
    for op in PHASE1_OPS:
        dims = set()
        for c in by_op[op]:
            for a in (v for k, v in load_case(c).items() if k.startswith("in")):
                dims.update(a.shape)
        assert {1, 3, 7, 33, 1023} <= dims, (op, sorted(dims))


def test_names_encode_op_and_shapes():
    for c in iter_cases():
        assert re.fullmatch(re.escape(c["op"]) + r"\[[^\]]+\]", c["name"]), c["name"]
    names = {c["name"] for c in cases()}
    for want in ["add[33x1023+1023]", "sum[33x1023,axis=1]", "matmul[tn,33x1023x7]",
                 "add[33x1+33x1023]", "add[0d+1023]", "add[3x1x7+1x33x7]",
                 "matmul[nn,batch=3,33x7x5]", "softmax[1x49152]", "log_softmax[7x33,-inf]"]:
        assert want in names


# =======================================================================================
# loader error paths: every GoldenError names the file, what was expected and found
# =======================================================================================

@pytest.fixture
def data_copy(tmp_path):
    """A writable copy of the v1 data; returns the root to pass to the loader."""
    shutil.copytree(V1, tmp_path / "v1")
    return tmp_path


def _case(root, name):
    return next(c for c in iter_cases(root=root) if c["name"] == name)


def test_corrupted_file_raises_naming_it(data_copy):
    c = _case(data_copy, "add[7x33+7x33]")
    path = Path(c["path"])
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01                        # one flipped bit inside the array data
    path.write_bytes(bytes(raw))
    with pytest.raises(GoldenError) as e:
        load_case(c)
    msg = str(e.value)
    assert c["file"] in msg and c["sha256"] in msg and hashlib.sha256(raw).hexdigest() in msg
    assert "expected" in msg and "found" in msg
    # the packaged original is untouched and still loads
    assert load_case(_case(None, "add[7x33+7x33]"))["in0"].shape == (7, 33)


def test_missing_file_raises_naming_it(data_copy):
    c = _case(data_copy, "sum[7,axis=0]")
    Path(c["path"]).unlink()
    with pytest.raises(GoldenError, match=re.escape(c["file"]) + ".*missing"):
        load_case(c)


def test_root_argument_without_path_key(data_copy):
    c = _case(data_copy, "neg[3]")
    bare = {k: v for k, v in c.items() if k != "path"}
    assert np.array_equal(load_case(bare, root=data_copy)["out"], -load_case(c)["in0"].astype(f64))
    (data_copy / "v1" / c["file"]).write_bytes(b"not an npz")
    with pytest.raises(GoldenError, match=re.escape(c["file"])):
        load_case(bare, root=data_copy)


def _rewrite_manifest(root, fn):
    path = root / "v1" / "manifest.json"
    man = json.loads(path.read_text())
    fn(man)
    path.write_text(json.dumps(man))
    return path


@pytest.mark.parametrize("mutate, pattern", [
    (lambda m: m["cases"][0].pop("sha256"), r"expected key 'sha256'"),
    (lambda m: m["cases"][0].update(sha256="abc"), r"expected a 64-hex-digit sha256, found 'abc'"),
    (lambda m: m["cases"][0].update(file="../evil.npz"), r"expected a plain \.npz file name"),
    (lambda m: m.update(version=2), r"expected version 1, found 2"),
    (lambda m: m["cases"].append(dict(m["cases"][0])), r"expected unique names"),
    (lambda m: m["cases"][0].update(params=[1]), r"expected 'params' of type"),
    (lambda m: m.pop("cases"), r"expected an object with a 'cases' list"),
])
def test_malformed_manifest_raises_naming_it(data_copy, mutate, pattern):
    path = _rewrite_manifest(data_copy, mutate)
    with pytest.raises(GoldenError, match=pattern) as e:
        load_manifest(root=data_copy)
    assert str(path) in str(e.value)


def test_manifest_not_json_or_missing(data_copy, tmp_path):
    path = data_copy / "v1" / "manifest.json"
    path.write_text("{not json")
    with pytest.raises(GoldenError, match=re.escape(str(path)) + ".*expected JSON"):
        load_manifest(root=data_copy)
    with pytest.raises(GoldenError, match="manifest.json: missing file"):
        load_manifest(root=tmp_path / "nowhere")


def test_wrong_arrays_in_file_raise(data_copy):
    c = _case(data_copy, "neg[3]")
    path = Path(c["path"])
    data = G.npz_bytes({"in0": np.zeros(3, np.float32)})           # no "out"
    path.write_bytes(data)
    c = {**c, "sha256": hashlib.sha256(data).hexdigest()}
    with pytest.raises(GoldenError, match=re.escape(c["file"]) + r".*expected arrays \['in0', 'out'\], found \['in0'\]"):
        load_case(c)


# =======================================================================================
# generator determinism, both entry points
# =======================================================================================

def _shas(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_generator_is_deterministic_and_matches_stored(tmp_path):
    G.generate(tmp_path / "a")
    subprocess.run([sys.executable, str(GOLDEN_DIR / "generate.py"), "--root", str(tmp_path / "b")],
                   check=True, capture_output=True, cwd=tmp_path)
    a, b, stored = _shas(tmp_path / "a" / "v1"), _shas(tmp_path / "b" / "v1"), _shas(V1)
    assert a == b, "two runs of the generator differ"
    diff = sorted(k for k in stored if stored[k] != a.get(k)) + sorted(set(a) - set(stored))
    assert not diff, ("regenerated files differ from golden/data/v1 (stale data? or a platform "
                      f"whose libm differs in the last float64 bit): {diff[:10]}")


def test_module_entry_point_check_mode():
    r = subprocess.run([sys.executable, "-m", "vkdsl.golden.generate", "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "up to date" in r.stdout, r.stdout + r.stderr


def test_golden_never_imports_vkdsl_core():
    import ast
    for py in GOLDEN_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.Import):
                assert not any(n.name.split(".")[0] == "vkdsl" for n in node.names), py.name
            elif isinstance(node, ast.ImportFrom):
                # absolute vkdsl imports, or relative ones climbing out of golden/, are banned
                assert node.level <= 1 and (node.level or not (node.module or "").startswith("vkdsl")), \
                    (py.name, node.module, node.level)
    # imported as a standalone package "golden", nothing named vkdsl may get loaded
    code = ("import sys; sys.path.insert(0, %r); import golden.generate, golden.store; "
            "bad = [m for m in sys.modules if m == 'vkdsl' or m.startswith('vkdsl.')]; "
            "assert not bad, bad" % str(REPO))
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


# =======================================================================================
# golden.elementary: platform-independent exp/log/... vs Python's math module
# =======================================================================================

def _ulps(got, want):
    want = np.asarray(want, f64)
    return float(np.max(np.abs(got - want) / np.spacing(np.abs(want))))


@pytest.mark.parametrize("fn, ref, make, max_ulps", [
    ("exp", math.exp, lambda r: r.uniform(-745, 709, 20000), 2),
    ("expm1", math.expm1, lambda r: r.uniform(-1, 1, 20000) * 10.0 ** r.uniform(-300, 2, 20000), 3),
    ("log", math.log, lambda r: 10.0 ** r.uniform(-307, 307, 20000), 2),
    ("log", math.log, lambda r: r.uniform(0.5, 2.0, 20000), 2),
    ("log1p", math.log1p, lambda r: r.uniform(-0.9, 1, 20000) * 10.0 ** r.uniform(-300, 0, 20000), 3),
    ("tanh", math.tanh, lambda r: r.uniform(-1, 1, 20000) * 10.0 ** r.uniform(-300, 1.5, 20000), 4),
    ("sigmoid", lambda v: 1.0 / (1.0 + math.exp(-v)), lambda r: r.uniform(-40, 40, 20000), 4),
    ("softplus", lambda v: max(v, 0.0) + math.log1p(math.exp(-abs(v))), lambda r: r.uniform(-800, 800, 20000), 4),
])
def test_elementary_vs_math(fn, ref, make, max_ulps):
    from vkdsl.golden import elementary as E
    x = make(rng0(40))
    assert _ulps(getattr(E, fn)(x), [ref(v) for v in x]) <= max_ulps


def test_elementary_sincos_pow_and_special_values():
    from vkdsl.golden import elementary as E
    a = rng0(41).uniform(-5000, 5000, 20000)
    assert np.max(np.abs(E.sin(a) - [math.sin(v) for v in a])) < 4e-16
    assert np.max(np.abs(E.cos(a) - [math.cos(v) for v in a])) < 4e-16
    y = rng0(42).uniform(-12, 0, 2000)
    np.testing.assert_allclose(E.pow_pos(1e5, y), [math.pow(1e5, v) for v in y], rtol=3e-14)
    assert E.exp(np.array([-np.inf, 0.0, 710.0])).tolist() == [0.0, 1.0, np.inf]
    assert E.log(np.array([0.0, np.inf, 1.0])).tolist() == [-np.inf, np.inf, 0.0]
    assert np.isnan(E.log(np.array([-1.0])))[0]
    assert E.tanh(np.array([0.0, 25.0, -25.0])).tolist() == [0.0, 1.0, -1.0]
    assert E.sigmoid(np.array([-800.0, 0.0, 800.0])).tolist() == [0.0, 0.5, 1.0]


def test_references_avoid_cpu_dependent_numpy_math():
    # numpy's exp/log/tanh/power pick SIMD code per CPU and differ in the last bit between
    # machines; the references must go through golden.elementary to stay byte-reproducible
    pat = re.compile(r"np\.(exp|expm1|log|log1p|log2|tanh|sinh|cosh|sin|cos|tan|power|logaddexp)\(|[\w)\]]\s*\*\*")  # binary **, not **kwargs
    for name in ["reference.py", "reference_train.py", "dispatch.py"]:
        for ln, line in enumerate((GOLDEN_DIR / name).read_text().splitlines(), 1):
            code = line.split("#")[0]
            if '"""' not in code:
                assert not pat.search(code), f"{name}:{ln}: {line.strip()}"


# =======================================================================================
# phase 1 references vs independent computations
# =======================================================================================

MATH1 = {"neg": lambda v: -v, "exp": math.exp, "log": math.log, "sqrt": math.sqrt,
         "rsqrt": lambda v: 1.0 / math.sqrt(v), "tanh": math.tanh}
PY2 = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
       "div": lambda a, b: a / b, "maximum": max, "cmplt": lambda a, b: 1.0 if a < b else 0.0}


def _close(got, want, rel=1e-14):
    want = np.asarray(want, f64)
    np.testing.assert_allclose(got, want, rtol=rel, atol=0)


@pytest.mark.parametrize("c", [c for c in cases() if c["op"] in MATH1], ids=ids)
def test_unary_vs_math(c):
    a = load_case(c)
    want = np.vectorize(MATH1[c["op"]], otypes=[f64])(a["in0"].astype(f64))
    _close(a["out"], want, 4e-16 if c["op"] in ("neg", "sqrt") else 1e-15)


@pytest.mark.parametrize("c", [c for c in cases() if c["op"] in PY2 or c["op"] == "where"], ids=ids)
def test_binary_where_vs_python_scalars(c):
    a = load_case(c)
    ins = np.broadcast_arrays(*[a[k].astype(f64) for k in c["inputs"]])
    if c["op"] == "where":
        fn = lambda cnd, x, y: x if cnd != 0 else y  # noqa: E731
    else:
        fn = PY2[c["op"]]
    want = np.array([fn(*map(float, t)) for t in zip(*(x.ravel() for x in ins))]).reshape(ins[0].shape)
    assert a["out"].shape == want.shape
    assert np.array_equal(a["out"], want)   # +,-,*,/ in float64 are exactly the IEEE ops


def test_cmplt_has_no_ties_and_ulp_case_is_exact():
    for c in cases("cmplt"):
        a = load_case(c)
        assert not np.any(np.broadcast_arrays(a["in0"], a["in1"])[0] == np.broadcast_arrays(a["in0"], a["in1"])[1])
    a = load_case(_case(None, "cmplt[1023+1023,ulp]"))
    assert np.array_equal(a["out"], (a["in1"] > a["in0"]).astype(f64))
    assert 0.3 < a["out"].mean() < 0.7


@pytest.mark.parametrize("c", [c for c in cases() if c["op"] in ("sum", "max", "mean")], ids=ids)
def test_reductions_vs_fsum_loops(c):
    a = load_case(c)
    x = np.moveaxis(a["in0"].astype(f64), c["params"]["axis"], -1)
    rows = x.reshape(-1, x.shape[-1])
    fn = {"sum": math.fsum, "max": max, "mean": lambda r: math.fsum(r) / len(r)}[c["op"]]
    want = np.array([fn(list(r)) for r in rows]).reshape(x.shape[:-1])
    assert np.array_equal(a["out"], want)


def test_reductions_vs_numpy_and_divide_exactness():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 6, 7))
    for ax in range(3):
        _close(R.reduce_sum(x, ax), np.sum(x, ax), 1e-12)
        _close(R.reduce_mean(x, ax), np.mean(x, ax), 1e-12)
        assert np.array_equal(R.reduce_max(x, ax), np.max(x, ax))
    # fsum is exact where naive float64 summation is not
    assert float(R.exact_sum(np.array([1e16, 1.0, -1e16]))) == 1.0


@pytest.mark.parametrize("c", cases("matmul"), ids=ids)
def test_matmul_vs_einsum(c):
    a = load_case(c)
    A, B = a["in0"].astype(f64), a["in1"].astype(f64)
    p = c["params"]
    sa = "bkm" if p["ta"] else "bmk"
    sb = "bnk" if p["tb"] else "bkn"
    if not p.get("batch"):
        sa, sb = sa[1:], sb[1:]
    spec = f"{sa},{sb}->{'b' if p.get('batch') else ''}mn"
    want = np.einsum(spec, A, B)
    bound = np.einsum(spec, np.abs(A), np.abs(B)) * 1e-13   # einsum's own rounding
    assert a["out"].shape == want.shape
    assert np.all(np.abs(a["out"] - want) <= bound + 1e-300)


def test_matmul_transposes_are_layouts_not_values():
    rng = np.random.default_rng(1)
    A, B = rng.standard_normal((3, 5)), rng.standard_normal((5, 4))
    ref = R.matmul(A, B)
    assert np.array_equal(R.matmul(A.T.copy(), B, ta=True), ref)
    assert np.array_equal(R.matmul(A, B.T.copy(), tb=True), ref)
    assert np.array_equal(R.matmul(A.T.copy(), B.T.copy(), ta=True, tb=True), ref)


@pytest.mark.parametrize("c", cases("permute") + cases("gather"), ids=ids)
def test_permute_and_gather_by_index_loops(c):
    a = load_case(c)
    x = a["in0"].astype(f64)
    if c["op"] == "permute":
        axes = c["params"]["axes"]
        assert a["out"].shape == tuple(x.shape[i] for i in axes)
        for idx in np.ndindex(a["out"].shape):
            src = [0] * x.ndim
            for i, ax in enumerate(axes):
                src[ax] = idx[i]
            assert a["out"][idx] == x[tuple(src)]
    else:
        for r, i in enumerate(a["in1"]):
            assert np.array_equal(a["out"][r], x[int(i)])


def test_fused_chain_vs_math():
    c = _case(None, "fused_chain[33x1023+1023+33x1]")
    a = load_case(c)
    A, B, C = np.broadcast_arrays(*(a[k].astype(f64) for k in c["inputs"]))
    want = [math.tanh(x * y + z) - math.exp(-x) for x, y, z in zip(A.ravel(), B.ravel(), C.ravel())]
    np.testing.assert_allclose(a["out"].ravel(), want, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("c", cases("softmax") + cases("log_softmax"), ids=ids)
def test_softmax_properties(c):
    a = load_case(c)
    x = a["in0"].astype(f64)
    p = a["out"] if c["op"] == "softmax" else np.exp(a["out"])
    assert np.all(np.abs([math.fsum(r) - 1.0 for r in p]) < 1e-14)     # rows sum to 1
    assert np.all(p[np.isneginf(x)] == 0.0)
    if c["op"] == "log_softmax":
        assert np.array_equal(np.isneginf(a["out"]), np.isneginf(x))
    # independent per-row: p_j = 1 / sum_k exp(x_k - x_j), exact sums
    for r in range(min(x.shape[0], 3)):
        row = x[r]
        fin = np.isfinite(row)
        j = int(np.argmax(row))
        want = 1.0 / math.fsum(math.exp(v - row[j]) for v in row[fin])
        _close(p[r, j], want, 1e-13)


# =======================================================================================
# phase 2: closed-form gradients vs central finite differences (float64, ~1e-6 relative)
# =======================================================================================

def _loss(fn, g):
    """Scalar L = sum(out * g), summed exactly."""
    out = np.asarray(fn(), f64)
    return math.fsum((out * g).ravel().tolist())


def fd_check(fn, x, analytic, g, rel=1e-6):
    """Central differences of sum(fn() * g) w.r.t. every element of x (mutated in place)."""
    fd = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        h = 1e-6 * max(1.0, abs(x[i]))
        old = x[i]
        x[i] = old + h
        lp = _loss(fn, g)
        x[i] = old - h
        lm = _loss(fn, g)
        x[i] = old
        fd[i] = (lp - lm) / (2 * h)
    scale = max(np.max(np.abs(analytic)), np.max(np.abs(fd)))
    assert scale > 0
    err = np.max(np.abs(fd - analytic))
    assert err <= rel * scale, f"max |fd - analytic| = {err:.3e}, scale {scale:.3e}"


rng0 = np.random.default_rng


def test_fd_cross_entropy():
    r = rng0(10)
    x, lab, g = r.standard_normal((4, 5)) * 2, np.array([1, -100, 0, 4]), np.float64(1.3)
    fd_check(lambda: T.cross_entropy(x, lab)[0], x, T.cross_entropy_backward(x, lab, g), g)


def test_fd_lora_linear():
    r = rng0(11)
    ins = [r.standard_normal(s) for s in [(3, 5), (5, 4), (5, 2), (2, 4)]]
    g = r.standard_normal((3, 4))
    grads = T.lora_linear_backward(*ins, 0.7, g)
    for x, gr in zip(ins, grads):
        fd_check(lambda: T.lora_linear(*ins, 0.7), x, gr, g)


def test_fd_rmsnorm():
    r = rng0(12)
    x, w, g = r.standard_normal((3, 5)), r.uniform(0.5, 1.5, 5), r.standard_normal((3, 5))
    dx, dw = T.rmsnorm_backward(x, w, 1e-5, g)
    fd_check(lambda: T.rmsnorm(x, w, 1e-5), x, dx, g)
    fd_check(lambda: T.rmsnorm(x, w, 1e-5), w, dw, g)


def test_fd_rope():
    r = rng0(13)
    x, pos, g = r.standard_normal((3, 2, 6)), np.array([0, 1, 7]), r.standard_normal((3, 2, 6))
    fd_check(lambda: T.rope(x, pos, 100.0), x, T.rope_backward(x, pos, 100.0, g), g)


def test_fd_silu_swiglu():
    r = rng0(14)
    x, u, g = r.standard_normal((3, 4)) * 3, r.standard_normal((3, 4)), r.standard_normal((3, 4))
    fd_check(lambda: T.silu(x), x, T.silu_backward(x, g), g)
    dgate, dup = T.swiglu_backward(x, u, g)
    fd_check(lambda: T.swiglu(x, u), x, dgate, g)
    fd_check(lambda: T.swiglu(x, u), u, dup, g)


def test_fd_attention_gqa():
    r = rng0(15)
    q, k, v = r.standard_normal((4, 4, 3)), r.standard_normal((4, 2, 3)), r.standard_normal((4, 2, 3))
    g = r.standard_normal((4, 4, 3))
    for x, gr in zip((q, k, v), T.attention_backward(q, k, v, g)):
        fd_check(lambda: T.attention(q, k, v), x, gr, g)


def test_fd_kl_tmkl():
    r = rng0(16)
    lp, lq, g = r.standard_normal((3, 5)) * 2, r.standard_normal((3, 5)) * 2, np.float64(0.8)
    for x, gr in zip((lp, lq), T.kl_backward(lp, lq, g)):
        fd_check(lambda: T.kl(lp, lq)[0], x, gr, g)
    lab = np.array([2, -100, 0, 4])
    a, b = r.standard_normal((4, 5)) * 2, r.standard_normal((4, 5)) * 2
    for x, gr in zip((a, b), T.tmkl_backward(a, b, lab, g)):
        fd_check(lambda: T.tmkl(a, b, lab)[0], x, gr, g)


def test_fd_dpo_and_sequence_logprob():
    r = rng0(17)
    ins = [-r.uniform(5, 30, 3) for _ in range(4)]
    g = np.float64(1.1)
    for x, gr in zip(ins, T.dpo_backward(*ins, 0.3, g)):
        fd_check(lambda: T.dpo(*ins, 0.3)[0], x, gr, g)
    logits, lab, gs = r.standard_normal((2, 3, 5)), np.array([[1, -100, 4], [-100, 0, 2]]), r.standard_normal(2)
    fd_check(lambda: T.sequence_logprob(logits, lab), logits,
             T.sequence_logprob_backward(logits, lab, gs), gs)


def test_stored_phase2_gradients_match_fd_on_small_cases():
    # the stored grad arrays themselves, against FD of the stored forward (small cases only)
    for name in ["cross_entropy[7x33]", "kl[7x33]", "tmkl[7x33]", "dpo[n=5]",
                 "lora_linear[7x33x17,r=4]", "rmsnorm[7x33]", "rope[5x2x8,pos=mixed]",
                 "swiglu[7x33]", "attention[7x6x16,kv=2]"]:
        c = _case(None, name)
        a = load_case(c)
        ins = [a[k].astype(f64) if a[k].dtype == np.float32 else a[k] for k in c["inputs"]]
        g = a["gout"].astype(f64)
        for i, x in enumerate(ins):
            if f"grad_in{i}" not in a:
                continue
            # one random direction per input keeps this cheap: d/dt L(x + t*u) = <grad, u>
            u = rng0(i).standard_normal(x.shape)
            h = 1e-6
            lp = _loss(lambda: evaluate(c["op"], [*ins[:i], x + h * u, *ins[i + 1:]], c["params"], g)["out"], g)
            lm = _loss(lambda: evaluate(c["op"], [*ins[:i], x - h * u, *ins[i + 1:]], c["params"], g)["out"], g)
            want = math.fsum((a[f"grad_in{i}"] * u).ravel().tolist())
            assert abs((lp - lm) / (2 * h) - want) <= 1e-6 * max(1e-3, abs(want)), (name, i)


# =======================================================================================
# phase 2 forward references vs independent computations
# =======================================================================================

def test_dpo_policy_equals_reference_is_ln2():
    pc, pr = np.array([-12.0, -40.0, -3.5]), np.array([-20.0, -8.0, -3.6])
    loss, rows = T.dpo(pc, pr, pc, pr, beta=0.1)
    assert abs(float(loss) - math.log(2)) < 1e-15 and np.allclose(rows, math.log(2), rtol=0, atol=1e-15)
    assert abs(float(load_case(_case(None, "dpo[n=3,policy=ref]"))["out"]) - 0.693147) < 1e-6
    # a far-apart margin stays finite (softplus, not log(sigmoid))
    big, _ = T.dpo(np.array([0.0]), np.array([-1e4]), np.array([-1e4]), np.array([0.0]), 1.0)
    assert float(big) < 1e-300 or float(big) == 0.0
    worse, _ = T.dpo(np.array([-1e4]), np.array([0.0]), np.array([0.0]), np.array([-1e4]), 1.0)
    assert float(worse) == 2e4


def test_cross_entropy_vs_loops_and_errors():
    r = rng0(20)
    x, lab = r.standard_normal((5, 7)) * 3, np.array([0, -100, 6, 3, -100])
    loss, rows = T.cross_entropy(x, lab)
    want = [math.log(math.fsum(math.exp(v) for v in x[i])) - x[i, lab[i]] for i in (0, 2, 3)]
    assert abs(float(loss) - math.fsum(want) / 3) < 1e-14
    assert rows[1] == rows[4] == 0.0
    with pytest.raises(ValueError, match="no supervised"):
        T.cross_entropy(x, np.full(5, -100))
    with pytest.raises(ValueError, match="no supervised"):
        T.tmkl(x, x, np.full(5, -100))
    with pytest.raises(ValueError, match="labels must be"):
        T.cross_entropy(x, np.array([0, 7, 1, 1, 1]))


def test_lora_at_init_is_base_and_da_is_zero():
    a = load_case(_case(None, "lora_linear[7x33x17,r=4,B=0]"))
    x, w = a["in0"].astype(f64), a["in1"].astype(f64)
    np.testing.assert_allclose(a["out"], x @ w, rtol=1e-12, atol=1e-12)
    assert np.all(a["grad_in2"] == 0.0) and np.any(a["grad_in3"] != 0.0)
    np.testing.assert_allclose(a["grad_in1"], x.T @ a["gout"].astype(f64), rtol=1e-12, atol=1e-12)


def test_rmsnorm_vs_loops():
    r = rng0(21)
    x, w = r.standard_normal((2, 9)), r.uniform(0.5, 1.5, 9)
    y = T.rmsnorm(x, w, 1e-5)
    for i in range(2):
        inv = 1.0 / math.sqrt(math.fsum(v * v for v in x[i]) / 9 + 1e-5)
        _close(y[i], [x[i, j] * inv * w[j] for j in range(9)], 1e-15)


def test_rope_is_complex_rotation_and_matches_hf_after_gguf_permutation():
    r = rng0(22)
    T_, H, D, base = 4, 2, 8, 10000.0
    x, pos = r.standard_normal((T_, H, D)), np.array([0, 1, 5, 1000])
    y = T.rope(x, pos, base)
    # complex view: (x[2i] + i x[2i+1]) * exp(i * pos * base^(-2i/D))
    z = x[..., 0::2] + 1j * x[..., 1::2]
    ang = pos[:, None, None] * base ** (-2.0 * np.arange(D // 2) / D)
    w = z * np.exp(1j * ang)
    np.testing.assert_allclose(y[..., 0::2], w.real, atol=1e-14)
    np.testing.assert_allclose(y[..., 1::2], w.imag, atol=1e-14)
    assert np.array_equal(y[0], x[0])                      # position 0 is the identity
    # GGUF row 2i + j holds HF row (D/2) j + i; HF rotates halves (rotate_half)
    perm = np.array([(D // 2) * j + i for i in range(D // 2) for j in range(2)])
    xh = r.standard_normal((T_, H, D))
    c, s = np.cos(ang), np.sin(ang)
    lo, hi = xh[..., : D // 2], xh[..., D // 2:]
    yh = np.concatenate([lo * c - hi * s, hi * c + lo * s], -1)
    np.testing.assert_allclose(T.rope(xh[..., perm], pos, base), yh[..., perm], atol=1e-13)


def test_attention_vs_naive_loops_and_gqa_equals_repeated_heads():
    r = rng0(23)
    q, k, v = r.standard_normal((5, 4, 3)), r.standard_normal((5, 2, 3)), r.standard_normal((5, 2, 3))
    out = T.attention(q, k, v)
    for t in range(5):
        for h in range(4):
            kv = h // 2
            s = [math.fsum(q[t, h] * k[j, kv]) / math.sqrt(3) for j in range(t + 1)]
            e = [math.exp(si - max(s)) for si in s]
            o = [math.fsum(e[j] * v[j, kv, d] for j in range(t + 1)) / math.fsum(e) for d in range(3)]
            np.testing.assert_allclose(out[t, h], o, rtol=1e-13, atol=1e-14)
    rep = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)     # HF repeat_kv order
    np.testing.assert_allclose(T.attention(q, *rep), out, rtol=1e-14, atol=1e-15)


def test_kl_and_tmkl_vs_explicit_removal():
    r = rng0(24)
    a, b = r.standard_normal((4, 6)) * 2, r.standard_normal((4, 6)) * 2
    sm = lambda z: np.exp(z - z.max()) / np.exp(z - z.max()).sum()  # noqa: E731
    kl_rows = [sum(pi * math.log(pi / qi) for pi, qi in zip(sm(a[i]), sm(b[i]))) for i in range(4)]
    np.testing.assert_allclose(T.kl(a, b)[1], kl_rows, rtol=1e-12)
    assert abs(float(T.kl(a, a)[0])) < 1e-15 and np.all(T.kl(a, b)[1] > 0)
    lab = np.array([3, -100, 0, 5])
    want = []
    for i in (0, 2, 3):
        p, q = sm(np.delete(a[i], lab[i])), sm(np.delete(b[i], lab[i]))
        want.append(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)))
    loss, rows = T.tmkl(a, b, lab)
    np.testing.assert_allclose(float(loss), np.mean(want), rtol=1e-12)
    assert rows[1] == 0.0
    # only the target logit differs: TMKL is exactly zero
    b2 = a.copy()
    b2[0, 3] += 5.0
    assert float(T.tmkl(a[:1], b2[:1], lab[:1])[0]) < 1e-15


def _adamw_torch_style(p, g, m, v, t, lr, b1, b2, eps, wd):
    """Scalar loop written the way torch.optim.AdamW (foreach=False) computes it."""
    p, m, v = p.copy(), m.copy(), v.copy()
    for i in range(p.size):
        p.flat[i] *= 1 - lr * wd
        m.flat[i] = m.flat[i] * b1 + g.flat[i] * (1 - b1)
        v.flat[i] = v.flat[i] * b2 + g.flat[i] * g.flat[i] * (1 - b2)
        denom = math.sqrt(v.flat[i]) / math.sqrt(1 - b2 ** t) + eps
        p.flat[i] -= (lr / (1 - b1 ** t)) * m.flat[i] / denom
    return p, m, v


def test_adamw_vs_torch_style_loop():
    r = rng0(25)
    p, m, v = r.standard_normal(20), np.zeros(20), np.zeros(20)
    pw, mw, vw = p.copy(), m.copy(), v.copy()
    for t in range(1, 6):
        g = r.standard_normal(20)
        p, m, v = T.adamw(p, g, m, v, t, 1e-2, 0.9, 0.99, 1e-8, 0.1)
        pw, mw, vw = _adamw_torch_style(pw, g, mw, vw, t, 1e-2, 0.9, 0.99, 1e-8, 0.1)
    np.testing.assert_allclose(p, pw, rtol=1e-13)
    np.testing.assert_allclose(m, mw, rtol=1e-13)
    np.testing.assert_allclose(v, vw, rtol=1e-13)
    # first step from zero moments: bias correction makes the step lr * g / (|g| + eps)
    a = load_case(_case(None, "adamw[33x17,step=1]"))
    x, g = a["in0"].astype(f64), a["in1"].astype(f64)
    np.testing.assert_allclose(a["out"], x * (1 - 1e-5) - 1e-3 * g / (np.abs(g) + 1e-8),
                               rtol=0, atol=1e-15)
    assert np.allclose(a["out_m"], 0.1 * g, rtol=1e-15) and np.allclose(a["out_v"], 0.001 * g * g, rtol=1e-15)


def test_clip_grad_norm():
    r = rng0(26)
    gs = [r.standard_normal((3, 4)), r.standard_normal(5)]
    norm = float(np.linalg.norm(np.concatenate([g.ravel() for g in gs])))
    clipped, n = T.clip_grad_norm(gs, 1.0)
    assert abs(float(n) - norm) < 1e-13
    new = float(np.linalg.norm(np.concatenate([g.ravel() for g in clipped])))
    assert abs(new - norm / (norm + 1e-6)) < 1e-12                 # torch's eps
    same, _ = T.clip_grad_norm(gs, 100.0)
    assert all(np.array_equal(a, b) for a, b in zip(same, gs))


# =======================================================================================
# quantization
# =======================================================================================

def test_nibble_packing_layout():
    codes = np.array([[-8, 7, 0, -1, 3, -3]])
    packed = T.pack_nibbles(codes)
    assert packed.tolist() == [[0x78, 0xF0, 0xD3]]      # low nibble = even element
    assert T.unpack_nibbles(packed, signed=True).tolist() == codes.tolist()


@pytest.mark.parametrize("c", cases("int4_roundtrip"), ids=ids)
def test_int4_roundtrip(c):
    a = load_case(c)
    x = a["in0"].astype(f64)
    xg = x.reshape(x.shape[0], -1, 64)
    assert np.array_equal(a["out_scales"], (np.abs(xg).max(-1) / 7).astype(np.float32))
    codes = T.unpack_nibbles(a["out_codes"], signed=True).reshape(xg.shape)
    s = a["out_scales"].astype(f64)[..., None]
    assert codes.min() >= -8 and codes.max() <= 7
    assert np.all(np.abs(xg - codes * s) <= s / 2 * (1 + 1e-6) + 0.0)  # nearest code
    assert np.array_equal(a["out"], (codes * s).reshape(x.shape))
    if c["name"] == "int4_roundtrip[3x320]":
        assert a["out_scales"][1, 1] == 0 and np.all(a["out"][1, 64:128] == 0)


def test_nf4_codebook_is_qlora_normalfloat():
    # QLoRA: quantiles of N(0,1), 8 positive and 7 negative halves + 0, offset 0.9677083
    nd, off = statistics.NormalDist(), 0.9677083
    pos = [nd.inv_cdf(p) for p in np.linspace(off, 0.5, 9)[:-1]]
    neg = [-nd.inv_cdf(p) for p in np.linspace(off, 0.5, 8)[:-1]]
    v = np.sort(np.array(pos + [0.0] + neg))
    np.testing.assert_allclose(T.NF4_CODEBOOK, v / v.max(), atol=5e-7)
    assert T.NF4_CODEBOOK[7] == 0 and T.NF4_CODEBOOK[0] == -1 and T.NF4_CODEBOOK[15] == 1


@pytest.mark.parametrize("c", cases("nf4_roundtrip"), ids=ids)
def test_nf4_roundtrip(c):
    a = load_case(c)
    x = a["in0"].astype(f64).reshape(-1, 64)
    absmax = np.abs(x).max(-1)
    nb = absmax.size
    codes = T.unpack_nibbles(a["out_codes"], signed=False).reshape(-1, 64)
    # codes are the nearest codebook entries to x / absmax (brute force, per element)
    for b in range(0, nb, max(1, nb // 7)):
        for j in range(64):
            d = [abs(x[b, j] / absmax[b] - cb) for cb in T.NF4_CODEBOOK]
            assert d[codes[b, j]] == min(d)
    # double quant: offset = mean absmax, one scale per 256 blocks, |error| <= half a step
    off = float(a["out_absmax_offset"])
    assert abs(off - absmax.mean()) <= 1e-6 * absmax.mean()
    assert a["out_absmax_scale"].shape == (-(-nb // 256),)
    s = np.repeat(a["out_absmax_scale"].astype(f64), 256)[:nb]
    deq_absmax = a["out_absmax_q"].astype(f64) * s + off
    assert np.all(np.abs(deq_absmax - absmax) <= s / 2 * (1 + 1e-6))
    np.testing.assert_array_equal(a["out"], (T.NF4_CODEBOOK[codes] * deq_absmax[:, None]).reshape(a["out"].shape))


def _gguf_raw(qtype, rows, cols, seed):
    """Random bytes of a GGUF-quantized (rows, cols) tensor made with gguf.quants.quantize."""
    import gguf
    x = rng0(seed).standard_normal((rows, cols)).astype(np.float32)
    return gguf.quants.quantize(x, qtype)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_dequant_matches_gguf_package(name):
    import gguf
    qt = getattr(gguf.GGMLQuantizationType, name)
    fn = getattr(T, "dequant_" + name.lower())
    raw = _gguf_raw(qt, 5, 96, 30)                          # (5, bytes per row) uint8
    ours = fn(raw, (5, 96))
    assert np.array_equal(ours.astype(np.float32), gguf.quants.dequantize(raw, qt))
    for c in cases("dequant_" + name.lower()):              # the stored random-byte cases
        a = load_case(c)
        rows, cols = c["params"]["shape"]
        theirs = gguf.quants.dequantize(a["in0"].reshape(rows, -1), qt)
        assert np.array_equal(a["out"].astype(np.float32), theirs), c["name"]
        assert np.array_equal(a["out"], fn(a["in0"], (rows, cols)))


def test_q4_nibble_order_low_first():
    # a single Q4_1 block with d=1, m=0: byte j = (j+16) << 4 | j encodes elements j and j+16
    blk = np.concatenate([np.array([1.0, 0.0], "<f2").view(np.uint8),
                          np.array([(j & 0xF) | (((15 - j) & 0xF) << 4) for j in range(16)], np.uint8)])
    w = T.dequant_q4_1(blk, (1, 32))[0]
    assert w[:16].tolist() == list(range(16)) and w[16:].tolist() == [15 - j for j in range(16)]


def test_every_stored_case_recomputes_from_its_inputs():
    # the dispatcher the device side will call reproduces each stored output bit for bit
    for c in iter_cases():
        a = load_case(c)
        res = evaluate(c["op"], [a[k] for k in c["inputs"]], c["params"], a.get("gout"))
        assert list(res) == c["outputs"], c["name"]
        for k, v in res.items():
            assert np.array_equal(v, a[k], equal_nan=True), (c["name"], k)
    assert set(OPS) == PHASE1_OPS | PHASE2_OPS
