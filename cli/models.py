"""Model commands: tokenize, logits, generate, merge, info."""
from __future__ import annotations

import io
import json

import click
import numpy as np

from vkdsl.fileio import atomic_write

from .common import Finite, device_option, model_option, open_device

COMMANDS = ("tokenize", "logits", "generate", "merge", "info")


def _load_model(model_path, quant="keep", adapter=None, force=False):
    from vkdsl.models import ModelFileError, load_model_files
    from vkdsl.models.default import default_model_path
    from vkdsl.models.build import build_model
    try:
        path = model_path or default_model_path()
        ck, tok = load_model_files(path)
        model = build_model(ck, quant=quant)
        if adapter:
            from vkdsl.models.adapters import load_adapter
            load_adapter(model, adapter, tok, force=force, model_path=path)
    except (ModelFileError, FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e))
    return model, tok


def _prompt_ids(tok, prompt, chat, context=None, what="--prompt"):
    """The prompt's token ids: at least one, and within the model's context when one is given."""
    if not chat:
        ids = tok.encode(prompt)
    else:
        # the template writes its own BOS where it wants one (Llama 3's, Mistral's): add none again
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                 add_generation_prompt=True),
                         add_special=False)
    if not ids:
        raise click.ClickException(f"{what} {prompt!r} tokenizes to no tokens"
                                   + (" (the chat template renders nothing)" if chat else ""))
    if context is not None and len(ids) > context:
        raise click.ClickException(f"{what} is {len(ids)} tokens; the model's context is {context}")
    return ids


@click.command()
@model_option
@click.argument("text")
def tokenize(model_path, text):
    """Print the token ids of TEXT as a JSON list."""
    from vkdsl.models import load_tokenizer
    from vkdsl.models.default import default_model_path
    tok = load_tokenizer(model_path or default_model_path())
    click.echo(json.dumps(tok.encode(text)))


@click.command()
@device_option
@model_option
@click.option("--prompt", required=True)
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="FILE.npy")
@click.option("--chat", is_flag=True, help="wrap the prompt in the model's chat template")
@click.option("--adapter", default=None,
              help="LoRA adapter (vkdsl run folder, PEFT folder or GGUF adapter)")
@click.option("--force", is_flag=True, help="apply an adapter whose manifest names another base")
def logits(device, model_path, prompt, out, chat, adapter, force):
    """Write the logits of every prompt position (float32, [tokens, vocab]) to FILE.npy."""
    open_device(device)
    model, tok = _load_model(model_path, adapter=adapter, force=force)
    ids = _prompt_ids(tok, prompt, chat, model.cfg.context_length)
    from vkdsl.models.llama import LogitsFn
    lg = LogitsFn(model)(np.array([ids], np.int32))[0]       # the head in chunks a binding holds
    buf = io.BytesIO()
    np.save(buf, lg.astype(np.float32))
    atomic_write(out, buf.getvalue())
    click.echo(f"wrote logits {lg.shape} to {out}")


@click.command()
@device_option
@model_option
@click.option("--prompt", required=True)
@click.option("--chat", is_flag=True, help="wrap the prompt in the model's chat template")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=64, show_default=True)
@click.option("--temperature", type=Finite(min=0.0), default=0.0, show_default=True,
              help="0 = greedy")
@click.option("--top-p", type=Finite(0.0, 1.0, min_open=True), default=1.0, show_default=True,
              help="sample from the smallest set of tokens whose probability reaches this")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--stats", is_flag=True, help="report speed and the weights' device memory")
@click.option("--adapter", default=None,
              help="LoRA adapter (vkdsl run folder, PEFT folder or GGUF adapter)")
@click.option("--force", is_flag=True, help="apply an adapter whose manifest names another base")
@click.option("--kv-cache", "kv_cache", type=click.Choice(["f32", "f16"]), default="f32",
              show_default=True,
              help="f16: keys and values stored as fp16 (half the cache memory; needs "
                   "16-bit storage)")
def generate(device, model_path, prompt, chat, max_new_tokens, temperature, top_p, seed, stats,
             adapter, force, kv_cache):
    """Generate text (greedy by default) with a KV cache."""
    from vkdsl.models.generate import Generator
    open_device(device)
    model, tok = _load_model(model_path, adapter=adapter, force=force)
    ids = _prompt_ids(tok, prompt, chat, model.cfg.context_length)
    try:
        gen = Generator(model, len(ids) + max_new_tokens,
                        kv_dtype={"f32": "float32", "f16": "float16"}[kv_cache])
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
    stop = {tok.eos_id, tok.end_of_turn_id} - {None} if chat else {tok.eos_id} - {None}
    out, st = gen.generate(ids, max_new_tokens, temperature, top_p, seed, stop=stop, on_token=show)
    click.echo()
    if stats:
        mem = model.device_bytes()
        click.echo(f"[{st['prompt_tokens']} prompt tokens in {st['prefill_s']:.2f} s (includes "
                   f"first-call compile); {st['new_tokens']} new tokens at "
                   f"{st['new_tokens'] / max(st['decode_s'], 1e-9):.1f} tokens/s; weights on "
                   f"device {mem['device_bytes'] / 2**20:.1f} MiB vs "
                   f"{mem['fp32_bytes'] / 2**20:.1f} MiB as fp32; KV cache "
                   f"{gen.cache.nbytes() / 2**20:.1f} MiB ({kv_cache})]", err=True)


@click.command()
@device_option
@model_option
@click.option("--adapter", required=True, help="vkdsl run folder, PEFT folder or GGUF adapter")
@click.option("--out", "out", required=True, type=click.Path(),
              help="merged GGUF file (or folder for HF bases)")
@click.option("--out-type", type=click.Choice(["f32", "f16", "keep"]), default="f16",
              show_default=True,
              help="merged tensors as f32/f16, or re-quantized to the base's block type (loss "
                   "reported)")
@click.option("--compare", "compare_text", default="The capital of France is",
              help="prompt on which merged and separate logits are compared")
@click.option("--force", is_flag=True, help="merge an adapter whose manifest names another base")
@click.option("--json", "as_json", is_flag=True)
def merge(device, model_path, adapter, out, out_type, compare_text, force, as_json):
    """Write the base with the adapter merged in, and compare its logits with the separate path."""
    from vkdsl.models import ModelFileError, load_tokenizer
    from vkdsl.models.default import default_model_path
    from vkdsl.models.merge import compare_logits, merge as run
    open_device(device, announce=not as_json)
    base = model_path or default_model_path()
    try:
        ids = _prompt_ids(load_tokenizer(base), compare_text, False, what="--compare")
        report = run(base, adapter, out, out_type=out_type, force=force)
        report["compare"] = compare_logits(base, adapter, out, [ids], force=force)
    except (ModelFileError, FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e))
    if as_json:
        click.echo(json.dumps(report, default=str))
        return
    c = report["compare"]
    click.echo(f"wrote {out} ({out_type}); merged vs separate on {c['positions']} positions: max "
               f"|dlogit| {c['max_abs_diff']:.3g} (relative {c['rel_diff']:.2e}), argmax agreement "
               f"{c['argmax_agreement']:.3f}")
    for k in ("max_requant_rel_err", "mean_requant_rel_err", "warning"):
        if k in report:
            click.echo(f"  {k}: {report[k]}")


FAMILY = {"llama": "Llama (SmolLM2, Llama 2/3.x)", "mistral": "Mistral (no sliding window)",
          "qwen2": "Qwen2 / Qwen2.5 (q/k/v biases)", "qwen3": "Qwen3 (per-head q/k RMSNorm)",
          "qwen35": "Qwen3.5 (Gated DeltaNet and gated attention)"}


@click.command()
@device_option
@model_option
@click.option("--json", "as_json", is_flag=True)
def info(device, model_path, as_json):
    """Model family, hyper-parameters, tokenizer and the bytes its weights occupy on the device vs
    fp32."""
    open_device(device, announce=not as_json)
    model, tok = _load_model(model_path)
    mem = model.device_bytes()
    c = model.cfg
    row = {"model": model.source, "format": model.format, "family": FAMILY[c.arch], **c.to_dict(),
           "stored_types": model.stored_types, "tokenizer_vocab": tok.vocab_size,
           "chat_template": bool(tok.chat_template),
           "end_of_turn": tok.id_to_token(tok.end_of_turn_id)
           if tok.end_of_turn_id is not None else None, **mem}
    if as_json:
        click.echo(json.dumps(row, default=str))
    else:
        d = row.pop("rope_freq_divisors", None)
        row["rope_scaling"] = (f"{len(d)} frequency divisors, {min(d):g} .. {max(d):g} "
                               f"(Llama 3 style)" if d
                               else "none")
        row["stored_types"] = ", ".join(f"{t} x{n}" for t, n in row["stored_types"].items())
        for k, v in row.items():
            click.echo(f"{k:>18}: {v}")
        click.echo(f"{'ratio':>18}: {mem['device_bytes'] / mem['fp32_bytes']:.3f} of fp32")
