"""vkdsl tune: measure the CPU matmul kernels' tiles on a job's shapes, keep the winners per
device."""
from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

import click

from .common import device_option, open_device

SHAPE = re.compile(r"^(matmul|qmatmul:[a-z0-9_]+):(nn|nt|tn|tt):(\d+)x(\d+)x(\d+)$")


def _shape(text: str) -> tuple:
    m = SHAPE.match(text)
    if (not m or (m.group(1) != "matmul" and m.group(2) not in ("nt", "nn"))
            or 0 in (int(m.group(i)) for i in (3, 4, 5))):
        raise click.BadParameter(f"{text!r}: expected OP:FORM:MxNxK (each >= 1), e.g. "
                                 f"matmul:nt:1024x8x576 or qmatmul:q4_1:nt:1024x576x576 "
                                 f"(qmatmul forms: nt, nn)",
                                 param_hint="--shape")
    return (m.group(1), m.group(2), *(int(m.group(i)) for i in (3, 4, 5)))


def _shapes_of(job: str) -> list[tuple]:
    """Run a vkdsl / vkdsl-train command line once, for real, listing the matmul shapes it plans."""
    from .verify import _job_command, run_job
    cmd = _job_command(job)
    with tempfile.TemporaryDirectory() as tmp:
        where = os.path.join(tmp, "shapes.jsonl")
        click.echo(f"running {job!r} once to list its matmul shapes")
        run_job(job, cmd, dict(os.environ, VKDSL_TUNE_RECORD=where, VKDSL_TUNING="0"),
                "nothing tuned", stdout=subprocess.DEVNULL)
        if not os.path.exists(where):
            return []
        with open(where) as f:
            return [tuple(json.loads(line)) for line in f if line.strip()]


@click.command("tune")
@device_option
@click.option("--for", "jobs", multiple=True, metavar='"COMMAND"',
              help='tune the shapes this vkdsl or vkdsl-train command line plans (it runs once; '
                   'repeatable)')
@click.option("--shape", "shapes", multiple=True, metavar="OP:FORM:MxNxK",
              help="one shape: matmul:nt:1024x8x576, qmatmul:q4_1:nn:1024x576x1536 (repeatable)")
@click.option("--rounds", type=click.IntRange(1, 50), default=3, show_default=True,
              help="timing rounds per shape (best of)")
@click.option("--show", is_flag=True, help="print this device's tuning file and exit")
def tune(device, jobs, shapes, rounds, show):
    """Time every tile of the CPU matmul kernels on a job's shapes; keep the fastest per shape
    class.

    The winners go to this device's tuning file (vkdsl.tuning), which every later run reads; a
    tile is kept only when its output equals the default's bit for bit. Example:
    vkdsl tune --for "vkdsl-train --steps 1 --out runs/tune"
    """
    from vkdsl import tuning
    dev = open_device(device)
    if show:
        for where, e in ((tuning.path(dev), tuning.local_entries(dev)),
                         (tuning.shipped_path(dev), tuning.shipped_entries(dev))):
            if e or where == tuning.path(dev):
                click.echo(f"{where}: {len(e)} shape classes")
            for k, v in sorted(e.items()):
                click.echo(f"  {k:40s} {v['tile'][0]}x{v['tile'][1]}  ms {v.get('ms', {})}")
        return
    todo = [_shape(s) for s in shapes]
    if not todo and not jobs:
        raise click.UsageError('name what to tune: --for "COMMAND" or --shape OP:FORM:MxNxK')
    for job in jobs:
        todo += _shapes_of(job)
    from vkdsl.ops.tune import tune as run_tune
    try:
        path, new = run_tune(dev, todo, rounds, say=click.echo)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    changed = sum(tuple(v["tile"]) != tuning.DEFAULT_TILE for v in new.values())
    click.echo(f"tuned {len(new)} shape classes ({changed} off the default tile) into {path}")
