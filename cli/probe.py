"""`vkdsl probe NAME`: one LoRA experiment per command (vkdsl.train.probes), its table, its
expectations beside its measurements, a report with --out; exit 3 (GATE_FAILED) when a structural
expectation fails. `vkdsl probe --list` names them; `vkdsl probe NAME --help` says its parameters
and time."""
from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path

import click

from .common import GATE_FAILED, USER_ERRORS, open_device, user_error_line


def _listing() -> str:
    from vkdsl.train.probes import all_probes
    return "\n".join(f"  {p.name:16s} {p.summary}  [{p.minutes} on lavapipe, 2 cores]"
                     for p in all_probes())


def _command(p) -> click.Command:
    params = ", ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                       for k, v in p.defaults.items())

    def callback(model_path, seeds, as_json, out, sets, config_path):
        from vkdsl.train import config as C
        from vkdsl.train import probes
        from vkdsl.train.probes.report import write_report
        try:
            values = probes.parse_sets(p, sets)
            train = {}
            if config_path:
                given = C.load(config_path).to_dict()
                train = {k: v for k, v in given.items() if v != C.default_of(k)}
            open_device(None, announce=not as_json)
            work = (Path(out) / p.name if out
                    else Path("runs") / "probes" / f"{p.name}-{time.strftime('%Y%m%d-%H%M%S')}")
            ctx = probes.Context(model_path or train.pop("model", ""), seeds or p.seeds, work,
                                 values, say=(lambda s: None) if as_json
                                 else (lambda s: click.echo(s, err=True)), train=train)
            t0 = time.perf_counter()
            res = p.run(ctx)
            res.seconds, res.params = (time.perf_counter() - t0,
                                       {**values, "seeds": ctx.seeds, "model": ctx.model})
        except (*USER_ERRORS, probes.ProbeError) as e:
            raise click.ClickException(user_error_line(e)) from None
        if as_json:
            for line in res.json_lines():
                click.echo(line)
        else:
            click.echo(res.text())
            click.echo(f"  ({res.seconds:.0f} s)")
        if out:
            click.echo(f"report: {write_report(res, p, Path(out))}", err=True)
        sys.exit(0 if res.passed else GATE_FAILED)

    doc = inspect.cleandoc(p.run.__doc__ or "")
    return click.Command(
        p.name, callback=callback, short_help=p.summary,
        help=f"{p.summary}.\n\n{doc}\n\nParameters (--set key=value): {params or 'none'}. Measured "
             f"with the defaults on lavapipe, 2 cores: {p.minutes}.",
        params=[click.Option(["--model", "model_path"], default=None, metavar="PATH",
                             help="GGUF file or Hugging Face folder (default: the installed "
                                  "SmolLM2-135M-Instruct)"
                             + ("" if p.needs_model else "; this probe uses no model")),
                click.Option(["--seeds"], type=click.IntRange(1, 100), default=None,
                             help=f"seeds to repeat over [default: {p.seeds}]"),
                click.Option(["--json", "as_json"], is_flag=True,
                             help="one JSON object per row and expectation"),
                click.Option(["--out"], type=click.Path(file_okay=False), default=None,
                             help="folder for OUT/NAME.html, OUT/NAME.json and the runs the "
                                  "probe trains"),
                click.Option(["--set", "sets"], multiple=True, metavar="KEY=VALUE",
                             help="override a parameter of the probe"),
                click.Option(["--config", "config_path"], type=click.Path(dir_okay=False),
                             default=None,
                             help="TOML of vkdsl-train settings the probe's runs start from "
                                  "(data, labels, max_len, ...); the probe's own choices "
                                  "apply on top")])


class ProbeGroup(click.Group):
    def list_commands(self, ctx):
        from vkdsl.train.probes import all_probes
        return [p.name for p in all_probes()]

    def get_command(self, ctx, name):
        from vkdsl.train.probes import ProbeError, get
        try:
            return _command(get(name))
        except ProbeError:
            raise click.UsageError(f"unknown probe {name!r}; the probes "
                                   f"are:\n{_listing()}") from None


@click.group(cls=ProbeGroup, invoke_without_command=True)
@click.option("--list", "list_", is_flag=True, help="name every probe with one line and its time")
@click.pass_context
def probe(ctx, list_):
    """The LoRA probes, one command each: vkdsl probe NAME [--model M] [--seeds K] [--json] [--out
    DIR]."""
    if list_ or ctx.invoked_subcommand is None:
        click.echo(_listing())
