"""How `vkdsl verify` reports: the table of one device, the matrix of rows x targets (every device
and/or profile, each checked in its own process: a device is opened once per process, and a crash
on one target cannot stop the others), JSON lines and JUnit XML for CI systems."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

import click

from vkdsl.verify import Row


@dataclass
class Target:
    """One device seen through one profile, and what verify found there."""
    label: str
    device: str | None = None           # --device of the child (None: the default)
    profile: str | None = None          # --profile of the child (None: $VKDSL_PROFILE as it is)
    rows: list = field(default_factory=list)
    times: dict = field(default_factory=dict)
    error: str = ""  # the target could not be checked at all (its process failed)


def result(r: Row) -> str:
    return "n/a" if not r.applicable else "pass" if r.passed else "FAIL"


def print_table(rows, times):
    w = max([len(r.name) for r in rows] + [4])
    click.echo(f"{'case':<{w}}  {'shape':>14}  {'error':>9}  {'limit':>9}  measure  result")
    for r in rows:
        if not r.applicable:
            click.echo(f"{r.name:<{w}}  {'':>14}  {'':>9}  {r.limit:9.1e}  {r.measure:<7}  "
                       f"n/a: {r.note}")
            continue
        click.echo(f"{r.name:<{w}}  {r.shape:>14}  {r.error:9.2e}  {r.limit:9.1e}  {r.measure:<7}  "
                   + ("pass" if r.passed else "FAIL " + r.note))
    skipped = [r for r in rows if not r.applicable]
    failed = [r for r in rows if not r.passed]
    ran = len(rows) - len(skipped)
    why = "; ".join(f"{op}: {note}" for op, note in dict.fromkeys((r.op, r.note) for r in skipped))
    click.echo(f"{ran - len(failed)}/{ran} rows passed"
               + (f", {len(skipped)} not applicable on this device ({why})" if skipped else "")
               + f"; cold {times['cold_s']:.2f} s (compiles and builds pipelines)"
               + (f", warm {times['warm_s']:.2f} s" if times.get("warm_s") is not None else ""))


def run_targets(targets: list[Target], argv: list[str]) -> list[Target]:
    """Each target in a child `vkdsl verify ... --json` (argv: the options every child shares)."""
    for t in targets:
        cmd = [sys.executable, "-m", "vkdsl.cli", "verify", "--json", *argv]
        if t.device is not None:
            cmd += ["--device", t.device]
        if t.profile is not None:
            cmd += ["--profile", t.profile]
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        for line in p.stdout.splitlines():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if obj.get("summary"):
                t.times = obj
            elif isinstance(obj, dict) and "name" in obj:
                t.rows.append(Row.from_dict(obj))
        if p.returncode not in (0, 1) or not t.times:
            lines = p.stderr.strip().splitlines() or ["no output"]
            said = next((ln.removeprefix("Error: ") for ln in lines if ln.startswith("Error: ")),
                        lines[-1])
            t.error = f"verify exited {p.returncode} on this target: {said}"
    return targets


def print_matrix(targets: list[Target]):
    """One line per row, one column per target; then each target's count."""
    names = list(dict.fromkeys(r.name for t in targets for r in t.rows))
    by = [{r.name: r for r in t.rows} for t in targets]
    w = max([len(n) for n in names] + [4])
    cols = [f"T{i + 1}" for i in range(len(targets))]
    for c, t in zip(cols, targets):
        click.echo(f"{c}: {t.label}")
    click.echo(f"{'case':<{w}}  " + "  ".join(f"{c:>5}" for c in cols))
    for n in names:
        click.echo(f"{n:<{w}}  " + "  ".join(f"{result(b[n]) if n in b else '-':>5}" for b in by))
    for c, t in zip(cols, targets):
        ran = [r for r in t.rows if r.applicable]
        ok = sum(r.passed for r in ran)
        click.echo(f"{c}: " + (t.error if t.error else f"{ok}/{len(ran)} rows passed, "
                                                     f"{len(t.rows) - len(ran)} not applicable"))


def junit_xml(targets: list[Target]) -> bytes:
    """JUnit XML: one testsuite per target, one testcase per row; a failed row is a <failure> with
    the measured error and the limit, an inapplicable one <skipped>, a target that could not run
    one <error> testcase."""
    root = ET.Element("testsuites", name="vkdsl verify")
    totals, total_s = dict(tests=0, failures=0, errors=0, skipped=0), 0.0
    for t in targets:
        suite = ET.SubElement(root, "testsuite", name=t.label)
        counts = dict(tests=0, failures=0, errors=0, skipped=0)
        seconds = 0.0
        for r in t.rows:
            counts["tests"] += 1
            seconds += r.seconds
            case = ET.SubElement(suite, "testcase", name=r.name, classname=f"vkdsl.verify.{r.op}",
                                 time=f"{r.seconds:.6f}")
            if not r.applicable:
                counts["skipped"] += 1
                ET.SubElement(case, "skipped", message=f"not applicable: {r.note}")
            elif not r.passed:
                counts["failures"] += 1
                msg = (f"{r.measure} {r.error:.3e} > limit {r.limit:.3e}" if not r.note
                       else f"{r.note} (limit {r.measure} {r.limit:.3e})")
                ET.SubElement(case, "failure", message=msg,
                              type=r.measure).text = f"limit's reason: {r.reason}"
        if t.error:
            counts["tests"] += 1
            counts["errors"] += 1
            case = ET.SubElement(suite, "testcase", name="verify", classname="vkdsl.verify")
            ET.SubElement(case, "error", message=t.error, type="TargetFailed")
        for k, v in counts.items():
            suite.set(k, str(v))
            totals[k] += v
        suite.set("time", f"{seconds:.6f}")
        total_s += seconds
    for k, v in totals.items():
        root.set(k, str(v))
    root.set("time", f"{total_s:.6f}")
    ET.indent(root)
    return b'<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="utf-8")
