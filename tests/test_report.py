"""report.html from a real run folder (a tiny SFT + DPO run of the trainer): every panel, the
surfaces table's numbers equal to the run's own summary.json, self-contained well-formed SVG,
the two-run comparison, a damaged metrics line named, and a real headless browser rendering it."""
import html
import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest

from fixtures.train_data import tiny_prefs, tiny_setup
from vkdsl.cli import main
from vkdsl.cli.train import main as train_main
from vkdsl.train.report import PANELS, build_report, compare_report


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    tm, tr, he, pr = tiny_setup(d)
    prefs = tiny_prefs(d / "prefs.jsonl")
    common = ["--model", str(tm.gguf_path), "--train-file", tr, "--heldout-file", he, "--preservation-file", pr,
              "--labels", "low,medium,high", "--max-len", "64", "--rank", "4", "--alpha", "8", "--lr", "1e-2",
              "--warmup", "1", "--steps", "4", "--batch-size", "4", "--eval-batch", "4", "--tmkl", "0",
              "--dpo-train-file", prefs, "--dpo-heldout-file", prefs, "--dpo-steps", "2", "--no-verify", "--quiet"]
    out = []
    for name, extra in (("a", []), ("b", ["--lr", "5e-3"])):
        assert train_main(common + extra + ["--out", str(d / name)]) in (0, 3)     # 3: a gate failed
        out.append(d / name)
    return out


def test_panels_and_numbers_come_from_the_run(runs):
    page = build_report(runs[0]).read_text()
    summary = json.loads((runs[0] / "summary.json").read_text())
    for title, _, _ in PANELS:
        assert f"<h2>{title}</h2>" in page.replace("&#x27;", "'")
    for col in ("base", "after SFT", "after DPO"):
        assert f"<th>{col}</th>" in page
    f = summary["final"]
    lo, hi = f["heldout_acc_ci"]
    assert f"{f['heldout_acc']:.3f} [{lo:.3f}, {hi:.3f}]" in page
    assert f"{f['calibration']['ece']:.3f}" in page and f"{f['format_valid']:.3f}" in page
    after = summary["dpo"]["after"]
    assert f"{after['calibration']['ece']:.3f}" in page
    assert summary["gates"] == json.loads((runs[0] / "gates.json").read_text())   # one schema, one list
    for g in summary["gates"]:
        assert html.escape(g["gate"]) in page
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) >= 6                                  # fit, lr, reliability x3, slices, DPO, spectrum
    for s in svgs:
        ET.fromstring(s)
    # the SFT loss curve has one point per step record
    steps = sum(1 for line in (runs[0] / "metrics.jsonl").read_text().splitlines() if '"event": "step"' in line)
    assert any(len(p.split()) == steps for p in re.findall(r'points="([^"]+)"', page))


def test_compare_two_runs(runs, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", str(runs[0]), str(runs[1]), "--out", str(tmp_path / "cmp.html")])
    assert e.value.code == 0
    page = (tmp_path / "cmp.html").read_text()
    assert "Settings that differ" in page and "<td>lr</td>" in page and "0.005" in page
    assert page.count("<th>a: base</th>") == 1 and "<th>b: after DPO</th>" in page
    assert compare_report(runs[0], runs[1]).name == "compare-b.html"


def test_bad_metrics_line_names_file_and_line(runs, tmp_path):
    run = shutil.copytree(runs[0], tmp_path / "copy")
    n = len((run / "metrics.jsonl").read_text().splitlines())
    with open(run / "metrics.jsonl", "a") as f:
        f.write("{oops\n")
    with pytest.raises(ValueError, match=rf"metrics.jsonl:{n + 1}"):
        build_report(run)


@pytest.mark.parametrize("damage", ["cut", "shape"])
def test_a_half_written_or_misshapen_record_is_one_line_from_vkdsl_report(runs, tmp_path, damage):
    """summary.json cut short (a write killed outside the atomic path) or holding a record of another
    shape: `vkdsl report` says so in one line naming the run folder, never a traceback."""
    from fixtures.cli import vkdsl
    run = shutil.copytree(runs[0], tmp_path / "copy")
    text = (run / "summary.json").read_text()
    if damage == "cut":
        (run / "summary.json").write_text(text[:len(text) // 2])
    else:
        summary = json.loads(text)
        summary["final"] = ["not", "an", "evaluation"]
        (run / "summary.json").write_text(json.dumps(summary))
    p = vkdsl(["report", str(run)])
    assert p.returncode == 1 and "Traceback" not in p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert str(run) in line and ("not JSON" in line if damage == "cut" else "expected a JSON object" in line), line


def test_report_renders_in_headless_chromium(runs, tmp_path):
    """A real browser (Debian's chromium, installed by ./setup.sh --test) renders the page."""
    out = build_report(runs[0])
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "headless Chromium is part of the test set-up: ./setup.sh --test"
    png = tmp_path / "shot.png"
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run"]
    subprocess.run(flags + [f"--user-data-dir={tmp_path / 'prof'}", f"--screenshot={png}", "--window-size=1100,3000",
                            out.as_uri()], capture_output=True, timeout=120, check=True)
    assert png.stat().st_size > 30_000       # a rendered page with charts and tables, not a blank image
    dom = subprocess.run(flags + [f"--user-data-dir={tmp_path / 'prof2'}", "--dump-dom", out.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert dom.count("<svg") >= 6 and "Did it transfer?" in dom and "Provenance" in dom


def _edit_json(path, fn):
    v = json.loads(path.read_text())
    path.write_text(json.dumps(fn(v) or v))


DAMAGES = {   # what a damaged or hand-edited record holds -> the words of its one line
    "config_a_list": (lambda r: (r / "config.json").write_text("[1]"),
                      r"config.json: a JSON list, expected a JSON object"),
    "config_of_a_model": (lambda r: (r / "config.json").write_text('{"model_type": "llama"}'),
                          r"config.json: not a run's settings \(no objective\)"),
    "summary_a_list": (lambda r: (r / "summary.json").write_text("[]"),
                       r"summary.json: a JSON list, expected a JSON object"),
    "gates_an_object": (lambda r: (r / "gates.json").write_text('{"gates": []}'),
                        r"gates.json: a JSON dict, expected a JSON list"),
    "gates_not_utf8": (lambda r: (r / "gates.json").write_bytes(b"\xff\xfe[]"),
                       r"gates.json: not UTF-8 text"),
    "metrics_row_a_list": (lambda r: open(r / "metrics.jsonl", "a").write("[1, 2]\n"),
                           r"metrics.jsonl:\d+: a list, expected a record"),
    "metrics_loss_a_string": (
        lambda r: open(r / "metrics.jsonl", "a").write('{"event": "step", "step": 9, "loss": "y"}\n'),
        r"metrics.jsonl:\d+: loss is \"y\", expected a number"),
    "gate_pass_a_string": (lambda r: _edit_json(r / "gates.json",
                                                lambda g: g[0].update({"pass": "no"})),
                           r"gates.json: .*Gate.passed is \"no\", expected bool"),
    "accuracy_a_list": (lambda r: _edit_json(r / "summary.json",
                                             lambda s: s["final"].update(heldout_acc=[1])),
                        r"summary.json: .*Evidence.heldout_acc is \[1\], expected float \| None"),
    "pairs_a_fraction": (lambda r: _edit_json(r / "summary.json",
                                              lambda s: s["dpo"]["heldout"].update(pairs=1.5)),
                         r"summary.json: .*PairEvidence.pairs is 1.5, expected int"),
    "base_step_a_list": (lambda r: _edit_json(r / "base_eval.json",
                                              lambda b: b["base"].update(step=[0])),
                         r"base_eval.json: .*Evidence.step is \[0\]"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_record_of_the_wrong_type_is_one_line_naming_its_file(runs, tmp_path, damage):
    """Each record is read as the type the trainer writes, value by value: a gate whose pass is
    the string "no" would otherwise read as PASS, a list would print as an accuracy."""
    run = shutil.copytree(runs[0], tmp_path / "copy")
    edit, words = DAMAGES[damage]
    edit(run)
    with pytest.raises(ValueError, match=words):
        build_report(run)


def test_a_damaged_base_evaluation_cache_is_measured_again(runs, tmp_path):
    """base_eval.json with the right key but a field of another type is not reused as evidence."""
    from vkdsl.train import checkpoint
    saved = json.loads((runs[0] / "base_eval.json").read_text())
    path = tmp_path / "base_eval.json"
    path.write_text(json.dumps(saved))
    good = checkpoint.cached_base(path, saved["key"])
    assert good.heldout_loss == saved["base"]["heldout_loss"] and good.step == "base"
    assert checkpoint.cached_base(path, "another key") is None
    saved["base"]["heldout_loss"] = "0.5"
    path.write_text(json.dumps(saved))
    assert checkpoint.cached_base(path, saved["key"]) is None
