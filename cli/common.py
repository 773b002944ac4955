"""What every command group shares: the device option, opening the device, printing result rows,
and the model option."""
from __future__ import annotations

import json
import math
import os

import click

from vkdsl.compiler.errors import NoCompiler
from vkdsl.runtime.errors import DeviceNotFound, VulkanError

# What a user can cause (bad files, settings, devices, a missing compiler): one line, exit 1.
# Anything else is a bug in vkdsl and keeps its traceback.
USER_ERRORS = (ValueError, OSError, DeviceNotFound, VulkanError, NoCompiler)

# Exit statuses: 0 done (every gate passed), 1 an error, 2 a usage error of the command line
# (click's),
# 3 the job ran to the end and a gate (or a probe's expectation) failed.
GATE_FAILED = 3


class Finite(click.FloatRange):
    """A float option within a range that also refuses nan and inf (click's FloatRange lets nan
    through: every comparison with it is false)."""
    name = "finite float"

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


def positive_ints(ctx, param, value):
    """A callback: a comma-separated list of integers >= 1 (e.g. --sizes 256,512)."""
    try:
        out = tuple(int(s) for s in value.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers >= 1, e.g. 256,512",
                                 ctx, param)
    return out


def user_error_line(e: BaseException) -> str:
    return str(e) or type(e).__name__


class Commands(click.Group):
    """A command group whose commands turn user errors into one-line messages (VKDSL_DEBUG=1 keeps
    the traceback)."""

    def invoke(self, ctx):
        try:
            from vkdsl.environment import check_environment
            check_environment()             # a bad $VKDSL_*: one line before any work
            return super().invoke(ctx)
        except USER_ERRORS as e:
            if os.environ.get("VKDSL_DEBUG") == "1":
                raise
            raise click.ClickException(user_error_line(e)) from None


def device_option(f):
    """--device, and --profile (a capability profile: the device as if narrower,
    runtime.profiles)."""
    f = profile_option(f)
    return click.option("--device", "device", default=None, metavar="D",
                        help="device index or name substring (default: $VKDSL_DEVICE, else the "
                             "best present)")(f)


def _set_profile(ctx, param, value):
    if value is not None:
        from vkdsl.runtime.profiles import ProfileError, named
        try:
            named(value)
        except ProfileError as e:
            raise click.BadParameter(str(e), ctx, param) from None
        os.environ["VKDSL_PROFILE"] = value            # read when the device is opened
    return value


def profile_option(f):
    from vkdsl.runtime.profiles import PROFILES
    return click.option("--profile", default=None, metavar="NAME", expose_value=False,
                        callback=_set_profile,
                        help=f"behave as a device of this class would: {', '.join(PROFILES)} "
                             f"(default: $VKDSL_PROFILE, else the device as it is)")(f)


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="one JSON object per row")(f)


def open_device(device, announce=True):
    from vkdsl.runtime import open_device as open_
    from vkdsl.runtime.errors import DeviceNotFound
    try:
        return open_(device, announce=announce)
    except DeviceNotFound as e:
        raise click.ClickException(str(e))


def echo_rows(rows, as_json):
    for r in rows:
        click.echo(json.dumps(r, default=str) if as_json else "  ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


def model_option(f):
    return click.option("--model", "model_path", default=None, metavar="PATH",
                        help="GGUF file or Hugging Face folder (default: the installed "
                             "SmolLM2-135M-Instruct)")(f)
