"""Qwen3.5 (models/qwen35.py) on a tiny random model written as transformers writes it
(tests/fixtures/qwen35.py), against golden/qwen35_ref.py: transformers' computation in float64
from the HF names and values (the DeltaNet layers through the step-by-step delta rule, where the
device runs the chunked form). Tolerance as the other families: max |diff| <= 1e-4 * max |ref|
(fp32 through four layers; a wrong norm offset, gate or head order moves logits by O(1))."""
import json

import numpy as np
import pytest

from fixtures import qwen35 as fx
from vkdsl.autograd import grad
from vkdsl.models import ModelFileError, load_checkpoint
from vkdsl.models.llama import LogitsFn
from vkdsl.models.qwen35 import Qwen35
from vkdsl.ops import lora
from vkdsl_golden import qwen35_ref

IDS = [5, 17, 200, 33, 9, 1, 2, 250, 44, 45, 46, 7, 8, 9] * 6      # 84 tokens: two delta-rule chunks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, w = fx.write(tmp_path_factory.mktemp("qwen35"))
    return folder, w, Qwen35(load_checkpoint(folder), quant="none")


def close(got, want, rel=1e-4):
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= rel, f"max |diff| / max |ref| = {err:.2e} > {rel:g}"


def test_logits_match_transformers_computation(tiny):
    folder, w, model = tiny
    got = LogitsFn(model)(np.array([IDS, IDS[::-1]]))
    close(got[0], qwen35_ref.forward(w, fx.CONFIG, IDS))
    close(got[1], qwen35_ref.forward(w, fx.CONFIG, IDS[::-1]))


def test_multimodal_wrapper_loads_its_text_part(tmp_path):
    """The qwen3_5 wrapper's config holds the text model under text_config and its weights under
    model.language_model.*; the vision tower's tensors are read past."""
    cfg = {"model_type": "qwen3_5", "text_config": fx.CONFIG, "vision_config": {"depth": 1}}
    folder, w = fx.write(tmp_path, mtp=False)
    import safetensors.numpy as stn
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in w.items()}
    renamed["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    stn.save_file(renamed, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    got = LogitsFn(Qwen35(load_checkpoint(folder), quant="none"))(np.array([IDS[:20]]))[0]
    close(got, qwen35_ref.forward(w, fx.CONFIG, IDS[:20]))


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(model_type="qwen3_6"), "model_type is 'qwen3_6'"),
    (lambda c: c.update(linear_num_value_heads=3), "value heads 3 / key heads 2"),
    (lambda c: c.update(layer_types=["linear_attention"] * 3 + ["sliding"]), "layer_types"),
    (lambda c: c.update(linear_key_head_dim="16"), 'linear_key_head_dim = "16"'),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), "rope_type 'default'"),
    (lambda c: c.update(linear_conv_kernel_dim=1), "linear_conv_kernel_dim"),
])
def test_bad_config_is_one_line(tmp_path, edit, match):
    cfg = json.loads(json.dumps(fx.CONFIG))
    edit(cfg)
    folder, _ = fx.write(tmp_path, mtp=False)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match=match):
        load_checkpoint(folder)


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    import safetensors.numpy as stn
    folder, w = fx.write(tmp_path, mtp=False)
    w2 = dict(w)
    del w2["model.layers.1.linear_attn.A_log"]
    stn.save_file(w2, str(folder / "model.safetensors"))
    with pytest.raises(ModelFileError, match=r"missing tensor 'blk.1.ssm_a'"):
        load_checkpoint(folder)
    w2 = dict(w, **{"model.layers.0.linear_attn.in_proj_z.weight": np.zeros((8, 64), np.float32)})
    stn.save_file(w2, str(folder / "model.safetensors"))
    with pytest.raises(ModelFileError, match=r"'blk.0.attn_gate.weight' has shape \(8, 64\)"):
        load_checkpoint(folder)


def test_cli_logits_generate_and_info(tiny, tmp_path):
    """`vkdsl logits` on the folder gives the reference's logits of the tokenized prompt; `generate`
    greedily continues it (the first new token is the reference's argmax); `info` names the family."""
    from fixtures.cli import vkdsl
    from vkdsl.models import load_tokenizer
    folder, w, _ = tiny
    out = tmp_path / "l.npy"
    p = vkdsl(["logits", "--model", str(folder), "--prompt", "hello there world", "--out", str(out)])
    assert p.returncode == 0, p.stderr
    tok = load_tokenizer(folder)
    ids = tok.encode("hello there world")
    want = qwen35_ref.forward(w, fx.CONFIG, ids)
    close(np.load(out), want)
    p = vkdsl(["generate", "--model", str(folder), "--prompt", "hello there world", "--max-new-tokens", "3"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("hello there world" + tok.decode([int(np.argmax(want[-1]))]))
    p = vkdsl(["info", "--model", str(folder), "--json"])
    assert p.returncode == 0 and json.loads(p.stdout)["family"].startswith("Qwen3.5"), p.stderr


def test_generation_continues_the_prompt_exactly(tiny):
    """Greedy steps from the state cache (conv inputs, delta-rule state, the full layers' keys and
    values) give the logits the whole sequence gives at each new position; a 70-token prompt
    crosses a chunk and is padded to its bucket (the padding must leave the state alone)."""
    from vkdsl.models.generate import Generator
    _, _, model = tiny
    for prompt in (IDS[:10], IDS[:70]):
        gen = Generator(model, 100)
        lg, toks, steps = gen.logits_prefill(prompt)[-1], list(prompt), []
        for pos in range(len(prompt), len(prompt) + 8):
            toks.append(int(np.argmax(lg)))
            lg = gen.logits_step(toks[-1], pos)
            steps.append(lg)
        whole = LogitsFn(model)(np.array([toks], np.int32))[0, len(prompt):]
        close(np.array(steps), whole, rel=1e-5)


def test_training_run_resumes_bit_identically(tmp_path):
    """vkdsl-train's SFT stage (rows packed, TMKL) with adapters on every linear module of the hybrid:
    the loss falls, every adapter's B leaves zero (a gradient reached it), and a run killed after
    step 3 and resumed ends with the adapter of an uninterrupted run, bit for bit."""
    from fixtures.train_data import HELD, TRAIN, tiny_cfg, write_jsonl
    from vkdsl.train import checkpoint
    from vkdsl.train.trainer import run
    rows = [{"prompt": p, "completion": c, "category": k} for p, c, k in TRAIN]
    from types import SimpleNamespace
    data = (SimpleNamespace(gguf_path=""), write_jsonl(tmp_path / "train.jsonl", rows),
            write_jsonl(tmp_path / "held.jsonl", [{"prompt": p, "completion": c, "category": k} for p, c, k in HELD]),
            write_jsonl(tmp_path / "pres.jsonl", [{"text": "The quick brown fox jumps over the lazy dog."}]))
    folder, _ = fx.write(tmp_path / "qwen35", mtp=False)
    cfg = tiny_cfg(data, model=str(folder), targets=["all-linear"], steps=5, checkpoint_every=2, tmkl=0.1)
    full = run(cfg, tmp_path / "full", evidence_at_end=False)
    assert len(full.names) == 3 * 8 + 7          # 3 DeltaNet layers x 8 modules, the full layer's 7
    untouched = [n for n in full.names if not full.model.lora[n].B.numpy().any()]
    assert not untouched, f"no gradient reached {untouched}"
    run(cfg, tmp_path / "part", stop_after=3, evidence_at_end=False)
    assert checkpoint.load(tmp_path / "part")[0]["step"] == 2
    resumed = run(cfg, tmp_path / "part", resume=tmp_path / "part", evidence_at_end=False)
    for a, b in zip(full.params, resumed.params):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    losses = [json.loads(x)["loss"] for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
              if json.loads(x).get("event") == "step"]
    assert losses[-1] < losses[0], losses


def test_peft_round_trip_and_merge(tiny, tmp_path):
    """Adapters on the DeltaNet projections and the full attention, saved as PEFT (HF module names,
    linear_attn.in_proj_*), load back to the same logits; merged into a copy of the HF folder
    (f32), the merged model's logits equal base + adapter's."""
    import vkdsl
    from vkdsl.models import load_tokenizer
    from vkdsl.models.adapters import load_adapter, save_peft
    from vkdsl.models.merge import compare_logits, merge
    folder, _, model = tiny
    rng = np.random.default_rng(5)
    table = {}
    for j, n in enumerate(["blk.0.attn_qkv", "blk.1.ssm_out", "blk.2.attn_gate", "blk.3.attn_q"]):
        out, inp = model.linear[n].shape
        table[n] = lora.LoRA.init(inp, out, r=4, alpha=8, seed=j, name=n)
        table[n].B.assign(vkdsl.tensor((0.2 * rng.standard_normal((4, out))).astype(np.float32)))
    model.lora = table
    ids = np.array([IDS[:30]], np.int32)
    want = LogitsFn(model)(ids)
    save_peft(model, tmp_path / "peft", r=4, alpha=8.0)
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj"]
    model.lora = {}
    load_adapter(model, tmp_path / "peft", load_tokenizer(folder))
    got = LogitsFn(model)(ids)
    model.lora = {}
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    merge(folder, tmp_path / "peft", tmp_path / "merged", out_type="f32")
    c = compare_logits(folder, tmp_path / "peft", tmp_path / "merged", ids)
    assert c["rel_diff"] <= 1e-5 and c["argmax_agreement"] == 1.0, c


def test_packed_rows_get_their_own_logits(tiny):
    """Three rows packed first-fit into one 128-token sequence (train.packing: positions restart,
    spans per row, padding after them): each row's logits are its logits alone -- neither the
    attention, nor the DeltaNet's convolution or state, crosses a row. One row crosses a chunk."""
    import vkdsl
    from vkdsl.train.packing import Packing
    _, _, model = tiny
    rows = [IDS[:20], IDS[3:73], IDS[10:19]]
    pk = Packing.plan([len(r) for r in rows], 128)
    padded = np.zeros((3, 128), np.int32)
    for b, r in enumerate(rows):
        padded[b, :len(r)] = r
    assert pk.n_seq == 1
    fn = vkdsl.trace(lambda ids, pos, spans: model.forward(ids, positions=pos, spans=spans))
    packed = np.asarray(fn(pk.apply(padded, 0), pk.positions(), pk.spans()))[0]
    for (s, o), r in zip(pk.place, rows):
        alone = LogitsFn(model)(np.array([r], np.int32))[0]
        close(packed[o:o + len(r)], alone, rel=1e-5)
