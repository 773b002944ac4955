"""vkdsl-train (and `vkdsl train`): LoRA SFT (+ target-masked KL to the base), then DPO, with
preflight, evidence and gates. Every option is generated from train.config.TrainConfig, where each
setting is declared with its help line, so the command line and the settings cannot drift apart.

    vkdsl-train                       # the bundled default run on SmolLM2-135M-Instruct
    vkdsl-train --out runs/x --steps 20 --tmkl 0.05 --targets attn_q,attn_v,ffn_up
    vkdsl-train --config my.toml      # any setting, TOML keys = setting names
    vkdsl-train --resume runs/x       # continue a stopped run from its last checkpoint
    vkdsl-train --objective dpo --reference none   # DPO only, reference-free control
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from vkdsl.fileio import make_folder
from vkdsl.train import config as C

from .common import GATE_FAILED, USER_ERRORS, _set_profile, open_device, user_error_line

TYPES = {bool: None, int: click.INT, float: click.FLOAT, str: click.STRING, list: click.STRING}


def _option(name: str) -> click.Option:
    default = C.default_of(name)
    dash = name.replace("_", "-")
    shown = ",".join(map(str, default)) if isinstance(default, list) else default
    if isinstance(default, str) and default.startswith(str(C.DATA)):
        shown = f"bundled {Path(default).name}"
    help_ = f"{C.HELP[name]}  [default: {shown!r}]"
    if isinstance(default, bool):
        return click.Option([f"--{dash}/--no-{dash}", name], default=None, help=help_)
    kind = "comma-separated" if isinstance(default, list) else None
    return click.Option([f"--{dash}", name], type=TYPES[type(default)], default=None,
                        metavar=kind.upper().replace("-", "_") if kind else None, help=help_)


def settings(config_path, resume, over) -> tuple[C.TrainConfig, str]:
    """The run's settings and folder: defaults <- TOML <- flags, or a resume's config <- flags."""
    if resume:
        saved = Path(resume) / "config.json"
        if not saved.is_file():
            raise C.ConfigError(f"--resume {resume}: no config.json there")
        try:
            values = json.loads(saved.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise C.ConfigError(f"{saved}: not the run's settings as JSON ({e})") from None
        if not isinstance(values, dict):
            raise C.ConfigError(f"{saved}: expected an object of settings, found "
                                f"{type(values).__name__}")
        if config_path:
            raise C.ConfigError(f"--resume {resume} runs with its own config.json; --config "
                                f"{config_path} would replace it (give changed settings as flags)")
        cfg = C.load(None, {**values, **over})
        _inputs_exist(cfg)
        return cfg, resume
    cfg = C.load(config_path, over)
    _inputs_exist(cfg)
    cfg.out = cfg.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg, cfg.out


def _inputs_exist(cfg):
    """Every file the settings name is there before a run folder is made for them: a mistyped
    path is one line, not a run folder holding only the error."""
    for name in C.FILE_FIELDS:
        path = getattr(cfg, name)
        if not path:
            continue
        if not os.path.exists(path):
            raise C.ConfigError(f"config: {name} {path}: no such file"
                                + (" or folder" if name == "model" else ""))
        if name != "model" and not os.path.isfile(path):
            raise C.ConfigError(f"config: {name} {path}: a folder, expected a file")


def _fresh_folder(out: str, overwrite: bool):
    """A new run's folder is empty: a run's records there (config, checkpoint, metrics) would be
    replaced or appended to. --overwrite empties a run folder first, and only a run folder."""
    path = make_folder(out)                 # a file in its way is one line now, not mid-run
    if not any(path.iterdir()):
        return
    leftovers = {p.name for p in path.iterdir()} <= {"train.log"}  # a run killed before config.json
    if not overwrite:
        of_a_run = " of a run" if (path / "config.json").is_file() else ""
        raise C.ConfigError(f"--out {out} already holds files{of_a_run}: continue it with "
                            f"--resume {out}, or start over with --overwrite (which empties it)")
    if not ((path / "config.json").is_file() or leftovers):
        raise C.ConfigError(f"--overwrite: {out} is not a run folder (no config.json); refusing "
                            f"to empty it")
    import shutil
    for p in path.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _record_changes(cfg, out, rep):
    """Settings a resume changes (against the folder's config.json, which settings() has read):
    printed, and config.json rewritten (atomically) to what now runs."""
    saved = C.load(None, json.loads((Path(out) / "config.json").read_text(encoding="utf-8")))
    changed = [(k, getattr(saved, k), getattr(cfg, k)) for k in C.FIELDS
               if getattr(saved, k) != getattr(cfg, k)]
    for k, old, new in changed:
        rep.outcome(f"resume: {k} changed from {json.dumps(old)} to {json.dumps(new)} (given now)")
    if changed:
        from vkdsl.train.checkpoint import atomic_write
        atomic_write(Path(out) / "config.json", cfg.dumps().encode())


def _ranks(g, cfg, out):
    """Under MPI: this rank's device (train.distributed.pick_device), the table of every rank's
    device printed by rank 0, and where this rank writes: rank 0 the run folder, the others a
    private scratch folder (only rank 0 writes checkpoints, adapters, manifest and report)."""
    from vkdsl.train import distributed
    out = cfg.out = g.bcast(out)             # rank 0's folder (a default one is named by its clock)
    # the settings and what the environment changes about the computation: the capability profile
    profile = os.environ.get("VKDSL_PROFILE", "").strip() or "none"
    distributed.same_settings(g, cfg.dumps() + f"\nprofile {profile}")
    distributed.pick_device(g)
    dev = open_device(None, announce=False).info
    mine = (f"rank {g.rank}: [{dev.index}] {dev.name} ({dev.driver} {dev.driver_info}), profile "
            f"{profile}, precision {cfg.precision}")
    table = g.allgather(mine)
    if g.root:
        click.echo(f"vkdsl-train: {g.size} processes over MPI, one adapter; global batch "
                   f"{cfg.batch_size} x {cfg.grad_accum} x {g.size} rows per step", err=True)
        for line in table:
            click.echo("  " + line, err=True)
        return out, table
    import tempfile
    cfg.quiet = True                        # rank 0 alone prints, the outcome lines too
    sys.stdout = open(os.devnull, "w")
    return tempfile.mkdtemp(prefix=f"vkdsl-rank{g.rank}-"), table


def _plan(cfg) -> int:
    """vkdsl-train --plan: the model and adapters loaded, the run's device memory planned and
    printed (train.memplan); nothing trained, no run folder written."""
    import tempfile
    from vkdsl.precision import matmul_precision
    from vkdsl.train.trainer import run
    open_device(None)
    cfg.quiet = False
    with (tempfile.TemporaryDirectory(prefix="vkdsl-plan-") as scratch,
          matmul_precision(cfg.precision)):
        run(cfg, scratch, plan_only=True)
    return 0


def _run(config_path, resume, over, mode="auto", overwrite=False, plan=False) -> int:
    from vkdsl.train import distributed
    from vkdsl.train.progress import Reporter
    from vkdsl.train.stages import dpo_stage, export
    from vkdsl.precision import matmul_precision
    from vkdsl.train.trainer import run
    from vkdsl.environment import check_environment
    check_environment()                     # a bad $VKDSL_*: one line before any work
    cfg, out = settings(config_path, resume, over)
    say = Reporter(None, cfg.quiet, cfg.jsonl)  # before the run's own (it logs to the run folder)
    env_precision = os.environ.get("VKDSL_PRECISION", "").strip()
    if env_precision and env_precision != cfg.precision:
        say.say(f"VKDSL_PRECISION={env_precision} is set; this run computes at its precision "
                f"setting, {cfg.precision} (--precision)")
    if plan:
        return _plan(cfg)
    g = distributed.group(mode)
    if g.root:
        if resume:
            _record_changes(cfg, out, say)
        else:
            _fresh_folder(out, overwrite)
    devices = None
    if g.size > 1:
        out, devices = _ranks(g, cfg, out)
    # a device that is not there fails before the model loads
    dev = open_device(None)
    if cfg.precision == "fp16":             # and so does one with no fp16 matmul
        from vkdsl.matmul import fp16_choice
        say.say("precision fp16: matmul variant %s, %s" % fp16_choice(dev))
    files, check = None, None
    if cfg.verify:      # the kernels of the formats the model keeps packed, and no others
        from vkdsl.models import load_model_files
        from vkdsl.models.default import default_model_path
        from vkdsl.models.quantized import packed_formats
        from .verify_pass import VerifyPass
        files = load_model_files(cfg.model or default_model_path())
        # in a process of its own beside loading and the base evaluation (under MPI: here, first)
        check = VerifyPass(cfg.precision, max(cfg.max_len, cfg.window),
                           packed_formats(files[0], cfg.quant), apart=g.size == 1)
        if g.size > 1:
            check.join(say)
            check = None
    t0 = time.perf_counter()
    try:
        with matmul_precision(cfg.precision):
            r = run(cfg, out, resume=resume, group=g, files=files,
                    before_training=check.join if check else None)
            r.devices = devices
            dpo_ev = dpo_stage(r) if "dpo" in cfg.objective else None
            if g.root:
                export(r, dpo_ev)
            else:
                import shutil
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if check:
            check.cancel()
    from vkdsl.trace import BUILT
    r.r.outcome(f"run folder: {out}  (total {time.perf_counter() - t0:.0f}s, training "
                f"{r.train_seconds:.0f}s; "
            f"{BUILT['programs']} device programs built in {BUILT['seconds']:.0f}s)")
    return 0 if all(g.passed for g in r.gates) else GATE_FAILED


def _main(config_path, resume, distributed="auto", overwrite=False, plan=False, **values):
    over = {k: v for k, v in values.items() if v is not None}
    from vkdsl.train.distributed import DistributedError
    from vkdsl.train.trainer import TrainingStopped
    try:
        code = _run(config_path, resume, over, distributed, overwrite, plan)
    except (*USER_ERRORS, TrainingStopped, DistributedError, click.ClickException) as e:
        if os.environ.get("VKDSL_DEBUG") == "1":
            raise
        msg = e.format_message() if isinstance(e, click.ClickException) else user_error_line(e)
        from vkdsl.train.distributed import parallel, stop_job
        g = parallel()
        rank = f" on rank {g.rank} of {g.size} (ending the job)" if g else ""
        click.echo(f"vkdsl-train: error{rank}: {msg}", err=True)
        stop_job(1)
        code = 1
    sys.exit(code)


train = click.Command(
    "train", callback=_main, help=__doc__.split("\n\n")[0].replace("\n", " "),
    short_help="LoRA SFT (+ TMKL), then DPO, with evidence and gates (the same as vkdsl-train).",
    params=[click.Option(["--config", "config_path"], type=click.Path(dir_okay=False), default=None,
                         help="TOML file of settings (keys = setting names)"),
            click.Option(["--resume"], type=click.Path(file_okay=False), default=None,
                         help="continue the run in this folder from its last checkpoint"),
            click.Option(["--overwrite"], is_flag=True, default=False,
                         help="start a new run in an --out folder that holds an earlier run, "
                              "emptying it first"),
            click.Option(["--distributed"], type=click.Choice(["auto", "mpi", "none"]),
                         default="auto", show_default=True,
                         help="data-parallel over MPI: auto = when started by mpirun"),
            click.Option(["--plan"], is_flag=True, default=False,
                         help="print the run's device-memory plan (weights, step, prefix, "
                              "evaluation) against its budget (--device-memory) and exit: nothing "
                              "is trained"),
            click.Option(["--profile"], default=None, metavar="NAME", expose_value=False,
                         callback=_set_profile,
                         help="capability profile: run as a device of this class would (see "
                              "vkdsl devices)")]
    + [_option(name) for name in C.FIELDS])


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("other", type=click.Path(file_okay=False), required=False)
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="with two runs: the comparison page's path [default: "
                   "RUN_DIR/compare-OTHER.html]")
def report(run_dir, other, out):
    """Rebuild RUN_DIR/report.html (self-contained: inline SVG, no network, no script); with a
    second run folder, write a page comparing the two side by side."""
    from vkdsl.train.report import build_report, compare_report
    try:
        click.echo(
            f"wrote {compare_report(run_dir, other, out) if other else build_report(run_dir)}")
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e))


def parse(argv) -> tuple[str | None, str | None, dict]:
    """(config path, resume folder, settings given) of a command line, without running it."""
    ctx = train.make_context("vkdsl-train", list(argv))
    p = dict(ctx.params)
    p.pop("distributed")                    # how the run is launched, not a setting of the run
    p.pop("overwrite")
    p.pop("plan")
    return p.pop("config_path"), p.pop("resume"), {k: v for k, v in p.items() if v is not None}


def _boolean_with_a_value(argv):
    """`--verify false`: a boolean given a value the way other settings are. Say how to write it."""
    flags = {f"--{n.replace('_', '-')}" for n in C.FIELDS if isinstance(C.default_of(n), bool)}
    for a, b in zip(argv, argv[1:]):
        if a in flags and b.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            no = "--no-" + a[2:]
            return (f"{a} takes no value: write {a} to turn it on or {no} to turn it off "
                    f"(not {a} {b})")
    return None


def main(argv=None) -> int:
    """The vkdsl-train entry point: the exit status (0 all gates pass, 1 an error or a usage error,
    GATE_FAILED a gate failed)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    hint = _boolean_with_a_value(argv)
    if hint:
        click.echo(f"vkdsl-train: error: {hint}", err=True)
        return 1
    try:
        train.main(args=argv, prog_name="vkdsl-train", standalone_mode=False)
    except SystemExit as e:
        return int(e.code or 0)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code if e.exit_code != 2 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
