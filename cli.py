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
               "shader_float16": L.float16, "storage_buffer_16bit": L.storage16, "int8": L.int8, "int64": L.int64}
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
                   f"int8 {L.int8}, int64 {L.int64}")
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


@bench.command("model")
@_device_option
@click.option("--json", "as_json", is_flag=True)
@click.option("--model", "model_path", default=None, metavar="PATH")
def bench_model(device, as_json, model_path):
    """SmolLM2 prompt processing and generation tokens/s beside a numpy float32 forward."""
    _open(device, announce=not as_json)
    from vkdsl.models.bench import bench_model as run
    for r in run(model_path):
        click.echo(json.dumps(r) if as_json else "  ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


@bench.command("train")
@_device_option
@click.option("--objective", type=click.Choice(["sft", "dpo"]), default="sft", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_train(device, objective, as_json):
    """SmolLM2 training-step speed (SFT at 4 x 256, or DPO at 4 pairs x 64) and device memory."""
    _open(device, announce=not as_json)
    from vkdsl.train.bench import bench_train as run
    _rows(run(objective), as_json)


@bench.command("ops")
@_device_option
@click.option("--json", "as_json", is_flag=True)
def bench_ops(device, as_json):
    """LoRA linear, softmax + CE, Q4_1 matmul and attention, forward and backward, beside numpy."""
    _open(device, announce=not as_json)
    from vkdsl.ops.bench import bench_ops as run
    _rows(run(), as_json)


@bench.command("quant")
@_device_option
@click.option("--json", "as_json", is_flag=True)
def bench_quant(device, as_json):
    """int4 / NF4: stored bytes vs fp32 and the device round trip's relative Frobenius error."""
    _open(device, announce=not as_json)
    from vkdsl.ops.bench import bench_quant as run
    _rows(run(), as_json)


def _rows(rows, as_json):
    for r in rows:
        click.echo(json.dumps(r) if as_json else "  ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


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


# ---- models -------------------------------------------------------------------------------
def _model_option(f):
    return click.option("--model", "model_path", default=None, metavar="PATH",
                        help="GGUF file or Hugging Face folder (default: the installed SmolLM2-135M-Instruct)")(f)


def _load_model(model_path, quant="keep", adapter=None, force=False):
    from vkdsl.models import ModelFileError, load_model_files
    from vkdsl.models.default import default_model_path
    from vkdsl.models.llama import Llama
    try:
        path = model_path or default_model_path()
        ck, tok = load_model_files(path)
        model = Llama(ck, quant=quant)
        if adapter:
            from vkdsl.models.adapters import load_adapter
            load_adapter(model, adapter, tok, force=force, model_path=path)
    except (ModelFileError, FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e))
    return model, tok


def _prompt_ids(tok, prompt, chat):
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True) \
        if chat else prompt
    return tok.encode(text)


@main.command()
@_model_option
@click.argument("text")
def tokenize(model_path, text):
    """Print the token ids of TEXT as a JSON list."""
    from vkdsl.models import load_tokenizer
    from vkdsl.models.default import default_model_path
    tok = load_tokenizer(model_path or default_model_path())
    click.echo(json.dumps(tok.encode(text)))


@main.command()
@_device_option
@_model_option
@click.option("--prompt", required=True)
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="FILE.npy")
@click.option("--chat", is_flag=True, help="wrap the prompt in the model's chat template")
@click.option("--adapter", default=None, help="LoRA adapter (vkdsl run folder, PEFT folder or GGUF adapter)")
@click.option("--force", is_flag=True, help="apply an adapter whose manifest names another base")
def logits(device, model_path, prompt, out, chat, adapter, force):
    """Write the logits of every prompt position (float32, [tokens, vocab]) to FILE.npy."""
    import vkdsl
    _open(device)
    model, tok = _load_model(model_path, adapter=adapter, force=force)
    ids = _prompt_ids(tok, prompt, chat)
    if not ids:
        raise click.ClickException("the prompt tokenizes to no tokens")
    if len(ids) > model.cfg.context_length:
        raise click.ClickException(f"the prompt is {len(ids)} tokens; the model's context is "
                                   f"{model.cfg.context_length}")
    lg = vkdsl.trace(lambda x: model.forward(x))(np.array([ids], np.int32))[0]
    from vkdsl.fileio import atomic_write
    import io
    buf = io.BytesIO()
    np.save(buf, lg.astype(np.float32))
    atomic_write(out, buf.getvalue())
    click.echo(f"wrote logits {lg.shape} to {out}")


@main.command()
@_device_option
@_model_option
@click.option("--prompt", required=True)
@click.option("--chat", is_flag=True, help="wrap the prompt in the model's chat template")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--stats", is_flag=True, help="report speed and the weights' device memory")
@click.option("--adapter", default=None, help="LoRA adapter (vkdsl run folder, PEFT folder or GGUF adapter)")
@click.option("--force", is_flag=True, help="apply an adapter whose manifest names another base")
def generate(device, model_path, prompt, chat, max_new_tokens, temperature, top_p, seed, stats, adapter, force):
    """Generate text (greedy by default) with a KV cache."""
    from vkdsl.models.generate import Generator
    _open(device)
    model, tok = _load_model(model_path, adapter=adapter, force=force)
    ids = _prompt_ids(tok, prompt, chat)
    try:
        gen = Generator(model, len(ids) + max_new_tokens)
    except ValueError as e:
        raise click.ClickException(str(e))
    if not chat:
        click.echo(prompt, nl=False)
    text_so_far = []

    def show(t):
        text_so_far.append(t)
        piece = tok.decode(text_so_far)
        prev = tok.decode(text_so_far[:-1])
        click.echo(piece[len(prev):], nl=False)
    stop = {tok.eos_id} if tok.eos_id is not None else set()
    out, st = gen.generate(ids, max_new_tokens, temperature, top_p, seed, stop=stop, on_token=show)
    click.echo()
    if stats:
        mem = model.device_bytes()
        click.echo(f"[{st['prompt_tokens']} prompt tokens in {st['prefill_s']:.2f} s (includes first-call "
                   f"compile); {st['new_tokens']} new tokens at {st['new_tokens'] / max(st['decode_s'], 1e-9):.1f} "
                   f"tokens/s; weights on device {mem['device_bytes'] / 2**20:.1f} MiB vs "
                   f"{mem['fp32_bytes'] / 2**20:.1f} MiB as fp32]", err=True)


@main.command()
@_device_option
@_model_option
@click.option("--adapter", required=True, help="vkdsl run folder, PEFT folder or GGUF adapter")
@click.option("--out", "out", required=True, type=click.Path(), help="merged GGUF file (or folder for HF bases)")
@click.option("--out-type", type=click.Choice(["f32", "f16", "keep"]), default="f16", show_default=True,
              help="merged tensors as f32/f16, or re-quantized to the base's block type (loss reported)")
@click.option("--compare", "compare_text", default="The capital of France is",
              help="prompt on which merged and separate logits are compared")
@click.option("--force", is_flag=True, help="merge an adapter whose manifest names another base")
@click.option("--json", "as_json", is_flag=True)
def merge(device, model_path, adapter, out, out_type, compare_text, force, as_json):
    """Write the base with the adapter merged in, and compare its logits with the separate path."""
    from vkdsl.models import ModelFileError, load_tokenizer
    from vkdsl.models.default import default_model_path
    from vkdsl.models.merge import compare_logits, merge as run
    _open(device, announce=not as_json)
    base = model_path or default_model_path()
    try:
        report = run(base, adapter, out, out_type=out_type, force=force)
        ids = load_tokenizer(base).encode(compare_text)
        report["compare"] = compare_logits(base, adapter, out, [ids], force=force)
    except (ModelFileError, FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e))
    if as_json:
        click.echo(json.dumps(report, default=str))
        return
    c = report["compare"]
    click.echo(f"wrote {out} ({out_type}); merged vs separate on {c['positions']} positions: max |dlogit| "
               f"{c['max_abs_diff']:.3g} (relative {c['rel_diff']:.2e}), argmax agreement {c['argmax_agreement']:.3f}")
    for k in ("max_requant_rel_err", "mean_requant_rel_err", "warning"):
        if k in report:
            click.echo(f"  {k}: {report[k]}")


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
def report(run_dir):
    """Rebuild RUN_DIR/report.html (self-contained: inline SVG, no network, no script)."""
    from vkdsl.train.report import build_report
    try:
        click.echo(f"wrote {build_report(run_dir)}")
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e))


@main.command()
@_device_option
@_model_option
@click.option("--json", "as_json", is_flag=True)
def info(device, model_path, as_json):
    """Model hyper-parameters and the bytes its weights occupy on the device vs fp32."""
    _open(device, announce=not as_json)
    model, tok = _load_model(model_path)
    mem = model.device_bytes()
    row = {"model": model.source, **model.cfg.to_dict(), **mem}
    if as_json:
        click.echo(json.dumps(row, default=str))
    else:
        for k, v in row.items():
            click.echo(f"{k:>18}: {v}")
        click.echo(f"{'ratio':>18}: {mem['device_bytes'] / mem['fp32_bytes']:.3f} of fp32")


if __name__ == "__main__":
    main()
