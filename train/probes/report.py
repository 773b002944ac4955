"""A probe's report: OUT/NAME.html (self-contained: inline SVG and CSS, no script, no network)
and OUT/NAME.json (parameters, rows, expectations), written atomically."""
from __future__ import annotations

import html
import json
from pathlib import Path

from vkdsl.fileio import atomic_write

from ..report import CSS as REPORT_CSS
from ..report import html_table
from .base import fmt

CSS = REPORT_CSS + ".soft{color:#777}"


def _table(columns, rows) -> str:
    return html_table(columns, [[fmt(r.get(c)) for c in columns] for r in rows])


def write_report(res, p, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)

    def tag(e):
        kind = ("pass" if e.ok else "fail") if e.structural else "soft"
        return f"<span class=\"{kind}\">{e.tag}</span>"

    def flag(k, v):
        value = ",".join(map(str, v)) if isinstance(v, list) else str(v)
        return f" --set {html.escape(str(k))}={html.escape(value)}"
    verdict = ("every structural expectation holds" if res.passed
               else "a structural expectation failed")
    ex = html_table(["", "expected", "measured"],
                    [[tag(e), html.escape(e.claim), html.escape(e.measured)]
                     for e in res.expectations], raw=True)
    params = _table(["parameter", "value"],
                    [{"parameter": k, "value": v} for k, v in res.params.items()])
    doc = [f"<!doctype html><html><head><meta charset=\"utf-8\"><title>vkdsl probe {p.name}</title>"
           f"<style>{CSS}</style></head><body>",
           f"<h1>vkdsl probe {html.escape(p.name)}</h1><p>{html.escape(res.title)}</p>",
           f"<p class=\"{'pass' if res.passed else 'fail'}\">{verdict} ({res.seconds:.0f} s)</p>",
           "<h2>Measurements</h2>", _table(res.columns, res.rows),
           "<h2>Expectations</h2>" + ex,
           *[f"<p>{html.escape(n)}</p>" for n in res.notes],
           *[f"<div>{c}</div>" for c in res.charts if c],
           "<h2>Parameters</h2>", params,
           f"<p>Reproduce: <code>vkdsl probe {html.escape(p.name)}"
           + "".join(flag(k, v) for k, v in res.params.items()
                     if k in p.defaults and v != p.defaults[k])
           + "</code></p>", "</body></html>"]
    path = out / f"{p.name}.html"
    atomic_write(path, "\n".join(doc).encode())
    atomic_write(out / f"{p.name}.json", json.dumps(
        {"probe": p.name, "title": res.title, "params": res.params, "seconds": res.seconds,
         "passed": res.passed, "columns": res.columns, "rows": res.rows,
         "expectations": [e.__dict__ for e in res.expectations], "notes": res.notes},
        indent=1, default=float).encode())
    return path
