"""report.html from a run folder: self-contained, every curve and gate present, valid SVG."""
import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest

from vkdsl.train.report import build_report


def make_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "train_loss": 2.0 / (s + 1), "heldout": {"loss": 2.5 - 0.1 * s, "accuracy": 0.2 + 0.05 * s},
             "preservation_delta_nats": 0.001 * s, "category_loss": {"billing": 1.0 - 0.05 * s, "outage": 1.2}}
            for s in range(0, 10, 2)]
    rows.append({"step": 8, "spectrum": {"blk.0.attn_q": [0.5, 0.2, 0.01]}})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "gates.json").write_text(json.dumps([
        {"name": "heldout_accuracy >= 0.6", "value": 0.6, "threshold": 0.6, "passed": True},
        {"name": "preservation_delta <= 0.05", "value": 0.08, "threshold": 0.05, "passed": False}]))
    (run / "config.json").write_text(json.dumps({"lr": 1e-3, "rank": 8}))
    return run


def test_report_is_self_contained_and_complete(tmp_path):
    out = build_report(make_run(tmp_path))
    page = out.read_text()
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    for text in ("train_loss", "heldout.loss", "category_loss.billing", "PASS", "FAIL", "blk.0.attn_q", "rank"):
        assert text in page
    svgs = re.findall(r"<svg.*?</svg>", page, re.S)
    assert len(svgs) >= 4
    for s in svgs:
        ET.fromstring(s)                     # well-formed SVG
    # the polyline of train_loss has one point per record
    assert any(len(p.split()) == 5 for p in re.findall(r'points="([^"]+)"', page))


def test_bad_metrics_line_names_file_and_line(tmp_path):
    run = make_run(tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("{oops\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:7"):
        build_report(run)


def test_report_renders_in_headless_chromium(tmp_path):
    """A real browser (Debian's chromium, installed by ./setup.sh --test) renders the page."""
    out = build_report(make_run(tmp_path))
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "headless Chromium is part of the test set-up: ./setup.sh --test"
    png = tmp_path / "shot.png"
    subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'prof'}",
                    f"--screenshot={png}", "--window-size=1000,1600", out.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert png.stat().st_size > 10_000       # a rendered page with plots, not a blank image
    dom = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--no-first-run", f"--user-data-dir={tmp_path / 'prof2'}", "--dump-dom", out.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert dom.count("<svg") >= 4 and "FAIL" in dom
