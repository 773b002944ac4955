"""vkdsl verify, compile --bundle, demo: the kernels on this device, checked, bundled, shown."""
from __future__ import annotations

import json
import sys
import time

import click
import numpy as np

from .common import GATE_FAILED, device_option, golden_cases, json_option, open_device


def load_op_rows():
    """Register the op library's verify rows (ops/ sits above the core)."""
    import vkdsl.ops  # noqa: F401


def run_verify(match=None, root=None, repeat_warm=True):
    """(rows, timings) of every golden case whose name contains match, core and op library."""
    from vkdsl.verify import verify
    load_op_rows()
    return verify(golden_cases(match, root=root), repeat_warm=repeat_warm)


@click.command()
@device_option
@json_option
@click.option("--match", default=None, help="only cases whose name contains this text")
@click.option("--golden", "root", default=None, type=click.Path(file_okay=False),
              help="folder holding v1/ (default: the goldens installed with vkdsl)")
def verify(device, as_json, match, root):
    """Run every built-in kernel on the device against the golden outputs."""
    open_device(device, announce=not as_json)
    rows, times = run_verify(match, root)
    failed = [r for r in rows if not r.passed]
    skipped = [r for r in rows if not r.applicable]
    if as_json:
        for r in rows:
            click.echo(json.dumps(r.as_dict()))
        click.echo(json.dumps({"summary": True, "rows": len(rows), "failed": len(failed),
                               "not_applicable": len(skipped), **times}))
    else:
        w = max([len(r.name) for r in rows] + [4])
        click.echo(f"{'case':<{w}}  {'shape':>14}  {'nmse':>9}  {'limit':>9}  result")
        for r in rows:
            result = "pass" if r.passed else "FAIL " + r.note
            click.echo(f"{r.name:<{w}}  {r.shape:>14}  {r.error:9.2e}  {r.limit:9.1e}  {result}" if r.applicable else
                       f"{r.name:<{w}}  {'':>14}  {'':>9}  {r.limit:9.1e}  n/a: {r.note}")
        ran = len(rows) - len(skipped)
        click.echo(f"{ran - len(failed)}/{ran} rows passed"
                   + (f", {len(skipped)} not applicable on this device ({_why(skipped)})" if skipped else "")
                   + f"; cold {times['cold_s']:.2f} s (compiles and builds pipelines), warm {times['warm_s']:.2f} s")
    sys.exit(1 if failed or not rows else 0)


def _why(rows) -> str:
    return "; ".join(f"{op}: {note}" for op, note in dict.fromkeys((r.op, r.note) for r in rows))


@click.command("compile")
@device_option
@click.option("--bundle", "bundle", required=True, type=click.Path(file_okay=False),
              help="folder to write every built-in kernel's SPIR-V to (kernels already there are kept)")
@click.option("--for", "jobs", multiple=True, metavar='"COMMAND"',
              help='also every kernel this vkdsl or vkdsl-train command line uses: it runs once, for real, '
                   'recording what it compiles (repeatable), e.g. --for "vkdsl-train --config job.toml"')
def compile_(device, bundle, jobs):
    """Write a SPIR-V bundle; run elsewhere with VKDSL_SPIRV_BUNDLE=DIR and no shader compiler."""
    dev = open_device(device)
    from vkdsl import compiler, matmul, ops
    commands = [_job_command(j) for j in jobs]          # a malformed --for fails before any work
    run_verify(repeat_warm=False)          # every generated kernel the verify suite builds
    _demo(quiet=True)
    for library in (matmul, ops):          # each library names its own hand-written variants
        library.builtin_variants(dev)
    i = dev.info
    n = compiler.write_bundle(bundle, dict(compiler.compiled_this_process),
                              {"device": f"{i.name} ({i.driver} {i.driver_info})"})
    click.echo(f"wrote {n} built-in kernels to {bundle}")
    for job, cmd in zip(jobs, commands):
        n = _record(bundle, job, cmd)
        click.echo(f"recorded {job!r}: the bundle holds {n} kernels")
    click.echo(f"use it with VKDSL_SPIRV_BUNDLE={bundle}")


def _job_command(job: str) -> list[str]:
    import shlex
    try:
        argv = shlex.split(job)
    except ValueError as e:
        raise click.BadParameter(f"{job!r}: {e}", param_hint="--for") from None
    if not argv or argv[0] not in ("vkdsl", "vkdsl-train") or argv[1:2] == ["compile"]:
        raise click.BadParameter(f"{job!r}: expected a vkdsl or vkdsl-train command line (not vkdsl compile)",
                                 param_hint="--for")
    _check_parses(job, argv)
    return [sys.executable, "-m", "vkdsl.cli"] + (["train"] if argv[0] == "vkdsl-train" else []) + argv[1:]


def _check_parses(job: str, argv: list[str]):
    """Parse a job's command line (and a training job's settings) the way it will be run, so that a
    usage error is reported now rather than recorded as a job that never ran."""
    group = click.get_current_context().find_root().command      # `vkdsl` itself (no import cycle)
    try:
        cmd, args, name = group, (["train"] if argv[0] == "vkdsl-train" else []) + argv[1:], "vkdsl"
        while isinstance(cmd, click.Group):
            if not args or args[0].startswith("-"):
                raise click.UsageError(f"expected a command of {name}: {', '.join(cmd.list_commands(None))}")
            sub = cmd.get_command(click.Context(cmd), args[0])
            if sub is None:
                raise click.UsageError(f"no command {args[0]!r} in {name}")
            cmd, args, name = sub, args[1:], f"{name} {args[0]}"
        ctx = cmd.make_context(name, list(args))
        if name == "vkdsl train":            # and a new run's settings load (a resume's are its own)
            from vkdsl.train import config as C
            p = {k: v for k, v in ctx.params.items() if v is not None}
            if not p.get("resume"):
                C.load(p.get("config_path"), {k: v for k, v in p.items() if k in C.FIELDS})
    except (click.ClickException, ValueError) as e:
        msg = e.format_message() if isinstance(e, click.ClickException) else str(e)
        raise click.BadParameter(f"{job!r} does not parse: {msg}", param_hint="--for") from None
    except click.exceptions.Exit:
        raise click.BadParameter(f"{job!r} only prints (--help or --version): nothing to record",
                                 param_hint="--for") from None


def _record(bundle, job, cmd) -> int:
    """Run one job with $VKDSL_SPIRV_RECORD=bundle; a job whose gates fail (GATE_FAILED) still counts."""
    import os
    import subprocess
    from vkdsl.compiler import bundle as B
    env = {k: v for k, v in os.environ.items() if k != "VKDSL_SPIRV_BUNDLE"}
    env["VKDSL_SPIRV_RECORD"] = os.path.abspath(bundle)
    click.echo(f"recording {job!r} (it runs once)")
    code = subprocess.run(cmd, env=env).returncode
    if code not in (0, GATE_FAILED):
        raise click.ClickException(f"--for {job!r} exited {code}; the bundle keeps the kernels it used before "
                                   f"failing, and does not list the job")
    return B.add(bundle, {}, {"jobs": [job]})


def _demo(quiet=False):
    """A two-layer MLP with a softmax head, traced once and replayed."""
    import vkdsl
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((64, 128)).astype(np.float32) / 8
    w2 = rng.standard_normal((128, 10)).astype(np.float32) / 11
    W1, W2 = vkdsl.tensor(w1), vkdsl.tensor(w2)

    @vkdsl.trace
    def mlp(x):
        h = (x @ W1).maximum(0.0)
        z = h @ W2
        e = (z - z.max(axis=-1, keepdim=True)).exp()
        return e / e.sum(axis=-1, keepdim=True)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    t = time.perf_counter()
    p = mlp(x)
    first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(20):
        p = mlp(x)
    replay = (time.perf_counter() - t) / 20
    z = np.maximum(x.astype(np.float64) @ w1, 0) @ w2
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    err = float(np.abs(p - ref).max())
    prog = mlp.program(x)
    if not quiet:
        click.echo(f"demo: traced MLP 256x64 -> 128 -> 10 + softmax: {len(prog.steps)} kernels, "
                   f"{prog.recording.n_barriers} barriers; first call {first * 1e3:.0f} ms (trace, compile, "
                   f"record), replay {replay * 1e3:.2f} ms; max |p - numpy float64| = {err:.1e}")
    if err > 1e-5:
        raise click.ClickException(f"demo result differs from numpy by {err}")


@click.command()
@device_option
def demo(device):
    """Trace a small program once and replay it."""
    open_device(device)
    _demo()
