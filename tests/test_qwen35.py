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


def test_lora_on_every_projection_trains(tiny):
    """LoRA on the DeltaNet projections, the full attention and the MLP: gradients reach every
    adapter and one step down them lowers the loss of a fixed batch."""
    folder, w, model = tiny
    import vkdsl
    rng = np.random.default_rng(0)
    names = [f"blk.{i}.{m}" for i in range(4) for m in model.cfg.linears(i)]
    table = {}
    for j, n in enumerate(names):
        out, inp = model.linear[n].shape
        table[n] = lora.LoRA.init(inp, out, r=4, alpha=8, seed=j, name=n)
        table[n].B.assign(vkdsl.tensor((0.01 * rng.standard_normal((4, out))).astype(np.float32)))
    model.lora = table
    target = np.array(IDS[1:])
    pick = vkdsl.tensor(np.eye(model.cfg.vocab_size, dtype=np.float32)[target])
    params = [t for lo in table.values() for t in (lo.A, lo.B)]

    @vkdsl.trace
    def step(ids):
        logits = model.forward(ids).reshape(len(target), -1)
        logp = logits - logits.exp().sum(-1, keepdim=True).log()
        loss = -(logp * pick).sum() / len(target)
        return [loss, *grad(loss, params)]
    ids = np.array([IDS[:-1]], np.int32)
    before, *grads = step(ids)
    norms = [float(np.abs(np.asarray(g)).max()) for g in grads]
    assert min(norms) > 0, f"an adapter gets no gradient: {[n for n, x in zip(names, norms[1::2]) if x == 0]}"
    for p, g in zip(params, grads):
        p.assign(vkdsl.tensor(p.numpy() - 0.05 * np.asarray(g)))
    after = step(ids)[0]
    before, after = float(np.asarray(before)), float(np.asarray(after))
    model.lora = {}
    assert after < before - 1e-3, f"loss {before:.4f} -> {after:.4f}"


def test_adapters_and_their_gradients_match_peft_in_float64(tiny):
    """Adapters on a DeltaNet projection (in_proj_a, through softplus into the decay), on in_proj_b
    (the write strength) and on the gated q_proj: the logits against the reference with PEFT's LoRA
    on the HF modules, and the gradient of sum(logits * G) with respect to the two DeltaNet B's
    against central differences of that reference."""
    import vkdsl
    from conftest import fd
    folder, w, model = tiny
    rng = np.random.default_rng(3)
    hf = {"blk.0.ssm_alpha": "model.layers.0.linear_attn.in_proj_a",
          "blk.2.ssm_beta": "model.layers.2.linear_attn.in_proj_b",
          "blk.3.attn_q": "model.layers.3.self_attn.q_proj"}
    table = {}
    for j, n in enumerate(hf):
        out, inp = model.linear[n].shape
        table[n] = lora.LoRA.init(inp, out, r=2, alpha=4, seed=j, name=n)
        table[n].B.assign(vkdsl.tensor((0.3 * rng.standard_normal((2, out))).astype(np.float32)))
    model.lora = table
    ids = IDS[:40]
    G = rng.standard_normal((len(ids), fx.CONFIG["vocab_size"]))
    Bs = [table[n].B for n in list(hf)[:2]]

    @vkdsl.trace
    def run(x):
        logits = model.forward(x)
        return [logits, *grad((logits * vkdsl.tensor(G[None].astype(np.float32))).sum(), Bs)]
    logits, *grads = run(np.array([ids], np.int32))
    model.lora = {}
    As = [table[n].A.numpy().T.astype(np.float64) for n in hf]
    Bt = [table[n].B.numpy().T.astype(np.float64) for n in hf]

    def ref(*bt):          # B^T of each adapter, PEFT's orientation
        return qwen35_ref.forward(w, fx.CONFIG, ids, peft={hf[n]: (a, b) for n, a, b in zip(hf, As, bt)},
                                  scale=table["blk.0.ssm_alpha"].scale)
    close(np.asarray(logits)[0], ref(*Bt))
    for i, (n, g) in enumerate(zip(hf, grads)):
        want = fd(lambda *b: ref(*b, Bt[2]), Bt[:2], i, G).T
        err = np.abs(np.asarray(g) - want).max() / np.abs(want).max()
        assert err <= 1e-3, f"{n}: gradient of B off by {err:.2e} of its largest entry"


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(model_type="qwen3_6"), "model_type is 'qwen3_6'"),
    (lambda c: c.update(linear_num_value_heads=3), "value heads 3 / key heads 2"),
    (lambda c: c.update(layer_types=["linear_attention"] * 3 + ["sliding"]), "layer_types"),
    (lambda c: c.update(linear_key_head_dim="16"), 'linear_key_head_dim = "16"'),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), "rope_type 'default'"),
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


def test_cli_logits_and_what_is_not_built_yet(tiny, tmp_path):
    """`vkdsl logits` on the folder gives the reference's logits of the tokenized prompt; generation
    and training refuse the family in one line that says what runs it."""
    from fixtures.cli import vkdsl
    from vkdsl.models import load_tokenizer
    folder, w, _ = tiny
    out = tmp_path / "l.npy"
    p = vkdsl(["logits", "--model", str(folder), "--prompt", "hello there world", "--out", str(out)])
    assert p.returncode == 0, p.stderr
    ids = load_tokenizer(folder).encode("hello there world")
    close(np.load(out), qwen35_ref.forward(w, fx.CONFIG, ids))
    p = vkdsl(["generate", "--model", str(folder), "--prompt", "hi"])
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith("Error:") \
        and "not built yet" in p.stderr and "Traceback" not in p.stderr
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n' * 4)
    p = vkdsl(["train", "--model", str(folder), "--train-file", str(data), "--heldout-file", str(data),
               "--out", str(tmp_path / "run")])
    assert p.returncode != 0 and "a qwen35 model" in p.stderr and "Traceback" not in p.stderr, p.stderr[-500:]
