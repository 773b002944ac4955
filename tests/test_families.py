"""Llama 3 (scaled RoPE, untied embeddings, the llama-bpe pre-tokenizer), Mistral (a "llama" GGUF
with a SentencePiece tokenizer; config.json model_type mistral), Qwen2 (q/k/v biases, tied) and
Qwen3 (per-head q/k RMSNorm, head_dim * heads != dim, untied).

Tiny random models of each family are written by the tests in both formats (the gguf package's
writer, Qwen GGUF files in Hugging Face's Q/K row order as llama.cpp's converter leaves them;
safetensors' writer with transformers' names and config.json). Independent references:
golden/hf_ref.py (transformers' computation in float64: rotate_half RoPE on HF rows, biases,
q/k norms, PEFT's LoRA) fed the fixture's own HF-named arrays; gguf's reader for the exported
GGUF adapter, applied to the base file's weights in the file's order as llama.cpp applies it.

Tolerances: device fp32 vs float64 reference max |diff| <= 1e-3 * max |ref| (as the Llama
tests); round trips through our own files <= 1e-6.
"""
import dataclasses
import json

import numpy as np
import pytest
import safetensors.numpy as stn
from gguf import GGUFReader
from gguf.quants import dequantize

from fixtures import lora as fixtures_lora
from fixtures import synthetic
from fixtures.train_data import tiny_cfg, write_jsonl, TRAIN, HELD
from vkdsl.models import load_checkpoint, load_model_files
from vkdsl.models.adapters import load_adapter, save_gguf_adapter, save_peft
from vkdsl.models.llama import Llama
from vkdsl.models.merge import compare_logits, merge
from vkdsl.models.safetensors_loader import gguf_name_to_hf, gguf_to_hf_rows, hf_to_gguf_rows
from vkdsl_golden import hf_ref

IDS = [5, 17, 200, 33, 9, 1, 2, 250, 44, 45, 46, 7, 8, 9]
R, SCALE = 4, 2.0
FAMILIES = ("llama3", "mistral", "qwen2", "qwen3")
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llama3":
        return synthetic.build_tiny(folder, seed=3, tied=False, rope_scaling=LLAMA3_SCALING, pre="llama-bpe")
    # Qwen2.5-0.5B ties its embeddings, larger Qwen models do not: one of each
    return synthetic.build_tiny(folder, seed=3, arch=request.param, tied=request.param == "qwen2")


def family(tiny) -> str:
    return "llama3" if tiny.cfg["arch"] == "llama" else tiny.cfg["arch"]


def close(got, ref):
    assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max(), np.abs(got - ref).max() / np.abs(ref).max()


def logits(model, ids=IDS, adapters_on=True):
    return fixtures_lora.logits(model, ids, adapters_on)


def file_order(cfg, name, w):
    """HF rows of a tensor as the family's GGUF holds them (llama.cpp permutes Llama's, Mistral's)."""
    if cfg["arch"] not in ("llama", "mistral") or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return w
    return hf_to_gguf_rows(w, cfg["n_heads"] if "q_proj" in name else cfg["n_kv_heads"])


def test_both_formats_load_the_family(tiny):
    a, b = load_checkpoint(tiny.gguf_path), load_checkpoint(tiny.hf_dir)
    assert b.config.arch == tiny.cfg["arch"]       # a Mistral GGUF says "llama": the same computation
    assert a.config == dataclasses.replace(b.config, arch={"mistral": "llama"}.get(b.config.arch, b.config.arch))
    assert (a.config.qkv_bias, a.config.qk_norm) == (tiny.cfg["qkv_bias"], tiny.cfg["qk_norm"])
    assert sorted(a.tensors) == sorted(b.tensors)
    for n in a.tensors:                       # the same numbers in the same (pair) order from both files
        np.testing.assert_array_equal(a[n].dequantize(), b[n].dequantize(), err_msg=n)
    # the GGUF file itself holds the family's row order (Qwen: HF's), as llama.cpp's converter writes it
    gg = {t.name: t for t in GGUFReader(tiny.gguf_path).tensors}
    q = gguf_name_to_hf("blk.0.attn_q.weight")
    np.testing.assert_array_equal(dequantize(gg["blk.0.attn_q.weight"].data, gg["blk.0.attn_q.weight"].tensor_type)
                                  .reshape(tiny.hf_weights[q].shape), file_order(tiny.cfg, q, tiny.hf_weights[q]))


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_forward_matches_the_transformers_reference(tiny, fmt):
    ck = load_checkpoint(tiny.gguf_path if fmt == "gguf" else tiny.hf_dir)
    lg = logits(Llama(ck))
    ref = hf_ref.forward(tiny.hf_weights, tiny.cfg, IDS)
    close(lg, ref)
    # what the family adds is seen: the reference without it is far outside the tolerance
    extra = {"llama3": {"inv_freq": None}, "qwen2": {"qkv_bias": False}, "qwen3": {"qk_norm": False}}.get(family(tiny))
    if extra is None:
        return
    plain = hf_ref.forward(tiny.hf_weights, dict(tiny.cfg, **extra), IDS)
    assert np.abs(plain - ref).max() > 30 * 1e-3 * np.abs(ref).max()


def test_kv_cache_steps_match_the_reference(tiny):
    from vkdsl.models.generate import Generator
    gen = Generator(Llama(load_checkpoint(tiny.gguf_path)), 32)
    ref = hf_ref.forward(tiny.hf_weights, tiny.cfg, IDS)
    close(gen.logits_prefill(IDS[:6]), ref[:6])
    for pos in range(6, len(IDS)):                 # one cached step per token, biases/norms included
        close(gen.logits_step(IDS[pos], pos), ref[pos])


@pytest.fixture(scope="module")
def adapted(tiny, tmp_path_factory):
    ck, tok = load_model_files(tiny.gguf_path)
    model = Llama(ck)
    fixtures_lora.random_lora(model, R, SCALE)
    out = tmp_path_factory.mktemp("adapters")
    save_peft(model, out / "peft", r=R, alpha=SCALE * R)
    save_gguf_adapter(model, out / "adapter.gguf", r=R, alpha=SCALE * R)
    return dict(model=model, tok=tok, lg=logits(model), peft=out / "peft", gguf=out / "adapter.gguf")


def test_peft_export_is_transformers_peft(tiny, adapted):
    arrays = stn.load_file(str(adapted["peft"] / "adapter_model.safetensors"))
    peft = {}
    for key, a in arrays.items():
        mod = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        peft.setdefault(mod, [None, None])["AB".index(key.rsplit(".lora_", 1)[1][0])] = a
    cfg = json.loads((adapted["peft"] / "adapter_config.json").read_text())
    s = cfg["lora_alpha"] / cfg["r"]
    close(adapted["lg"], hf_ref.forward(tiny.hf_weights, tiny.cfg, IDS, peft, s))


def test_gguf_adapter_applies_to_the_base_file_as_llama_cpp_does(tiny, adapted):
    """W_file += (alpha / r) B A on the base GGUF's own tensors, in the file's row order."""
    ad = GGUFReader(adapted["gguf"])
    assert ad.fields["general.architecture"].contents() == {"mistral": "llama"}.get(tiny.cfg["arch"], tiny.cfg["arch"])
    s = ad.fields["adapter.lora.alpha"].contents() / R
    lora = {t.name: np.asarray(t.data, np.float64).reshape(tuple(reversed(t.shape.tolist()))) for t in ad.tensors}
    weights = {}
    for t in GGUFReader(tiny.gguf_path).tensors:
        shape = tuple(reversed(t.shape.tolist()))
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(shape)
        if t.name + ".lora_a" in lora:
            w = w + s * lora[t.name + ".lora_b"] @ lora[t.name + ".lora_a"]     # (out, r) @ (r, in)
        if t.name == "rope_freqs.weight":               # Llama 3's frequencies: tiny.cfg["inv_freq"] holds them
            continue
        hf = gguf_name_to_hf(t.name)
        if hf.endswith(("q_proj.weight", "k_proj.weight")) and tiny.cfg["arch"] in ("llama", "mistral"):
            w = gguf_to_hf_rows(w, tiny.cfg["n_heads"] if "q_proj" in hf else tiny.cfg["n_kv_heads"])
        weights[hf] = w
    close(adapted["lg"], hf_ref.forward(weights, tiny.cfg, IDS))


@pytest.mark.parametrize("which", ["peft", "gguf"])
def test_exports_load_back_with_identical_logits(tiny, adapted, which):
    model = Llama(load_checkpoint(tiny.gguf_path))
    load_adapter(model, adapted[which], adapted["tok"])
    assert set(model.lora) == set(adapted["model"].lora)
    assert np.abs(logits(model) - adapted["lg"]).max() <= 1e-6


def test_merged_gguf_matches_the_separate_adapter(tiny, adapted, tmp_path):
    merge(tiny.gguf_path, adapted["gguf"], tmp_path / "merged.gguf", out_type="f32")
    rep = compare_logits(tiny.gguf_path, adapted["gguf"], tmp_path / "merged.gguf", [IDS])
    assert rep["rel_diff"] < 1e-5 and rep["argmax_agreement"] == 1.0


def test_a_short_lora_run_learns_with_the_familys_module_names(tiny, tmp_path):
    from vkdsl.train.trainer import run
    tr = write_jsonl(tmp_path / "train.jsonl", [{"prompt": p, "completion": c, "category": k} for p, c, k in TRAIN])
    he = write_jsonl(tmp_path / "held.jsonl", [{"prompt": p, "completion": c, "category": k} for p, c, k in HELD])
    pr = write_jsonl(tmp_path / "pres.jsonl", [{"text": "The quick brown fox jumps over the lazy dog."}])
    setup = (tiny, tr, he, pr)
    losses = {}
    for targets in (["q_proj", "v_proj", "up_proj"], ["attn_q", "attn_v", "ffn_up"]):
        cfg = tiny_cfg(setup, model=str(tiny.hf_dir), targets=targets, steps=10, lr=3e-2, checkpoint_every=0)
        r = run(cfg, tmp_path / targets[0], evidence_at_end=False)
        assert sorted(r.names) == sorted(f"blk.{i}.{m}" for i in range(2) for m in ("attn_q", "attn_v", "ffn_up"))
        recs = map(json.loads, (tmp_path / targets[0] / "metrics.jsonl").read_text().splitlines())
        losses[targets[0]] = [x["loss"] for x in recs if x["event"] == "step"]
    first, last = losses["q_proj"][:2], losses["q_proj"][-2:]
    assert np.mean(last) < 0.7 * np.mean(first), losses
    assert losses["q_proj"] == losses["attn_q"]          # HF and GGUF names pick the same modules


def test_info_names_the_family_and_what_it_adds(tiny):
    from click.testing import CliRunner
    from vkdsl.cli import main
    res = CliRunner().invoke(main, ["info", "--json", "--model", str(tiny.hf_dir)])
    assert res.exit_code == 0, res.output[-2000:]
    row = json.loads(res.output.strip().splitlines()[-1])
    assert row["arch"] == tiny.cfg["arch"] and row["format"] == "safetensors"
    assert (row["qkv_bias"], row["qk_norm"], row["head_dim"]) == (tiny.cfg["qkv_bias"], tiny.cfg["qk_norm"],
                                                                  tiny.cfg["head_dim"])
    assert row["family"].startswith({"llama3": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[
        family(tiny)])
    assert row["end_of_turn"] == {"mistral": "</s>"}.get(tiny.cfg["arch"], "<|im_end|>") and row["device_bytes"] > 0


def test_bench_model_and_train_run_on_the_family(tiny):
    """`vkdsl bench model / train --model M` on the tiny model (CI size; in this process): every row
    measured, the device forward agreeing with the numpy float32 forward of the family on every argmax."""
    from click.testing import CliRunner
    from vkdsl.cli import main
    rows = {}
    for bench in ("model", "train"):
        res = CliRunner().invoke(main, ["bench", bench, "--json", "--model", str(tiny.gguf_path)])
        assert res.exit_code == 0, res.output[-2000:]
        rows[bench] = [json.loads(x) for x in res.output.splitlines() if x.startswith("{")]
    prompts = [r for r in rows["model"] if r["case"].startswith("prompt_")]
    assert prompts and all(r["argmax_agreement"] == 1.0 and r["device_tok_s"] > 0 for r in prompts)
    steps = [r for r in rows["train"] if r["case"].startswith("sft")]
    assert len(steps) == 2 and all(r["tokens_per_s"] > 0 and np.isfinite(r["loss_last"]) for r in steps)


def test_a_chat_prompt_carries_one_bos(tiny):
    """Mistral's template writes BOS and its GGUF asks for one: `vkdsl generate --chat` adds none again."""
    from vkdsl.cli.models import _prompt_ids
    _, tok = load_model_files(tiny.gguf_path)
    ids = _prompt_ids(tok, "Is it down?", chat=True)
    assert tok.decode(ids).endswith(("[/INST]", "<|im_start|>assistant\n"))
    if family(tiny) == "mistral":
        assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
