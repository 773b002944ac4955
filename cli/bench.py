"""vkdsl bench ...: benchmarks run beside a reference in the same process. One table: each row
names the command, the function that measures, and what it reports."""
from __future__ import annotations

import importlib

import click

from .common import (Commands, Finite, device_option, echo_rows, json_option, open_device,
                     positive_ints)

# name -> (module:function, help, extra options)
BENCHES = {
    "matmul": ("vkdsl.bench:bench_matmul",
               "Matmul GFLOP/s on the device and numpy fp32's, and their ratio.",
               [click.Option(["--sizes"], default="256,512,1024,2048", show_default=True,
                             callback=positive_ints,
                             help="comma-separated n for n x n x n"),
                click.Option(["--precision"], type=click.Choice(["fp32", "fp16"]), default="fp32",
                             show_default=True,
                             help="fp16: inputs rounded to fp16, fp32 sums (vkdsl.precision)")]),
    "replay": ("vkdsl.bench:bench_replay",
               "A traced 1000-dispatch program replayed vs the same dispatches recorded by hand.",
               []),
    "model": ("vkdsl.models.bench:bench_model",
              "Prompt processing and generation tokens/s (SmolLM2, or --model) beside a numpy "
              "float32 forward.",
              [click.Option(["--model", "model_path"], default=None, metavar="PATH")]),
    "train": ("vkdsl.train.profile:bench_or_profile",
              "Training-step speed (SFT at 4 x 256, or DPO at 4 pairs x 64; SmolLM2, or --model) "
              "and device memory.",
              [click.Option(["--model", "model_path"], default=None, metavar="PATH"),
               click.Option(["--objective"], type=click.Choice(["sft", "dpo"]), default="sft",
                            show_default=True),
               click.Option(["--by-kernel", "by_kernel"], is_flag=True,
                            help="time per kernel class of one step (each dispatch alone), "
                                 "GFLOP/s, share"),
               click.Option(["--checkpoint"], default="none", show_default=True,
                            metavar="none|layers|every:K",
                            help="activation checkpointing of the SFT rows (vkdsl-train "
                                 "--checkpoint)"),
               click.Option(["--activations"], type=click.Choice(["fp32", "fp16"]), default="fp32",
                            show_default=True, help="storage of what the SFT rows' backward keeps "
                                                    "(vkdsl-train --activations)"),
               click.Option(["--plan"], is_flag=True,
                            help="the SFT rows' device bytes, planned from the traced step: "
                                 "nothing runs"),
               click.Option(["--shape"], default="4x256", show_default=True, metavar="ROWSxTOKENS",
                            help="the SFT rows' batch (e.g. 1x4096)"),
               click.Option(["--targets"], default="qv,all", show_default=True,
                            help="which SFT rows: adapters on q,v (qv), on all seven "
                                 "projections (all)"),
               click.Option(["--steps"], type=click.IntRange(min=0), default=0,
                            show_default=True,
                            help="SFT steps timed after the warm-up, all on the same batch, every "
                                 "loss listed (0: 2, or 1 above 2048 tokens)"),
               click.Option(["--lr"], type=Finite(min=0.0, min_open=True), default=1e-4,
                            show_default=True,
                            help="the SFT rows' learning rate")]),
    "parallel": ("vkdsl.train.parallel_bench:bench_parallel",
                 "Data-parallel SFT step (run under mpirun -np P): compute vs all-reduce seconds, "
                 "ring bytes.",
                 [click.Option(["--steps"], type=click.IntRange(min=1), default=6,
                               show_default=True,
                               help="steps timed after one warm-up")]),
    "ops": ("vkdsl.ops.bench:bench_ops",
            "LoRA linear, softmax + CE, Q4_1 matmul and attention, forward and backward, "
            "beside numpy.", []),
    "quant": ("vkdsl.ops.bench:bench_quant",
              "int4 / NF4: stored bytes vs fp32 and the device round trip's relative "
              "Frobenius error.", []),
}


def _arguments(name, kw):
    if name == "matmul":
        return (kw["sizes"], kw["precision"])
    if name == "model":
        return (kw["model_path"],)
    if name == "train":
        return (kw["objective"], kw["model_path"], kw["by_kernel"], kw["checkpoint"], kw["plan"],
                kw["shape"], kw["targets"], kw["steps"], kw["lr"], kw["activations"])
    if name == "parallel":
        return (kw["steps"],)
    return ()


def _command(name, target, help_, options):
    def run(device, as_json, **kw):
        if name == "parallel":  # each rank its own device, before the device opens
            from vkdsl.train.distributed import group, pick_device
            pick_device(group("auto"))
        open_device(device, announce=not as_json)
        module, fn = target.split(":")
        try:
            rows = getattr(importlib.import_module(module), fn)(*_arguments(name, kw))
        except RuntimeError as e:   # a step's non-finite loss (train.loop): one line, as in a run
            from vkdsl.train.loop import TrainingStopped
            if not isinstance(e, TrainingStopped):
                raise
            raise click.ClickException(str(e)) from None
        echo_rows(rows if isinstance(rows, list) else [rows], as_json)
    cmd = json_option(device_option(run))
    cmd = click.command(name, help=help_)(cmd)
    cmd.params.extend(options)
    return cmd


@click.group(cls=Commands)
def bench():
    """Benchmarks run beside a numpy reference in the same process."""


for _name, (_target, _help, _options) in BENCHES.items():
    bench.add_command(_command(_name, _target, _help, _options))
