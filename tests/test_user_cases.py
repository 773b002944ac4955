"""Verify your own kernels (vkdsl.cases, `vkdsl verify --cases`, `vkdsl golden make`): the README's two
examples on this device and under the four profiles, JUnit XML checked against the JUnit schema
(tests/fixtures/junit.xsd), goldens made and checked, the error measures against their definitions,
a planted bug in each example kernel turning its rows red, and every bad input in one line."""
import json
from pathlib import Path

import numpy as np
import pytest

from fixtures.cli import vkdsl

REPO = Path(__file__).resolve().parent.parent
GELU, LAYERNORM = REPO / "examples" / "verify_gelu_mlp.py", REPO / "examples" / "verify_layernorm.py"
# a planted bug in each example's kernel (not in its reference): h^2 for h^3 in the GELU, the
# unbiased variance in the GLSL layer norm
PLANTED = {GELU: ("h * h * h * 0.044715", "h * h * 0.044715"),
           LAYERNORM: ("row_sum(q) / float(cols) + eps", "row_sum(q) / float(cols - 1) + eps")}


def junit(path):
    import xmlschema
    xmlschema.XMLSchema(str(REPO / "tests" / "fixtures" / "junit.xsd")).validate(str(path))
    import xml.etree.ElementTree as ET
    return ET.parse(path).getroot()


def last_line(p):
    return (p.stderr.strip().splitlines() or [""])[-1]


@pytest.mark.parametrize("example", [GELU, LAYERNORM], ids=["dsl_gelu_mlp", "glsl_layernorm"])
def test_an_example_passes_on_this_device_and_under_the_four_profiles_with_junit(tmp_path, example):
    from vkdsl.cases import load
    from vkdsl.runtime.profiles import PROFILES
    names = [r for c in load(str(example)) for r in [c.name] + [f"{c.name}:grad_in{i}" for i in c.grads]]
    out = tmp_path / "out.xml"
    p = vkdsl(["verify", "--cases", str(example), "--all-profiles", "--junit", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    root = junit(out)
    suites = root.findall("testsuite")
    assert [s.get("name").split(" / ")[-1] for s in suites] == ["as it is"] + [f"profile {n}" for n in PROFILES]
    for s in suites:
        assert [c.get("name") for c in s.findall("testcase")] == names
        assert (s.get("tests"), s.get("failures"), s.get("errors")) == (str(len(names)), "0", "0")
    assert root.get("tests") == str(len(names) * (1 + len(PROFILES)))


@pytest.mark.parametrize("example", [GELU, LAYERNORM], ids=["dsl_gelu_mlp", "glsl_layernorm"])
def test_a_planted_bug_in_an_example_kernel_fails_its_rows(tmp_path, example):
    old, new = PLANTED[example]
    text = example.read_text()
    assert text.count(old) == 1
    bad = tmp_path / example.name
    bad.write_text(text.replace(old, new))
    out = tmp_path / "bad.xml"
    p = vkdsl(["verify", "--cases", str(bad), "--junit", str(out)])
    assert p.returncode == 1
    failures = junit(out).findall("testsuite/testcase/failure")
    assert failures and all(" > limit " in f.get("message") for f in failures)
    forward = [c.get("name") for c in junit(out).findall("testsuite/testcase") if c.find("failure") is not None]
    assert any(":" not in n for n in forward)            # the kernel's own output, not only a gradient


def test_a_kernel_writing_past_its_output_fails_its_row_whatever_it_computes(tmp_path):
    """Every verify row runs with sentinel words past each output (vkdsl.realize.guarded): the
    layer norm's loop bound planted one element long (the last row writes y[rows * cols]) fails,
    though the values it was asked for may all be right."""
    old, new = "for (uint c = t; c < cols; c += 64) y[", "for (uint c = t; c <= cols; c += 64) y["
    text = LAYERNORM.read_text()
    assert text.count(old) == 1
    bad = tmp_path / LAYERNORM.name
    bad.write_text(text.replace(old, new))
    p = vkdsl(["verify", "--cases", str(bad), "--no-warm"])
    assert p.returncode == 1
    assert "OverrunError" in p.stdout and "layernorm" in p.stdout and "wrote past the end" in p.stdout


def test_goldens_made_then_checked_without_the_reference(tmp_path):
    """golden make stores inputs and float64 outputs in vkdsl's format; verify --golden checks the device
    against them; an edited generator makes them stale (named), an altered or missing file is one line."""
    from vkdsl_golden import store
    gold = tmp_path / "gold"
    p = vkdsl(["golden", "make", "--cases", str(LAYERNORM), "--out", str(gold)])
    assert p.returncode == 0, p.stderr
    man = store.load_manifest(1, gold)
    assert [c["name"] for c in man["cases"]][:2] == ["layernorm[7x64]", "layernorm[3x5x33]"]
    arrays = store.load_case({**man["cases"][0], "path": str(gold / "v1" / man["cases"][0]["file"])})
    x = arrays["in0"].astype(np.float64)                 # the stored output is layer norm of the stored input
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * arrays["in1"] + arrays["in2"]
    assert np.abs(arrays["out"] - ref).max() < 1e-12
    assert vkdsl(["verify", "--cases", str(LAYERNORM), "--golden", str(gold)]).returncode == 0
    edited = tmp_path / "edited.py"
    edited.write_text(LAYERNORM.read_text().replace('draw((7, 64))', 'draw((7, 64), scale=2.0)'))
    p = vkdsl(["verify", "--cases", str(edited), "--golden", str(gold), "--json"])
    rows = [json.loads(line) for line in p.stdout.splitlines() if '"name"' in line]
    assert p.returncode == 1
    assert [r["name"] for r in rows if not r["passed"]] == ["layernorm[7x64]"]
    assert "stale golden" in rows[0]["note"]
    f = gold / "v1" / man["cases"][1]["file"]
    f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 1]))
    p = vkdsl(["verify", "--cases", str(LAYERNORM), "--golden", str(gold)])
    assert p.returncode == 1 and "sha256 mismatch for case 'layernorm[3x5x33]'" in last_line(p)
    assert str(f) in last_line(p) and "Traceback" not in p.stderr
    f.unlink()
    p = vkdsl(["verify", "--cases", str(LAYERNORM), "--golden", str(gold)])
    assert "missing file (expected by case 'layernorm[3x5x33]'" in last_line(p)


def test_the_builtin_rows_are_verify_cases_builtin():
    a = vkdsl(["verify", "--match", "softmax[", "--json"])
    b = vkdsl(["verify", "--cases", "builtin", "--match", "softmax[", "--json"])
    assert a.returncode == b.returncode == 0

    def rows(p):
        return [(r["name"], r["passed"], r["error"]) for r in map(json.loads, p.stdout.splitlines()) if "name" in r]
    assert rows(a) == rows(b) and len(rows(a)) >= 4


CASE_HEAD = "import numpy as np\nfrom vkdsl.cases import Case\n"


@pytest.mark.parametrize("body, expected", [
    ("x = 1 +\n", r"bad.py:3: the case file does not import: SyntaxError"),
    ("raise RuntimeError('no weights here')\n", r"bad.py:3: the case file does not import: RuntimeError: no weights"),
    ("CASES = [Case('c[1]', lambda x: x, None, lambda r: [np.ones(3, np.float32)], 1e-6, 'exact')]\n",
     r"bad.py: case 'c\[1\]': reference is missing"),
    ("CASES = [Case('c[1]', lambda x: x, lambda x: x, lambda r: [np.ones(3, np.float32)], -1.0, 'exact')]\n",
     r"bad.py: case 'c\[1\]': limit -1.0 .*expected a finite number >= 0"),
    ("CASES = [Case('c[1]', lambda x: x, lambda x: x, lambda r: [np.ones(3, np.float32)], float('nan'), 'x')]\n",
     r"bad.py: case 'c\[1\]': limit nan"),
    ("CASES = [Case('c[1]', lambda x: x, lambda x: x, lambda r: [np.ones(3, np.float32)], '1e-6', 'x')]\n",
     r"bad.py: case 'c\[1\]': limit '1e-6'"),
    ("CASES = [Case('c[1]', lambda x: x, lambda x: x, lambda r: [np.ones(3)], 1e-6, 'exact')]\n",
     r"bad.py: case 'c\[1\]': input 0 is float64; expected float32, int32 or uint8"),
    ("CASES = [Case('c[1]', lambda x: x, lambda x: x, lambda r: [np.ones(3, np.float32)], 1e-6, '', )]\n",
     r"bad.py: case 'c\[1\]': no reason for its limit"),
    ("CASES = []\n", r"bad.py: no cases"),
])
def test_a_bad_case_file_is_one_line_naming_the_file_and_case(tmp_path, body, expected):
    import re
    f = tmp_path / "bad.py"
    f.write_text(CASE_HEAD + body)
    p = vkdsl(["verify", "--cases", str(f)])
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert re.search(expected, last_line(p)), last_line(p)


def test_a_wrong_reference_shape_or_a_crashing_kernel_is_a_failed_row_and_the_others_still_run(tmp_path):
    f = tmp_path / "mixed.py"
    f.write_text(CASE_HEAD + """
def boom(x):
    raise RuntimeError("kernel exploded")
ones = lambda r: [np.ones((2, 3), np.float32)]
CASES = [Case("good[2x3]", lambda x: x * 2.0, lambda x: x * 2.0, ones, 0.0, "doubling is exact"),
         Case("shape[2x3]", lambda x: x * 2.0, lambda x: (x * 2.0).T, ones, 0.0, "doubling is exact"),
         Case("crash[2x3]", boom, lambda x: x, ones, 0.0, "exact"),
         Case("after[2x3]", lambda x: x + 1.0, lambda x: x + 1.0, ones, 0.0, "exact")]
""")
    p = vkdsl(["verify", "--cases", str(f), "--json"])
    rows = {r["name"]: r for r in map(json.loads, p.stdout.splitlines()) if "name" in r}
    assert p.returncode == 1
    assert rows["good[2x3]"]["passed"] and rows["after[2x3]"]["passed"]
    assert "the function's out has shape (2, 3), the reference's (3, 2)" in rows["shape[2x3]"]["note"]
    assert str(f) in rows["shape[2x3]"]["note"]
    assert rows["crash[2x3]"]["note"] == "RuntimeError: kernel exploded" and not rows["crash[2x3]"]["passed"]


def test_a_target_that_cannot_run_is_an_error_testcase_and_the_others_still_report(tmp_path):
    from vkdsl.cli.verify_report import Target, junit_xml, run_targets
    ok, gone = Target("this device"), Target("no such device", device="no-such-gpu")
    run_targets([ok, gone], ["--cases", str(LAYERNORM), "--match", "7x64"])
    assert [r.passed for r in ok.rows] == [True] * 4 and not ok.error
    assert "no-such-gpu" in gone.error and not gone.rows
    out = tmp_path / "t.xml"
    out.write_bytes(junit_xml([ok, gone]))
    root = junit(out)
    assert root.get("errors") == "1" and root.find("testsuite[@name='no such device']/testcase/error") is not None


def test_the_measures_against_their_definitions():
    from vkdsl.verify import measure
    ref = np.array([1.0, -2.0, 3.5e-3, 0.0, 7.0])
    y = np.array([np.nextafter(np.float32(1.0), np.float32(2.0)), -2.0, 3.5e-3, 0.0, 7.0], np.float32)
    y[4] = np.float32(7.0) + 3 * np.spacing(np.float32(7.0))        # three float32 steps up
    assert measure("ulp", y, ref) == (3.0, "")
    assert measure("max_abs", y, ref)[0] == pytest.approx(3 * float(np.spacing(np.float32(7.0))), rel=1e-12)
    d = y.astype(np.float64) - ref
    assert measure("nmse", y, ref)[0] == pytest.approx(float((d ** 2).sum() / (ref ** 2).sum()), rel=1e-12)
    z = np.float32(-0.0)                                             # -0 and +0 are one value: 0 ulp
    assert measure("ulp", np.array([z]), np.array([0.0]))[0] == 0.0
    assert measure("ulp", np.array([np.nan], np.float32), np.array([1.0]))[0] == float("inf")


def test_finite_differences_of_the_reference_match_a_closed_form_gradient():
    """The default gradient reference (central differences) against the closed form of a known function."""
    from vkdsl.cases import Case, references
    c = Case("cube[5x4]", None, lambda x, w: (x ** 3) @ w,
             lambda r: [r.standard_normal((5, 4)).astype(np.float32), r.standard_normal((4, 3)).astype(np.float32)],
             1e-8, "n/a", grads=(0, 1))
    c.fn = lambda x, w: x
    a = references(c)
    x, w, g = (a[k].astype(np.float64) for k in ("in0", "in1", "gout"))
    assert np.abs(a["grad_in0"] - 3 * x ** 2 * (g @ w.T)).max() < 1e-7
    assert np.abs(a["grad_in1"] - (x ** 3).T @ g).max() < 1e-7


def test_the_docs_name_the_examples():
    text = (REPO / "README.md").read_text()
    assert "## Verify your own kernel" in text
    for f in (GELU, LAYERNORM):
        assert f"examples/{f.name}" in text


def test_a_traced_function_is_a_case_its_program_runs_and_its_body_gives_gradients(tmp_path):
    f = tmp_path / "traced.py"
    f.write_text(CASE_HEAD + """import vkdsl
@vkdsl.trace
def softplus(x):
    return ((-x.maximum(0.0) - (x.maximum(0.0) - x)).exp() + 1.0).log() + x.maximum(0.0)
draw = lambda r: [(r.standard_normal(300) * 10).astype(np.float32)]
CASES = [Case("softplus[300]", softplus, lambda x: np.logaddexp(0, x), draw, 1e-10, "exp and log of |x| <= 40"),
         Case("softplus[300,grad]", softplus, lambda x: np.logaddexp(0, x), draw, 1e-10, "as above", grads=(0,))]
""")
    p = vkdsl(["verify", "--cases", str(f), "--json"])
    rows = {r["name"]: r for r in map(json.loads, p.stdout.splitlines()) if "name" in r}
    assert p.returncode == 0, p.stdout
    assert set(rows) == {"softplus[300]", "softplus[300,grad]", "softplus[300,grad]:grad_in0"}


@pytest.mark.parametrize("make, expected", [
    ("json", "{p}: a case file is Python (.py) with a CASES list"),
    ("missing", "{p}: no such case file"),
    ("module", "no_such_cases_module: no such case file (.py) or importable module")])
def test_a_case_spec_that_is_no_python_is_named_as_such(tmp_path, make, expected):
    # once "AttributeError: 'NoneType' object has no attribute 'loader'" or "No module named '/x'"
    from vkdsl import cases as C
    p = tmp_path / "cases.json"
    if make == "json":
        p.write_text("[]")
    spec = "no_such_cases_module" if make == "module" else str(p)
    with pytest.raises(C.CaseError) as e:
        C.load(spec)
    assert str(e.value).startswith(expected.format(p=p)), e.value


def test_a_match_that_picks_no_case_says_so(tmp_path):
    p = vkdsl(["verify", "--match", "no-case-is-called-this"])
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert last_line(p) == "Error: builtin: no case matches 'no-case-is-called-this'"
