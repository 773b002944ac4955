"""A probe's report: OUT/NAME.html (self-contained: inline SVG and CSS, no script, no network)
and OUT/NAME.json (parameters, rows, expectations), written atomically."""
from __future__ import annotations

import html
import json
from pathlib import Path

from vkdsl.fileio import atomic_write

from .base import fmt

CSS = ("body{font:14px/1.45 system-ui,sans-serif;max-width:980px;margin:24px auto;padding:0 16px;color:#222}"
       "table{border-collapse:collapse;margin:8px 0 16px}td,th{border:1px solid #ccc;padding:3px 8px;"
       "text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}"
       ".pass{color:#1a7f37;font-weight:600}.fail{color:#c62828;font-weight:600}.soft{color:#777}"
       "code{background:#f5f5f5;padding:1px 4px}")


def _table(columns, rows) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(r.get(c)))}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write_report(res, p, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    ex = "".join(
        f"<tr><td class=\"{('pass' if e.ok else 'fail') if e.structural else 'soft'}\">"
        f"{('PASS' if e.ok else 'FAIL') if e.structural else ('holds' if e.ok else 'not seen')}</td>"
        f"<td style=\"text-align:left\">{html.escape(e.claim)}</td><td>{html.escape(e.measured)}</td></tr>"
        for e in res.expectations)
    params = _table(["parameter", "value"], [{"parameter": k, "value": v} for k, v in res.params.items()])
    doc = [f"<!doctype html><html><head><meta charset=\"utf-8\"><title>vkdsl probe {p.name}</title>"
           f"<style>{CSS}</style></head><body>",
           f"<h1>vkdsl probe {html.escape(p.name)}</h1><p>{html.escape(res.title)}</p>",
           f"<p class=\"{'pass' if res.passed else 'fail'}\">"
           f"{'every structural expectation holds' if res.passed else 'a structural expectation failed'}"
           f" ({res.seconds:.0f} s)</p>",
           "<h2>Measurements</h2>", _table(res.columns, res.rows),
           "<h2>Expectations</h2><table><tr><th></th><th>expected</th><th>measured</th></tr>" + ex + "</table>",
           *[f"<p>{html.escape(n)}</p>" for n in res.notes],
           *[f"<div>{c}</div>" for c in res.charts if c],
           "<h2>Parameters</h2>", params,
           f"<p>Reproduce: <code>vkdsl probe {html.escape(p.name)}"
           + "".join(f" --set {html.escape(str(k))}={html.escape(','.join(map(str, v)) if isinstance(v, list) else str(v))}"
                     for k, v in res.params.items() if k in p.defaults and v != p.defaults[k]) + "</code></p>",
           "</body></html>"]
    path = out / f"{p.name}.html"
    atomic_write(path, "\n".join(doc).encode())
    atomic_write(out / f"{p.name}.json", json.dumps(
        {"probe": p.name, "title": res.title, "params": res.params, "seconds": res.seconds, "passed": res.passed,
         "columns": res.columns, "rows": res.rows, "expectations": [e.__dict__ for e in res.expectations], "notes": res.notes},
        indent=1, default=float).encode())
    return path
