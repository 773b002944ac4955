"""report.html for a run folder, one panel per question a reader asks: did training fit, did it
transfer (every failure surface, base -> after SFT -> after DPO, with intervals), what did it cost,
what DPO did, what the update looks like, the gates, and where it came from. Self-contained:
inline SVG and CSS, no script, no network. `compare_report` puts two runs side by side.

Reads what the trainer writes: metrics.jsonl (step, eval, dpo_step records), summary.json (the
final evidence, DPO evidence, gates), base_eval.json, config.json and the adapter manifest."""
from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path

from vkdsl.fileio import atomic_write

from .charts import bar_chart, line_chart, reliability_chart
from .evidence import DpoEvidence, Evidence, Gate

CSS = ("body{font:14px/1.45 system-ui,sans-serif;max-width:1000px;margin:24px auto;padding:0 "
       "16px;color:#222}"
       "h2{margin-top:28px;border-bottom:1px solid "
       "#ddd}table{border-collapse:collapse;margin:8px 0 14px}"
       "td,th{border:1px solid #ccc;padding:3px "
       "8px;text-align:right;vertical-align:top}th{background:#f3f3f3}"
       "td:first-child,th:first-child{text-align:left}.pass{color:#1a7f37;font-weight:600}"
       ".fail{color:#c62828;font-weight:600}.q{color:#555;margin:2px 0 "
       "8px}.row{display:flex;gap:12px;flex-wrap:wrap}code{background:#f5f5f5;padding:1px "
       "4px;word-break:break-all}")


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) of each record: the line names a bad value the panels meet later."""
    rows = []
    if path.is_file():
        for i, line in enumerate(_text(path).splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON ({e})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{i}: a {type(row).__name__}, expected a record "
                                     f"(a JSON object)")
                rows.append((i, row))
    return rows


def _read_json(path: Path, kind: type = dict):
    """The file's JSON value (None when there is no such file), which must be of `kind`."""
    if not path.is_file():
        return None
    try:
        v = json.loads(_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(v, kind):
        raise ValueError(f"{path}: a JSON {type(v).__name__}, expected a JSON "
                         f"{'object' if kind is dict else kind.__name__}")
    return v


def _e(x) -> str:
    return html.escape(str(x))


def _num(v, nd=3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}f}" if abs(v) >= 10 ** -nd or v == 0 else f"{v:.2e}"
    return str(v)


def html_table(head, rows, raw=False) -> str:
    """A table of cell strings (escaped unless raw)."""
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c if raw else _e(c)}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


# what a finished run folder holds besides config.json and summary.json
RECORDS = ("metrics.jsonl", "gates.json", "adapter.npz", "adapter/adapter_model.safetensors",
           "adapter/adapter_config.json", "adapter/vkdsl_manifest.json", "adapter.gguf")


class RunData:
    """Everything the panels read from one run folder."""

    def __init__(self, run_dir):
        self.dir = Path(run_dir)
        if not self.dir.is_dir():
            raise FileNotFoundError(f"{self.dir}: no such run folder")
        if not (self.dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.dir}: not a vkdsl-train run folder (no config.json; a "
                                    f"run writes it before anything else)")
        # a finished run (summary.json is its last record) has every record; one missing was deleted
        # or lost, and a page without it would tell a different story ("no SFT steps were run")
        finished = (self.dir / "summary.json").is_file()
        missing = [n for n in RECORDS if finished and not (self.dir / n).exists()]
        if missing:
            raise FileNotFoundError(f"{self.dir}: a finished run (summary.json) without "
                                    f"{', '.join(missing)}: deleted or lost; the report would "
                                    f"misstate the run")
        self.finished = finished
        self.metrics = self.dir / "metrics.jsonl"
        self.rows = _read_jsonl(self.metrics)
        self.summary = _read_json(self.dir / "summary.json") or {}
        self.config = _read_json(self.dir / "config.json") or {}
        if "objective" not in self.config:      # e.g. a Hugging Face model folder's config.json
            raise ValueError(f"{self.dir / 'config.json'}: not a run's settings (no objective); "
                             f"is {self.dir} a vkdsl-train run folder?")
        self.manifest = _read_json(self.dir / "adapter" / "vkdsl_manifest.json") or {}
        base = _read_json(self.dir / "base_eval.json") or {}
        gates = _read_json(self.dir / "gates.json", list)
        # the records as their types: a record of another shape is one line naming its file
        evals = [r for _, r in self.rows if r.get("event") == "eval"]
        self.base = self._read_as("base_eval.json", Evidence.from_json, base.get("base"))
        where = "gates.json" if gates is not None else "summary.json"
        if gates is None:
            gates = self._read_as(where, _list, self.summary.get("gates")) or []
        self.gates = [self._read_as(where, Gate.from_record, g) for g in gates]
        last_eval = evals[-1] if evals else {}
        self.final = (self._read_as("summary.json", Evidence.from_json, self.summary["final"])
                      if self.summary.get("final") else
                      self._read_as("metrics.jsonl", Evidence.from_json, last_eval))
        self.dpo = (self._read_as("summary.json", DpoEvidence.from_json, self.summary["dpo"])
                    if self.summary.get("dpo") else None)

    def _read_as(self, name: str, make, value):
        if value is None:
            return None
        try:
            return make(value)
        except (AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"{self.dir / name}: not in the shape vkdsl-train writes ({e})"
                             ) from None

    def steps(self, event, key):
        """(step, value) of each `event` record that has `key`, every value a number."""
        out = []
        for line, r in self.rows:
            if r.get("event") != event or r.get(key) is None:
                continue
            step, v = r.get("step"), r[key]
            for what, x in (("step", step), (key, v)):
                if not isinstance(x, (int, float)) or isinstance(x, bool):
                    raise ValueError(f"{self.metrics}:{line}: {what} is {json.dumps(x)[:40]}, "
                                     f"expected a number")
            out.append((step, v))
        return out


def _list(v):
    if not isinstance(v, list):
        raise ValueError(f"gates is {json.dumps(v)[:40]}, expected a list")
    return v


def _surface_rows(stages: list[tuple[str, Evidence]]) -> list[list]:
    """One row per surface, one column per stage."""
    def acc(e):
        if e.heldout_acc is None:
            return "–"
        ci = e.heldout_acc_ci
        return f"{e.heldout_acc:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")

    def worst(e):
        s = e.slices or {}
        w = s.get("worst")
        return f"{w}: {_num(s['categories'][w]['accuracy'])}" if w else "–"

    def stab(e):
        f = e.stability_fp32 or {}
        return _num(f.get("agreement")) + (f" of {f['rows']}" if f.get("rows") else "")
    lines = [("task: held-out label accuracy, Wilson 95%", acc),
             ("held-out loss (nats/token)", lambda e: _num(e.heldout_loss)),
             ("target probability within the labels", lambda e: _num(e.heldout_target_prob)),
             ("calibration: ECE (10 bins)", lambda e: _num((e.calibration or {}).get("ece"))),
             ("format: greedy output = one label + end-of-turn", lambda e: _num(e.format_valid)),
             ("slices: worst category accuracy", worst),
             ("preservation change vs base (nats/token)", lambda e: _num(e.preservation_delta, 4)),
             ("stability: decisions unchanged on the fp32 base", stab)]
    return [[name] + [fn(e) for _, e in stages] for name, fn in lines]


def _stages(d: RunData) -> list[tuple[str, Evidence]]:
    out = [("base", d.base or Evidence())]
    if d.final.step is not None and d.summary.get("sft_steps"):
        out.append(("after SFT", d.final))
    if d.dpo and d.dpo.after:
        out.append(("after DPO",
                    dataclasses.replace(d.dpo.after, preservation_delta=d.dpo.preservation_delta)))
    return out


def _fit(d: RunData) -> str:
    loss, held, lr = d.steps("step", "loss"), d.steps("eval", "heldout_loss"), d.steps("step", "lr")
    if not loss:
        return "<p>No SFT steps were run.</p>"
    series = {"train loss (batch)": loss}
    if held:
        series["held-out loss"] = held
    return ("<div class='row'>" + line_chart(series, "SFT step", "nats/token", w=620) +
            line_chart({"learning rate": lr}, "SFT step", "lr", w=340) + "</div>")


def _transfer(d: RunData) -> str:
    st = _stages(d)
    parts = [html_table(["surface"] + [n for n, _ in st], _surface_rows(st))]
    rel = [reliability_chart(e.calibration["bins"], n) for n, e in st if e.calibration]
    if rel:
        parts.append("<p class='q'>Reliability: accuracy per bin of the winning label's "
                     "probability (bar), the diagonal is perfect calibration; n = rows in the "
                     "bin.</p><div class='row'>" + "".join(rel) + "</div>")
    fails = [(n, f) for n, e in st for f in e.format_failures]
    if fails:
        table = html_table(["stage", "row", "expected", "generated"],
                           [[n, f["row"].rsplit("/", 1)[-1], f["expected"], repr(f["generated"])]
                            for n, f in fails])
        parts.append("<p class='q'>Format failures, verbatim (greedy, up to three per stage):</p>"
                     + table)
    return "".join(parts)


def _cost(d: RunData) -> str:
    st = _stages(d)
    cats = {}
    for name, e in st:
        for c, v in ((e.slices or {}).get("categories") or {}).items():
            cats.setdefault(c, {})[name] = v
    if not cats:
        return "<p>No per-category evidence.</p>"
    names = [n for n, _ in st]
    rows = [[c] + [f"{_num(v[n]['loss'])} / {_num(v[n]['accuracy'])}" if n in v else "–"
                   for n in names]
            for c, v in sorted(cats.items())]
    last = names[-1]
    change = {c: v[last]["accuracy"] - v["base"]["accuracy"] for c, v in cats.items()
              if last in v and "base" in v and v[last]["accuracy"] is not None
              and v["base"]["accuracy"] is not None}
    chart = (bar_chart(change, f"accuracy change, base -> {last}") if change and last != "base"
             else "")
    return html_table(["category: loss / accuracy"] + names, rows) + chart


def _dpo(d: RunData) -> str:
    if not d.dpo:
        return "<p>No DPO stage in this run.</p>"
    from .dpo import margin_story
    split = d.dpo.heldout or d.dpo.train
    losses = [(i + 1, v) for i, (_, v) in enumerate(d.steps("dpo_step", "dpo_loss"))]
    chart = line_chart({"DPO loss": losses}, "DPO step", "loss", w=520) if len(losses) >= 2 else ""
    fields = ("pair_accuracy", "improvement_accuracy", "margin_improvement", "chosen_drift",
              "rejected_drift", "pairs")
    rows = [[k, _num(getattr(split, k, None))] for k in fields]
    story = f"<p>{_e(margin_story(split))}</p>" if split else ""
    return (chart + html_table(["held-out pairs" if d.dpo.heldout else "training pairs", "value"],
                               rows) + story)


def _update(d: RunData) -> str:
    spec = d.final.spectrum or {}
    if not spec:
        return "<p>No spectrum recorded.</p>"
    rows = [[m, ", ".join(f"{x:.3g}" for x in s["sv"]), _num(s["stable_rank"], 2), _num(s["fro"])]
            for m, s in spec.items()]
    first = dict(list(spec.items())[:6])
    chart = line_chart({m: [x / s["sv"][0] for x in s["sv"]] for m, s in first.items() if s["sv"]
                        and s["sv"][0] > 0},
                       "singular value index", "sigma_i / sigma_1 (log)", log=True, w=620)
    return (chart + html_table(["module", "top singular values of s·A·B", "stable rank",
                                "||s·A·B||_F"], rows))


def _gates(d: RunData) -> str:
    if not d.gates:
        return "<p>No gates recorded.</p>"
    return html_table(["gate", "result", "detail"],
                      [[_e(g.gate), f"<span class='{'pass' if g.passed else 'fail'}'>"
                                    f"{'PASS' if g.passed else 'FAIL'}</span>", _e(g.detail)]
                       for g in d.gates], raw=True)


def _provenance(d: RunData) -> str:
    m, c = d.manifest, d.config
    rows = [["model", c.get("model") or "the default SmolLM2-135M-Instruct"],
            ["base sha256",
             (m.get("base") or {}).get("sha256", "–") if isinstance(m.get("base"), dict)
             else m.get("base", "–")],
            ["tokenizer sha256", m.get("tokenizer_sha256", "–")],
            ["device", m.get("device", "–")],
            ["vkdsl", m.get("vkdsl_version", m.get("vkdsl", "–"))],
            ["objective", c.get("objective", "–")]]
    for k, v in (m.get("data") or {}).items():
        rows.append([k, f"{Path(str(v.get('file', ''))).name} (sha256 "
                        f"{str(v.get('sha256', ''))[:16]}...)"])
    rows += [[f"setting: {k}", json.dumps(v) if isinstance(v, (list, dict)) else v]
             for k, v in c.items()
             if not str(k).endswith("_file") and k != "model"]
    return html_table(["what", "value"], rows)


PANELS = [("Did training fit?",
           "Training loss per step and held-out loss per evaluation (same units), the "
           "learning rate beside them.", _fit),
          ("Did it transfer?", "Every failure surface before training, after SFT and after DPO.",
           _transfer),
          ("What did it cost?", "Per category: held-out loss and label accuracy at each stage.",
           _cost),
          ("DPO", "The preference stage: its loss, and how the margin moved (chosen and rejected "
                  "separately).", _dpo),
          ("The update", "Spectrum of each module's learned s·A·B (at most r nonzero values).",
           _update),
          ("Gates", "Each surface's gate, separately; no weighted sum.", _gates),
          ("Provenance", "Where this run came from.", _provenance)]


def _page(title, body) -> bytes:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
            f"<style>{CSS}</style></head><body>{body}</body></html>").encode("utf-8")


def build_report(run_dir) -> Path:
    d = RunData(run_dir)
    ok = all(g.passed for g in d.gates) if d.gates else None
    head = (f"<h1>vkdsl run {_e(d.dir.name)}</h1><p>{_e(d.config.get('objective', ''))} on "
            f"{_e(d.config.get('model') or 'SmolLM2-135M-Instruct')}: "
            + ("" if ok is None
               else f"<span class='{'pass' if ok else 'fail'}'>{sum(g.passed for g in d.gates)} of "
               f"{len(d.gates)} gates pass</span>") + "</p>"
            + ("" if d.finished
               else "<p class='fail'>This run has not finished (no summary.json): the page shows "
                    "what it recorded so far.</p>"))
    body = head + "".join(f"<h2>{_e(t)}</h2><p class='q'>{_e(q)}</p>{fn(d)}" for t, q, fn in PANELS)
    return atomic_write(d.dir / "report.html", _page(f"vkdsl run {d.dir.name}", body))


def compare_report(run_a, run_b, out=None) -> Path:
    """Two runs side by side: every surface at each run's last stage and its base, the gates, and
    the settings that differ."""
    a, b = RunData(run_a), RunData(run_b)
    sa, sb = _stages(a), _stages(b)
    cols = ([(f"{a.dir.name}: {n}", e) for n, e in (sa[0], sa[-1])]
            + [(f"{b.dir.name}: {n}", e) for n, e in (sb[0], sb[-1])])
    names = list(dict.fromkeys(g.gate for g in a.gates + b.gates))

    def res(d, g):
        hit = next((x for x in d.gates if x.gate == g), None)
        return "–" if hit is None else ("PASS" if hit.passed else "FAIL")
    keys = sorted(set(a.config) | set(b.config))
    diff = [[k, json.dumps(a.config.get(k)), json.dumps(b.config.get(k))] for k in keys
            if a.config.get(k) != b.config.get(k)]
    body = (f"<h1>vkdsl runs {_e(a.dir.name)} and {_e(b.dir.name)}</h1><h2>Surfaces</h2>"
            + html_table(["surface"] + [n for n, _ in cols], _surface_rows(cols))
            + "<h2>Gates</h2>"
            + html_table(["gate", a.dir.name, b.dir.name],
                         [[g, res(a, g), res(b, g)] for g in names])
            + "<h2>Settings that differ</h2>"
            + (html_table(["setting", a.dir.name, b.dir.name], diff) if diff else
               "<p>None: the same settings.</p>")
            + "<div class='row'>" + _fit(a) + _fit(b) + "</div>")
    return atomic_write(Path(out) if out else a.dir / f"compare-{b.dir.name}.html",
                        _page("vkdsl compare", body))
