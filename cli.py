"""The `vkdsl` command: devices, verify, bench, compile, demo (and, from later layers, models)."""
from __future__ import annotations

import json
import os
import sys
import time

import click
import numpy as np


def _device_option(f):
    return click.option("--device", "device", default=None, metavar="D",
                        help="device index or name substring (default: $VKDSL_DEVICE, else the best present)")(f)


def _open(device, announce=True):
    from vkdsl.runtime import open_device
    from vkdsl.runtime.errors import DeviceNotFound
    try:
        return open_device(device, announce=announce)
    except DeviceNotFound as e:
        raise click.ClickException(str(e))


def _load_ops():
    """Register the op library's verify rows (ops/ sits above the core)."""
    try:
        import vkdsl.ops  # noqa: F401
    except ImportError as e:
        if "vkdsl.ops" not in str(e):
            raise


@click.group()
@click.version_option(package_name="vkdsl")
def main():
    """vkdsl: a traced tensor DSL on Vulkan, with its kernels verified on your device."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="one JSON object per device")
def devices(as_json):
    """List Vulkan devices: type, driver, memory heaps and the limits vkdsl honours."""
    from vkdsl.runtime import list_devices, select
    devs = list_devices()
    chosen = select().index if devs else None
    for d in devs:
        L = d.limits
        row = {"index": d.index, "name": d.name, "type": d.kind, "driver": d.driver, "driver_info": d.driver_info,
               "api": d.api_version, "default": d.index == chosen, "unified_memory": d.host_visible_device_local,
               "heaps": [{"bytes": b, "device_local": loc} for b, loc in d.heaps],
               "max_storage_buffer_range": L.max_storage_buffer_range, "max_workgroup_size": L.max_workgroup_size,
               "max_workgroup_invocations": L.max_workgroup_invocations, "max_shared_memory": L.max_shared_memory,
               "max_push_constants": L.max_push_constants, "subgroup_size": L.subgroup_size,
               "shader_float16": L.float16, "storage_buffer_16bit": L.storage16, "int8": L.int8}
        if as_json:
            click.echo(json.dumps(row))
            continue
        heaps = ", ".join(f"{b / 2**30:.1f} GiB{' device-local' if loc else ''}" for b, loc in d.heaps)
        click.echo(f"{'*' if row['default'] else ' '} [{d.index}] {d.name}\n"
                   f"      type {d.kind}, driver {d.driver} ({d.driver_info}), Vulkan {d.api_version}\n"
                   f"      memory heaps: {heaps}; {'unified (host-mapped)' if row['unified_memory'] else 'staged'}\n"
                   f"      storage buffer range {L.max_storage_buffer_range / 2**20:.0f} MiB, workgroup "
                   f"{L.max_workgroup_size} / {L.max_workgroup_invocations} invocations, shared memory "
                   f"{L.max_shared_memory // 1024} KiB, subgroup {L.subgroup_size}, push constants "
                   f"{L.max_push_constants} B\n      float16 arithmetic {L.float16}, 16-bit storage {L.storage16}, "
                   f"int8 {L.int8}")
    if not as_json:
        click.echo("(* = used by default)")


@main.command()
@_device_option
@click.option("--json", "as_json", is_flag=True, help="one JSON object per row")
@click.option("--match", default=None, help="only cases whose name contains this text")
def verify(device, as_json, match):
    """Run every built-in kernel on the device against the golden outputs."""
    _open(device, announce=not as_json)
    _load_ops()
    from vkdsl.verify import verify as run
    rows, times = run(match=match)
    failed = [r for r in rows if not r.passed]
    if as_json:
        for r in rows:
            click.echo(json.dumps(r.as_dict()))
        click.echo(json.dumps({"summary": True, "rows": len(rows), "failed": len(failed), **times}))
    else:
        w = max([len(r.name) for r in rows] + [4])
        click.echo(f"{'case':<{w}}  {'shape':>14}  {'nmse':>9}  {'limit':>9}  result")
        for r in rows:
            click.echo(f"{r.name:<{w}}  {r.shape:>14}  {r.error:9.2e}  {r.limit:9.1e}  "
                       f"{'pass' if r.passed else 'FAIL ' + r.note}")
        click.echo(f"{len(rows) - len(failed)}/{len(rows)} rows passed; cold {times['cold_s']:.2f} s "
                   f"(compiles and builds pipelines), warm {times['warm_s']:.2f} s")
    sys.exit(1 if failed or not rows else 0)


@main.group()
def bench():
    """Benchmarks run beside a numpy reference in the same process."""


@bench.command("matmul")
@_device_option
@click.option("--json", "as_json", is_flag=True)
@click.option("--sizes", default="256,512,1024,2048", help="comma-separated n for n x n x n")
def bench_matmul(device, as_json, sizes):
    """fp32 matmul GFLOP/s on the device and in numpy, and their ratio."""
    _open(device, announce=not as_json)
    from vkdsl.bench import bench_matmul as run
    for r in run(tuple(int(s) for s in sizes.split(","))):
        click.echo(json.dumps(r) if as_json else
                   f"{r['size']:5d}^3  device {r['device_gflops']:7.1f} GFLOP/s  numpy {r['numpy_gflops']:7.1f} "
                   f"GFLOP/s  device/numpy {r['device_gflops'] / r['numpy_gflops']:.2f}")


@bench.command("replay")
@_device_option
@click.option("--json", "as_json", is_flag=True)
def bench_replay(device, as_json):
    """A traced 1000-dispatch program replayed vs the same dispatches recorded by hand."""
    _open(device, announce=not as_json)
    from vkdsl.bench import bench_replay as run
    r = run()
    click.echo(json.dumps(r) if as_json else
               f"{r['dispatches']} dispatches: replay {r['replay_us']:.0f} us, hand-recorded {r['raw_us']:.0f} us, "
               f"ratio {r['ratio']:.2f} ({r['per_dispatch_us']:.1f} us per dispatch)")


@main.command("compile")
@_device_option
@click.option("--bundle", "bundle", required=True, type=click.Path(file_okay=False),
              help="folder to write every built-in kernel's SPIR-V to")
def compile_(device, bundle):
    """Write a SPIR-V bundle; run elsewhere with VKDSL_SPIRV_BUNDLE=DIR and no shader compiler."""
    _open(device)
    _load_ops()
    from vkdsl import compiler
    from vkdsl.verify import verify as run
    run(repeat_warm=False)                 # builds every kernel the verify suite and ops use
    _demo(quiet=True)
    try:
        from vkdsl.matmul import builtin_variants
        builtin_variants()
    except ImportError:
        pass
    n = compiler.write_bundle(bundle, dict(compiler.compiled_this_process))
    click.echo(f"wrote {n} kernels to {bundle}; use it with VKDSL_SPIRV_BUNDLE={bundle}")


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


@main.command()
@_device_option
def demo(device):
    """Trace a small program once and replay it."""
    _open(device)
    _demo()


if __name__ == "__main__":
    main()
