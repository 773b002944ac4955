"""Inline SVG charts for the self-contained HTML reports (no script, no network): lines over a
step axis (optionally log-scaled) and labelled bars. Each chart has one axis of one scale."""
from __future__ import annotations

import html
import math

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]
L, R, T, B = 64, 150, 18, 34          # margins: axis labels left and below, legend right


def _ticks(lo, hi, n=4):
    """Round tick values (1, 2 or 5 times a power of ten apart) inside [lo, hi]."""
    span = hi - lo
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    out = [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]
    return out or [lo, hi]


def _num(v, log=False):
    v = 10 ** v if log else v
    if abs(v) < 1e-12:
        return "0"
    return f"{v:.2g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3g}"


def line_chart(series: dict, xlabel: str, ylabel: str, log: bool = False, w=600, h=240,
               xs=None) -> str:
    """series: name -> list of y (x = 1..n, or xs) or of (x, y). log: log10 y axis (values <= 0
    are dropped from a log chart and said in the legend)."""
    pts, dropped = {}, {}
    for name, ys in series.items():
        pairs = [(p[0], p[1]) if isinstance(p, (tuple, list)) else ((xs[i] if xs else i + 1), p)
                 for i, p in enumerate(ys)]
        keep = [(x, y) for x, y in pairs if y is not None and math.isfinite(y)
                and (not log or y > 0)]
        dropped[name] = len(pairs) - len(keep)
        pts[name] = [(x, math.log10(y) if log else y) for x, y in keep]
    every = [p for v in pts.values() for p in v]
    if not every:
        return ""
    x0, x1 = min(p[0] for p in every), max(p[0] for p in every)
    y0, y1 = min(p[1] for p in every), max(p[1] for p in every)
    x1 = x1 if x1 > x0 else x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    sx = lambda x: L + (x - x0) / (x1 - x0) * (w - L - R)          # noqa: E731
    sy = lambda y: h - B - (y - y0) / (y1 - y0) * (h - T - B)      # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
           f'font-size="11">',
           f'<rect x="{L}" y="{T}" width="{w - L - R}" height="{h - T - B}" fill="none" '
           f'stroke="#999"/>']
    for t in _ticks(y0, y1):
        out.append(f'<text x="{L - 4}" y="{sy(t) + 4:.1f}" text-anchor="end">{_num(t, log)}</text>')
    for t in _ticks(x0, x1):
        out.append(f'<text x="{sx(t):.1f}" y="{h - B + 14}" text-anchor="middle">{t:.4g}</text>')
    out.append(f'<text x="{(L + w - R) / 2}" y="{h - 4}" '
               f'text-anchor="middle">{html.escape(xlabel)}</text>')
    out.append(f'<text x="12" y="{(T + h - B) / 2}" transform="rotate(-90 12 {(T + h - B) / 2})" '
               f'text-anchor="middle">{html.escape(ylabel)}</text>')
    for i, (name, p) in enumerate(pts.items()):
        c = COLORS[i % len(COLORS)]
        if len(p) == 1:
            out.append(f'<circle cx="{sx(p[0][0]):.1f}" cy="{sy(p[0][1]):.1f}" r="3" fill="{c}"/>')
        elif p:
            d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in p)
            out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{d}"/>')
        note = f" ({dropped[name]} <= 0 not shown)" if dropped[name] else ""
        out.append(f'<text x="{w - R + 8}" y="{T + 12 + 14 * i}" '
                   f'fill="{c}">{html.escape(name + note)}</text>')
    out.append("</svg>")
    return "".join(out)


def bar_chart(values: dict, ylabel: str, w=600, h=220) -> str:
    """values: label -> number (signed); one bar each, zero line drawn."""
    if not values:
        return ""
    vs = list(values.values())
    y0, y1 = min(0.0, min(vs)), max(0.0, max(vs))
    if y1 == y0:
        y1 = y0 + 1
    n = len(vs)
    bw = (w - L - 20) / n
    sy = lambda y: h - B - (y - y0) / (y1 - y0) * (h - T - B)      # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
           f'font-size="11">']
    for t in _ticks(y0, y1):
        out.append(f'<text x="{L - 4}" y="{sy(t) + 4:.1f}" text-anchor="end">{_num(t)}</text>')
    for i, (k, v) in enumerate(values.items()):
        top, bot = sorted((sy(v), sy(0)))
        x = L + i * bw
        out.append(f'<rect x="{x + 2:.1f}" y="{top:.1f}" width="{bw - 4:.1f}" '
                   f'height="{max(bot - top, 0.5):.1f}" '
                   f'fill="{COLORS[0] if v >= 0 else COLORS[1]}"/>')
        out.append(f'<text x="{x + bw / 2:.1f}" y="{h - B + 14}" '
                   f'text-anchor="middle">{html.escape(str(k))}</text>')
    out.append(f'<line x1="{L}" x2="{w - 20}" y1="{sy(0):.1f}" y2="{sy(0):.1f}" stroke="#333"/>')
    out.append(f'<text x="12" y="{(T + h - B) / 2}" transform="rotate(-90 12 {(T + h - B) / 2})" '
               f'text-anchor="middle">{html.escape(ylabel)}</text></svg>')
    return "".join(out)


def reliability_chart(bins: list[dict], title: str, w=300, h=240) -> str:
    """Calibration bins (lo, hi, n, accuracy, confidence): one bar per non-empty bin at its range,
    height = accuracy, a tick at the mean confidence, n above; the diagonal is perfect
    calibration."""
    s = min(w - L - 16, h - T - B)
    sx = lambda v: L + v * s                    # noqa: E731
    sy = lambda v: T + s - v * s                # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
           f'font-size="11">', f'<text x="{L}" y="{T - 2}">{html.escape(title)}</text>',
           f'<rect x="{L}" y="{T}" width="{s}" height="{s}" fill="none" stroke="#999"/>',
           f'<line x1="{sx(0)}" y1="{sy(0)}" x2="{sx(1)}" y2="{sy(1)}" stroke="#bbb" '
           f'stroke-dasharray="4 3"/>']
    for b in bins:
        if not b["n"]:
            continue
        x0, x1 = sx(b["lo"]) + 1, sx(b["hi"]) - 1
        out.append(f'<rect x="{x0:.1f}" y="{sy(b["accuracy"]):.1f}" width="{x1 - x0:.1f}" '
                   f'height="{sy(0) - sy(b["accuracy"]):.1f}" fill="{COLORS[0]}" opacity="0.75"/>')
        out.append(f'<line x1="{x0:.1f}" x2="{x1:.1f}" y1="{sy(b["confidence"]):.1f}" '
                   f'y2="{sy(b["confidence"]):.1f}" stroke="{COLORS[1]}" stroke-width="2"/>')
        out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{sy(b["accuracy"]) - 3:.1f}" '
                   f'text-anchor="middle">{b["n"]}</text>')
    for t in (0, 0.5, 1):
        out.append(f'<text x="{L - 4}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
        out.append(f'<text x="{sx(t):.1f}" y="{T + s + 14}" text-anchor="middle">{t:g}</text>')
    out.append(f'<text x="{L + s / 2}" y="{T + s + 28}" text-anchor="middle">confidence (red: bin '
               f'mean)</text>')
    out.append(f'<text x="12" y="{T + s / 2}" transform="rotate(-90 12 {T + s / 2})" '
               f'text-anchor="middle">accuracy</text></svg>')
    return "".join(out)
