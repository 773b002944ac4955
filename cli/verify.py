"""vkdsl verify, compile --bundle, demo: the kernels on this device, checked, bundled, shown."""
from __future__ import annotations

import json
import sys
import time

import click
import numpy as np

from .common import GATE_FAILED, device_option, json_option, open_device


def load_op_rows():
    """Register the op library's verify rows (ops/ sits above the core)."""
    import vkdsl.ops  # noqa: F401


def packed_format(case) -> str | None:
    """The packed weight format a case's kernel reads (ops.quant names), None for the others."""
    return case.params.get("fmt") or (case.op[8:] if case.op.startswith("dequant_") else None)


def model_formats(path: str) -> set[str]:
    """The packed formats the model at path keeps on the device (loaded as vkdsl-train does)."""
    from vkdsl.models import load_model_files
    from vkdsl.models.quantized import packed_formats
    return packed_formats(load_model_files(path)[0], "keep")


def picked_cases(spec, match=None, formats=None) -> list:
    """The cases of spec (a case file, or builtin) whose name contains match; formats: only the
    packed-format rows of these formats (None: every format)."""
    from vkdsl import cases as C
    load_op_rows()
    return [c for c in C.load(spec) if (match is None or match in c.name)
            and (formats is None or packed_format(c) in (None, *formats))]


def case_pairs(spec="builtin", match=None, root=None, formats=None) -> list:
    """(case, arrays, stale note) of every case of spec whose name contains match (and format is
    one of formats): against the goldens in root (the installed ones for the built-in cases), else
    the float64 references computed here."""
    from vkdsl import case_goldens as G
    from vkdsl import cases as C
    picked = picked_cases(spec, match, formats)
    if root is None and spec != C.BUILTIN:
        return G.with_references(picked)
    return G.with_goldens(picked, root)


def run_verify(match=None, root=None, repeat_warm=True, spec="builtin", formats=None):
    """(rows, timings) of every case of spec whose name contains match (format in formats)."""
    from vkdsl.cases import verify
    return verify(case_pairs(spec, match, root, formats), repeat_warm=repeat_warm)


def _given(name) -> bool:
    from click.core import ParameterSource
    return click.get_current_context().get_parameter_source(name) == ParameterSource.COMMANDLINE


@click.command()
@device_option
@json_option
@click.option("--cases", "spec", default="builtin", metavar="FILE",
              help="a Python file of vkdsl.cases.Case (its CASES list), or 'builtin': vkdsl's own "
                   "rows (default)")
@click.option("--match", default=None, help="only cases whose name contains this text")
@click.option("--golden", "root", default=None, type=click.Path(file_okay=False),
              help="folder holding v1/ (vkdsl golden make): check against these stored outputs "
                   "(default: the goldens installed with vkdsl for builtin, the float64 references "
                   "computed here for a file)")
@click.option("--all-devices", is_flag=True,
              help="every Vulkan device present, each in its own process")
@click.option("--all-profiles", is_flag=True,
              help="the device as it is and as each capability profile")
@click.option("--junit", "junit", default=None, type=click.Path(dir_okay=False),
              help="also write JUnit XML here: one test case per row per device and profile")
@click.option("--no-warm", is_flag=True,
              help="skip the second, warm pass (it only times the cached programs)")
@click.option("--model", "model", default=None, metavar="PATH",
              help="GGUF file or Hugging Face folder: of the packed-weight rows, only those of the "
                   "formats this model keeps on the device (as vkdsl-train's verify pass does)")
def verify(device, as_json, spec, match, root, all_devices, all_profiles, junit, no_warm, model):
    """Check kernels on the device against float64 references: vkdsl's own, or your cases
    (--cases)."""
    from vkdsl.fileio import atomic_write
    from .verify_report import Target, junit_xml, print_matrix, print_table, run_targets
    formats = model_formats(model) if model else None
    if all_devices and device is not None:
        raise click.UsageError("--device and --all-devices: give one")
    if all_profiles and _given("profile"):
        raise click.UsageError("--profile and --all-profiles: give one")
    if all_devices or all_profiles:
        import tempfile
        from vkdsl import case_goldens as G
        from vkdsl import cases as C
        from vkdsl.runtime.device import list_devices, select
        from vkdsl.runtime.profiles import PROFILES
        devs = ([(str(d.index), f"[{d.index}] {d.name}") for d in list_devices()] if all_devices
                else [(device, "[{0.index}] {0.name}".format(select(device)))])
        profs = ([("none", "as it is")] + [(p, f"profile {p}") for p in PROFILES] if all_profiles
                 else [(None, "")])
        targets = [Target(" / ".join(x for x in (dl, pl) if x), d, p) for d, dl in devs
                   for p, pl in profs]
        with tempfile.TemporaryDirectory(prefix="vkdsl-verify-") as tmp:
            if root is None and spec != C.BUILTIN:  # the float64 references once, for every target
                picked = picked_cases(spec, match)
                if not picked:
                    raise click.ClickException(f"{spec}: no case matches {match!r}")
                G.make_goldens(picked, tmp)
                root = tmp
            shared = ["--cases", spec, "--no-warm"] + (["--match", match] if match else []) + \
                (["--golden", root] if root else []) + (["--model", model] if model else [])
            run_targets(targets, shared)
        if as_json:
            for t in targets:
                for r in t.rows:
                    click.echo(json.dumps({"target": t.label, **r.as_dict()}))
                click.echo(json.dumps({"summary": True, "target": t.label, "error": t.error or None,
                                       "rows": len(t.rows),
                                       "failed": sum(not r.passed for r in t.rows)}))
        else:
            print_matrix(targets)
        failed = any(t.error or not t.rows or any(not r.passed for r in t.rows) for t in targets)
    else:
        dev = open_device(device, announce=not as_json)
        if not picked_cases(spec, match, formats):      # not a table of nothing that "fails"
            raise click.ClickException(f"{spec}: no case matches {match!r}")
        rows, times = run_verify(match, root, repeat_warm=not no_warm, spec=spec, formats=formats)
        from vkdsl.runtime.profiles import named
        prof = named()
        targets = [Target(f"[{dev.info.index}] {dev.info.name}"
                          + (f" / profile {prof.name}" if prof else ""), rows=rows, times=times)]
        if as_json:
            for r in rows:
                click.echo(json.dumps(r.as_dict()))
            click.echo(json.dumps({"summary": True, "rows": len(rows),
                                   "failed": sum(not r.passed for r in rows),
                                   "not_applicable": sum(not r.applicable for r in rows), **times}))
        else:
            print_table(rows, times)
        failed = not rows or any(not r.passed for r in rows)
    if junit:
        atomic_write(junit, junit_xml(targets))
        if not as_json:
            click.echo(f"JUnit XML: {junit}")
    sys.exit(1 if failed else 0)


@click.group()
def golden():
    """Goldens of your own cases: inputs and float64 outputs stored, checked without the
    reference."""


@golden.command("make")
@click.option("--cases", "spec", required=True, metavar="FILE",
              help="a Python file of vkdsl.cases.Case")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="folder to write v1/ into")
@click.option("--match", default=None, help="only cases whose name contains this text")
def golden_make(spec, out, match):
    """Store each case's inputs and float64 reference outputs (sha256 manifest, vkdsl's golden
    format)."""
    from vkdsl import case_goldens as G
    picked = picked_cases(spec, match)
    if not picked:
        raise click.ClickException(f"{spec}: no case matches {match!r}")
    man = G.make_goldens(picked, out)
    click.echo(f"wrote {len(man['cases'])} goldens to {out}/v1; check them with: vkdsl verify "
               f"--cases {spec} --golden {out}")


@click.command("compile")
@device_option
@click.option("--bundle", "bundle", required=True, type=click.Path(file_okay=False),
              help="folder to write every built-in kernel's SPIR-V to (kernels already there "
                   "are kept)")
@click.option("--for", "jobs", multiple=True, metavar='"COMMAND"',
              help='also every kernel this vkdsl or vkdsl-train command line uses: it runs once, '
                   'for real, recording what it compiles (repeatable), e.g. --for "vkdsl-train '
                   '--config job.toml"')
def compile_(device, bundle, jobs):
    """Write a SPIR-V bundle; run elsewhere with VKDSL_SPIRV_BUNDLE=DIR and no shader compiler."""
    dev = open_device(device)
    from vkdsl import compiler, handwritten, ops  # noqa: F401  (ops registers its kernel families)
    commands = [_job_command(j) for j in jobs]          # a malformed --for fails before any work
    run_verify(repeat_warm=False)          # every generated kernel the verify suite builds
    _demo(quiet=True)
    handwritten.builtin_variants(dev)      # every registered family's hand-written variants
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
        raise click.BadParameter(f"{job!r}: expected a vkdsl or vkdsl-train command line (not "
                                 f"vkdsl compile)", param_hint="--for")
    _check_parses(job, argv)
    return ([sys.executable, "-m", "vkdsl.cli"] + (["train"] if argv[0] == "vkdsl-train" else [])
            + argv[1:])


def _check_parses(job: str, argv: list[str]):
    """Parse a job's command line (and a training job's settings) the way it will be run, so that a
    usage error is reported now rather than recorded as a job that never ran."""
    group = click.get_current_context().find_root().command      # `vkdsl` itself (no import cycle)
    try:
        cmd, args, name = group, (["train"] if argv[0] == "vkdsl-train" else []) + argv[1:], "vkdsl"
        while isinstance(cmd, click.Group):
            if not args or args[0].startswith("-"):
                raise click.UsageError(f"expected a command of {name}: "
                                       f"{', '.join(cmd.list_commands(None))}")
            sub = cmd.get_command(click.Context(cmd), args[0])
            if sub is None:
                raise click.UsageError(f"no command {args[0]!r} in {name}")
            cmd, args, name = sub, args[1:], f"{name} {args[0]}"
        ctx = cmd.make_context(name, list(args))
        if name == "vkdsl train":  # and a new run's settings load (a resume's are its own)
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


def run_job(job: str, cmd: list[str], env: dict, failed: str, stdout=None):
    """Run a --for job once in env (`cmd`: _job_command's); a job whose gates fail (GATE_FAILED)
    still counts, any other non-zero exit is one line ending in `failed`."""
    import subprocess
    code = subprocess.run(cmd, env=env, stdout=stdout).returncode
    if code not in (0, GATE_FAILED):
        raise click.ClickException(f"--for {job!r} exited {code}; {failed}")


def _record(bundle, job, cmd) -> int:
    """Run one job with $VKDSL_SPIRV_RECORD=bundle (and no bundle to read from)."""
    import os
    from vkdsl.compiler import bundle as B
    env = {k: v for k, v in os.environ.items() if k != "VKDSL_SPIRV_BUNDLE"}
    env["VKDSL_SPIRV_RECORD"] = os.path.abspath(bundle)
    click.echo(f"recording {job!r} (it runs once)")
    run_job(job, cmd, env,
            "the bundle keeps the kernels it used before failing, and does not list the job")
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
                   f"{prog.recording.n_barriers} barriers; first call {first * 1e3:.0f} ms (trace, "
                   f"compile, record), replay {replay * 1e3:.2f} ms; max |p - numpy float64| = "
                   f"{err:.1e}")
    if err > 1e-5:
        raise click.ClickException(f"demo result differs from numpy by {err}")


@click.command()
@device_option
def demo(device):
    """Trace a small program once and replay it."""
    open_device(device)
    _demo()
