"""report.html for a run folder: self-contained (inline SVG and CSS, no script, no network).

Reads what the trainer writes: metrics.jsonl (one JSON object per line, each with "step"),
and where present gates.json, summary.json, config.json and the adapter manifest. Plots every
numeric series it finds; tables for gates, per-category losses, spectra and the manifest."""
from __future__ import annotations

import html
import json
import math
from pathlib import Path

from vkdsl.fileio import atomic_write

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]
SKIP = {"time", "tokens", "seq_tokens", "computed", "micro", "packed", "tokens_per_s", "lr", "grad_norm", "pairs", "heldout_correct", "heldout_n",
        "merge_argmax", "merge_max_diff", "checksum_changed", "eval_seconds"}   # counts and bookkeeping: not curves
GROUPS = [("Loss", ("loss",)), ("Preservation and held-out", ("preserv", "heldout", "held_out", "acc")),
          ("DPO drift and margins", ("drift", "margin", "pair"))]


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON ({e})") from None
    return rows


def _read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = float(v)
    return out


def series(rows: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """name -> [(step, value)] for every numeric field (nested dicts flattened with dots)."""
    out: dict[str, list] = {}
    for r in rows:
        if "step" not in r:
            continue
        for k, v in _flatten(r).items():
            last = k.rsplit(".", 1)[-1]
            if k != "step" and not k.startswith(("spectrum", "singular")) and last not in SKIP \
                    and not last.endswith(("_n", "_seconds", "_ci")):
                out.setdefault(k, []).append((float(r["step"]), v))
    return {k: v for k, v in out.items() if len(v) >= 1}


def svg_plot(named: dict[str, list[tuple[float, float]]], title: str, w=640, h=260) -> str:
    pts = [p for s in named.values() for p in s]
    if not pts:
        return ""
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1
    L, R, T, B = 60, 170, 24, 30

    def sx(x):
        return L + (x - x0) / (x1 - x0) * (w - L - R)

    def sy(y):
        return h - B - (y - y0) / (y1 - y0) * (h - T - B)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img">',
             f'<text x="{L}" y="16" font-size="13" font-weight="bold">{html.escape(title)}</text>',
             f'<line x1="{L}" y1="{h - B}" x2="{w - R}" y2="{h - B}" stroke="#888"/>',
             f'<line x1="{L}" y1="{T}" x2="{L}" y2="{h - B}" stroke="#888"/>']
    for y in (y0, (y0 + y1) / 2, y1):
        parts.append(f'<text x="{L - 4}" y="{sy(y) + 4:.1f}" font-size="10" text-anchor="end">{y:.4g}</text>')
    for x in (x0, x1):
        parts.append(f'<text x="{sx(x):.1f}" y="{h - B + 14}" font-size="10" text-anchor="middle">{x:g}</text>')
    parts.append(f'<text x="{(L + w - R) / 2:.0f}" y="{h - 2}" font-size="10" text-anchor="middle">step</text>')
    for i, (name, s) in enumerate(sorted(named.items())):
        c = COLORS[i % len(COLORS)]
        s = sorted(s)
        if len(s) == 1:
            parts.append(f'<circle cx="{sx(s[0][0]):.1f}" cy="{sy(s[0][1]):.1f}" r="3" fill="{c}"/>')
        else:
            d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
            parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.6" points="{d}"/>')
        parts.append(f'<rect x="{w - R + 10}" y="{T + 14 * i}" width="10" height="10" fill="{c}"/>'
                     f'<text x="{w - R + 24}" y="{T + 14 * i + 9}" font-size="10">{html.escape(name[:26])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _table(rows: list[list], head: list[str]) -> str:
    th = "".join(f"<th>{html.escape(str(h))}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _gates_table(gates) -> str:
    if not gates:
        return "<p>No gates recorded.</p>"
    items = gates if isinstance(gates, list) else [dict(name=k, **v) if isinstance(v, dict) else
                                                    {"name": k, "passed": v} for k, v in gates.items()]
    rows = []
    for g in items:
        ok = g.get("passed", g.get("pass"))
        rows.append([g.get("name", g.get("gate", "?")), g.get("detail", g.get("value", "")), "PASS" if ok else "FAIL"])
    return _table(rows, ["gate", "detail", "result"]).replace(
        "<td>PASS</td>", '<td class="pass">PASS</td>').replace("<td>FAIL</td>", '<td class="fail">FAIL</td>')


def _spectra(rows: list[dict]) -> str:
    last = next((r for r in reversed(rows) if any("spectrum" in k or "singular" in k for k in r)), None)
    if not last:
        return "<p>No spectra recorded.</p>"
    spec = next(v for k, v in last.items() if "spectrum" in k or "singular" in k)
    if not isinstance(spec, dict):
        return "<p>No spectra recorded.</p>"
    def values(v):
        if isinstance(v, dict):
            v = v.get("sv", v.get("singular_values", []))
        return [float(x) for x in v] if isinstance(v, list) else []
    named = {m: [(i + 1.0, x) for i, x in enumerate(values(v))] for m, v in list(spec.items())[:8]}
    named = {m: pts for m, pts in named.items() if pts}
    if not named:
        return "<p>No spectra recorded.</p>"
    return svg_plot(named, "singular values of s·A·B (index on the x axis)").replace(">step<", ">index<")


def build_report(run_dir) -> Path:
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: no such run folder")
    rows = _read_jsonl(run / "metrics.jsonl")
    summary = _read_json(run / "summary.json") or {}
    gates = _read_json(run / "gates.json") or summary.get("gates")
    manifest = _read_json(run / "adapter" / "vkdsl_manifest.json") or _read_json(run / "vkdsl_manifest.json")
    config = _read_json(run / "config.json")
    ser = series(rows)
    plots = []
    used = set()
    for title, keys in GROUPS:
        named = {k: v for k, v in ser.items() if any(s in k.lower() for s in keys) and "categor" not in k
                 and k not in used}
        used |= set(named)
        if named:
            plots.append(svg_plot(named, title))
    cats = {k: v for k, v in ser.items() if "categor" in k}
    if cats:
        plots.append(svg_plot(cats, "Per-category loss"))
    sections = [f"<h1>vkdsl run {html.escape(run.name)}</h1>",
                f"<p>{len(rows)} metric records.</p>", "<h2>Curves</h2>", "".join(plots) or "<p>No metrics.</p>",
                "<h2>Gates</h2>", _gates_table(gates), "<h2>Spectrum of the learned update</h2>", _spectra(rows)]
    for title, obj in (("Summary", summary), ("Manifest", manifest), ("Configuration", config)):
        if obj:
            flat = [[k, json.dumps(v) if isinstance(v, (dict, list)) else v] for k, v in obj.items()]
            sections += [f"<h2>{title}</h2>", _table(flat, ["key", "value"])]
    css = ("body{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}"
           "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
           "font-size:13px;text-align:left;vertical-align:top;max-width:600px;word-break:break-all}"
           ".pass{background:#d4f4d4}.fail{background:#f8d0d0;font-weight:bold}svg{display:block;margin:1em 0}")
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>vkdsl run {html.escape(run.name)}</title>"
            f"<style>{css}</style></head><body>{''.join(sections)}</body></html>")
    return atomic_write(run / "report.html", page.encode("utf-8"))
