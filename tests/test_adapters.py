"""Adapters other tools load (PEFT safetensors, llama.cpp GGUF LoRA), merge, provenance manifest.

Independent references:
- a float64 numpy forward in the Hugging Face convention written here (HF row order,
  half-split RoPE, PEFT's y = x W^T + s (x A^T) B^T), fed by safetensors' own reader from the
  exported files and by the HF-order weights build_tiny made — it shares no code with
  vkdsl's device forward, its LoRA or the exporter;
- gguf's GGUFReader for the GGUF adapter and the merged GGUF.

Tolerance of device fp32 vs the float64 reference: max |diff| <= 1e-3 * max |ref| and the same
argmax everywhere (as tests/test_model_forward.py). Round trips through our own files
(same float32 numbers, same device program) must be exact (max diff <= 1e-6).
"""
import json
import math
import re
import shutil

import numpy as np
import pytest
import safetensors.numpy as stn
from gguf import GGUFReader
from gguf.quants import dequantize

from fixtures import lora as fixtures_lora
from fixtures import synthetic
from vkdsl.models import ModelFileError, hf_to_gguf_rows, load_model_files
from vkdsl.models.adapters import (LINEARS, load_adapter, save_adapter_bundle,
                                   save_gguf_adapter, save_peft)
from vkdsl.models.llama import Llama
from vkdsl.models.identity import tokenizer_sha256
from vkdsl.models.manifest import (ManifestMismatch, build_manifest, read_manifest, write_manifest)
from vkdsl.models.merge import compare_logits, merge

IDS = [5, 17, 200, 33, 9, 1, 2, 250, 44, 45, 46]
R, ALPHA, RSLORA = 4, 8.0, True                 # s = 8 / sqrt(4) = 4
SCALE = ALPHA / math.sqrt(R)
HF_MOD = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another base (different weights, same tokenizer) for manifest mismatches."""
    return synthetic.build_tiny(tmp_path_factory.mktemp("other"), seed=1)


def random_lora(model, seed=0):
    fixtures_lora.random_lora(model, R, SCALE, seed)


def logits(model, ids=IDS, adapters_on=True):
    return fixtures_lora.logits(model, ids, adapters_on)


@pytest.fixture(scope="module")
def adapted(tiny, tmp_path_factory):
    """The GGUF tiny model with a random adapter, its logits, and both exports + manifest."""
    ck, tok = load_model_files(tiny.gguf_path)
    model = Llama(ck)
    random_lora(model)
    out = tmp_path_factory.mktemp("adapters")
    man = build_manifest(tiny.gguf_path, tok, target_modules=LINEARS, r=R, alpha=ALPHA,
                         rslora=RSLORA, seeds={"adapter": 0}, objective="sft")
    save_peft(model, out / "peft", r=R, alpha=ALPHA, rslora=RSLORA, base_name="tiny",
              manifest=man)
    save_gguf_adapter(model, out / "adapter.gguf", r=R, alpha=ALPHA, rslora=RSLORA, manifest=man)
    return dict(model=model, tok=tok, ck=ck, lg=logits(model), base_lg=logits(model, adapters_on=False),
                peft=out / "peft", gguf=out / "adapter.gguf", out=out, manifest=man)


# ----------------------------------------------------------------------------- HF reference

def hf_peft_forward(w, cfg, ids, peft=None, scale=0.0):
    """transformers' Llama + PEFT LoRA in float64: HF row order, rotate_half RoPE;
    peft: {HF module prefix 'model.layers.i.self_attn.q_proj': (A (r, in), B (out, r))}."""
    H, KV, hd = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    T = len(ids)
    f64 = {k: v.astype(np.float64) for k, v in w.items()}
    peft = peft or {}

    def lin(x, name):                      # name: 'model.layers.0.self_attn.q_proj'
        y = x @ f64[name + ".weight"].T
        if name in peft:
            A, B = peft[name]
            y = y + scale * ((x @ A.T) @ B.T)
        return y

    def norm(x, g):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + cfg["norm_eps"]) * g

    inv_freq = 1.0 / cfg["rope_base"] ** (np.arange(0, hd, 2) / hd)
    ang = np.outer(np.arange(T), inv_freq)
    ang = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(ang), np.sin(ang)

    def rotate(v):
        return v * cos + np.concatenate([-v[:, hd // 2:], v[:, :hd // 2]], axis=-1) * sin

    x = f64["model.embed_tokens.weight"][ids]
    for i in range(cfg["n_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, f64[p + "input_layernorm.weight"])
        q, k, v = (lin(h, p + f"self_attn.{n}_proj") for n in "qkv")
        heads = []
        for head in range(H):
            kvh = head // (H // KV)
            qh, kh = rotate(q[:, head * hd:(head + 1) * hd]), rotate(k[:, kvh * hd:(kvh + 1) * hd])
            s = qh @ kh.T / np.sqrt(hd)
            s[np.triu_indices(T, 1)] = -np.inf
            pr = np.exp(s - s.max(-1, keepdims=True))
            heads.append(pr / pr.sum(-1, keepdims=True) @ v[:, kvh * hd:(kvh + 1) * hd])
        x = x + lin(np.concatenate(heads, axis=-1), p + "self_attn.o_proj")
        h = norm(x, f64[p + "post_attention_layernorm.weight"])
        g, u = lin(h, p + "mlp.gate_proj"), lin(h, p + "mlp.up_proj")
        x = x + lin(g / (1 + np.exp(-g)) * u, p + "mlp.down_proj")
    x = norm(x, f64["model.norm.weight"])
    return x @ f64.get("lm_head.weight", f64["model.embed_tokens.weight"]).T


def read_peft_folder(folder):
    """(modules {prefix: (A, B)}, scale) with safetensors' own numpy reader."""
    cfg = json.loads((folder / "adapter_config.json").read_text())
    t = stn.load_file(str(folder / "adapter_model.safetensors"))
    mods = {}
    for k in t:
        if k.endswith("lora_A.weight"):
            pre = k[:-len(".lora_A.weight")]
            mods[pre[len("base_model.model."):]] = (t[k].astype(np.float64),
                                                    t[pre + ".lora_B.weight"].astype(np.float64))
    r = cfg["r"]
    s = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    return mods, s, cfg


def close(lg, ref):
    assert np.abs(lg - ref).max() <= 1e-3 * np.abs(ref).max(), np.abs(lg - ref).max()
    assert (lg.argmax(-1) == ref.argmax(-1)).all()


# ----------------------------------------------------------------------------- tests

def test_peft_export_reproduces_device_logits_in_hf_reference(tiny, adapted):
    mods, s, cfg = read_peft_folder(adapted["peft"])
    assert cfg["peft_type"] == "LORA" and cfg["r"] == R and cfg["lora_alpha"] == ALPHA
    assert cfg["use_rslora"] is True and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["bias"] == "none" and cfg["lora_dropout"] == 0
    assert sorted(cfg["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj",
                                                    "gate_proj", "up_proj", "down_proj"])
    assert len(mods) == 2 * 7 and s == SCALE
    a, b = mods["model.layers.0.self_attn.q_proj"]
    assert a.shape == (R, 64) and b.shape == (64, R)          # A (r, in), B (out, r)
    assert mods["model.layers.1.self_attn.k_proj"][1].shape == (32, R)
    assert mods["model.layers.1.mlp.down_proj"][0].shape == (R, 96)

    lg = adapted["lg"]
    base_ref = hf_peft_forward(tiny.hf_weights, tiny.cfg, IDS)
    ref = hf_peft_forward(tiny.hf_weights, tiny.cfg, IDS, mods, s)
    close(lg, ref)
    close(adapted["base_lg"], base_ref)
    # the adapter matters: its effect is far above the tolerance
    assert np.abs(ref - base_ref).max() > 50 * 1e-3 * np.abs(ref).max()
    # and the Q/K row order matters: leaving B in GGUF order breaks the match
    wrong = dict(mods)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"):
        A, B = mods[name]
        heads = tiny.cfg["n_heads"] if "q_proj" in name else tiny.cfg["n_kv_heads"]
        wrong[name] = (A, hf_to_gguf_rows(B, heads))
    bad = hf_peft_forward(tiny.hf_weights, tiny.cfg, IDS, wrong, s)
    assert np.abs(lg - bad).max() > 10 * 1e-3 * np.abs(ref).max()


def test_gguf_adapter_layout_matches_llama_cpp_convention(tiny, adapted):
    reader = GGUFReader(adapted["gguf"])
    key = lambda k: reader.fields[k].contents()    # noqa: E731
    assert key("general.type") == "adapter" and key("adapter.type") == "lora"
    assert key("general.architecture") == "llama"
    # llama.cpp scales by alpha / r: rsLoRA's alpha/sqrt(r) is written as alpha * sqrt(r)
    assert key("adapter.lora.alpha") == pytest.approx(SCALE * R)
    mods, _, _ = read_peft_folder(adapted["peft"])
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 * 2 * 7
    for i in range(2):
        for m in LINEARS:
            a, b = tensors[f"blk.{i}.{m}.weight.lora_a"], tensors[f"blk.{i}.{m}.weight.lora_b"]
            A, B = mods[f"model.layers.{i}.{HF_MOD[m]}"]
            # GGUF dims are reversed numpy shapes: lora_a [in, r], lora_b [r, out]
            assert a.shape.tolist() == [A.shape[1], R] and b.shape.tolist() == [R, B.shape[0]]
            a_np = np.asarray(a.data).reshape(R, -1)
            b_np = np.asarray(b.data).reshape(-1, R)
            np.testing.assert_array_equal(a_np, A)
            heads = {"attn_q": tiny.cfg["n_heads"], "attn_k": tiny.cfg["n_kv_heads"]}.get(m)
            np.testing.assert_array_equal(b_np, B if heads is None else hf_to_gguf_rows(B, heads))


@pytest.mark.parametrize("which", ["peft", "gguf", "run"])
def test_exports_load_back_with_identical_logits(tiny, adapted, which, tmp_path):
    path = adapted[which] if which != "run" else tmp_path / "run"
    if which == "run":     # what a training run writes: run/adapter/ (PEFT) + run/adapter.gguf
        out = save_adapter_bundle(adapted["model"], path, model_path=tiny.gguf_path,
                                  tokenizer=adapted["tok"], r=R, alpha=ALPHA, rslora=RSLORA,
                                  extra={"seeds": {"adapter": 0}})
        assert (path / "adapter" / "vkdsl_manifest.json").is_file() and out["gguf"].is_file()
        embedded = json.loads(GGUFReader(out["gguf"]).fields["vkdsl.manifest"].contents())
        assert len(embedded.pop("weights_sha256")) == 64 and embedded == out["manifest"]
    model = Llama(adapted["ck"])
    aw = load_adapter(model, path, adapted["tok"])
    assert set(model.lora) == set(adapted["model"].lora)
    assert aw.manifest is not None and aw.manifest["seeds"] == {"adapter": 0}
    for n, lo in model.lora.items():
        assert lo.scale == pytest.approx(SCALE, rel=1e-6)
    assert np.abs(logits(model) - adapted["lg"]).max() <= 1e-6


def test_merge_f32_matches_separate_path_and_the_formula(tiny, adapted, tmp_path):
    out = tmp_path / "merged.gguf"
    rep = merge(tiny.gguf_path, adapted["peft"], out, "f32")
    assert rep["merged_modules"] == 14 and rep["max_requant_rel_err"] < 1e-5
    cmp = compare_logits(tiny.gguf_path, adapted["peft"], out, [IDS])
    assert cmp["rel_diff"] <= 1e-5 and cmp["argmax_agreement"] == 1.0
    # merged tensor = W + s * (B A) with the PEFT file's B rows put in GGUF order
    base, merged = GGUFReader(tiny.gguf_path), GGUFReader(out)
    bt, mt = ({t.name: t for t in r.tensors} for r in (base, merged))
    mods, s, _ = read_peft_folder(adapted["peft"])
    A, B = mods["model.layers.1.self_attn.q_proj"]
    t = bt["blk.1.attn_q.weight"]
    W = dequantize(np.asarray(t.data), t.tensor_type).reshape(64, 64)
    want = W + s * hf_to_gguf_rows(B @ A, tiny.cfg["n_heads"])
    assert mt["blk.1.attn_q.weight"].tensor_type.name == "F32"
    np.testing.assert_allclose(np.asarray(mt["blk.1.attn_q.weight"].data), want, rtol=0, atol=1e-5)
    # untouched tensors and metadata copied as they were
    np.testing.assert_array_equal(np.asarray(mt["token_embd.weight"].data), np.asarray(bt["token_embd.weight"].data))
    assert mt["token_embd.weight"].tensor_type == bt["token_embd.weight"].tensor_type
    for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template",
              "llama.attention.head_count_kv"):
        assert merged.fields[k].contents() == base.fields[k].contents()


def test_merge_keep_requantizes_and_reports_the_loss(tiny, adapted, tmp_path):
    out = tmp_path / "merged_q.gguf"
    rep = merge(tiny.gguf_path, adapted["gguf"], out, "keep")
    mt = {t.name: t for t in GGUFReader(out).tensors}
    for name, info in rep["tensors"].items():
        want = synthetic.DEFAULT_TYPES.get(name, "F32")
        assert info["type"] == want == mt[name].tensor_type.name
        if want in ("Q4_0", "Q4_1", "Q8_0"):
            assert info["requant_rel_err"] > 1e-4   # requantization loses part of the update
        elif want == "F32":
            assert info["requant_rel_err"] < 1e-5
    assert rep["max_requant_rel_err"] == max(i["requant_rel_err"] for i in rep["tensors"].values())
    cmp = compare_logits(tiny.gguf_path, adapted["gguf"], out, [IDS])
    assert cmp["max_abs_diff"] > 0 and cmp["positions"] == len(IDS)


def test_merge_hf_base_writes_safetensors_folder(tiny, adapted, tmp_path):
    out = tmp_path / "merged_hf"
    # the manifest names tiny.gguf; the HF folder holds the same weights but is another file
    with pytest.raises(ManifestMismatch, match="base model"):
        merge(tiny.hf_dir, adapted["peft"], out, "f32")
    rep = merge(tiny.hf_dir, adapted["peft"], out, "f32", force=True)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert rep["merged_modules"] == 14
    cmp = compare_logits(tiny.hf_dir, adapted["peft"], out, [IDS], force=True)
    assert cmp["rel_diff"] <= 1e-5 and cmp["argmax_agreement"] == 1.0
    # and against the independent reference on the merged HF weights
    merged_w = stn.load_file(str(out / "model.safetensors"))
    mods, s, _ = read_peft_folder(adapted["peft"])
    close(hf_peft_forward(merged_w, tiny.cfg, IDS), hf_peft_forward(tiny.hf_weights, tiny.cfg, IDS, mods, s))


def test_merge_refuses_to_write_over_its_base_or_into_a_folder_before_any_work(tiny, adapted, tmp_path):
    # once: --out the base GGUF replaced the user's base with the merged model; --out a folder
    # merged everything, then failed on "[Errno 21] Is a directory"
    base = shutil.copy(tiny.gguf_path, tmp_path / "base.gguf")
    before = (tmp_path / "base.gguf").read_bytes()
    with pytest.raises(ModelFileError, match=r"base.gguf: the base itself; the merged model goes "):
        merge(base, adapted["gguf"], tmp_path / "." / "base.gguf", "f32")
    assert (tmp_path / "base.gguf").read_bytes() == before
    with pytest.raises(ModelFileError, match=r": a folder; a GGUF base merges into one .gguf file"):
        merge(base, adapted["gguf"], tmp_path, "f32")
    with pytest.raises(ModelFileError, match="the base itself"):
        merge(tiny.hf_dir, adapted["peft"], tiny.hf_dir, "f32", force=True)
    from vkdsl.fileio import atomic_write
    with pytest.raises(IsADirectoryError, match=rf"^{re.escape(str(tmp_path))}: a folder is there, "):
        atomic_write(tmp_path, b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.gguf"]
    from fixtures.cli import vkdsl          # an empty --compare prompt: refused before the merge
    p = vkdsl(["merge", "--model", str(tiny.gguf_path), "--adapter", str(adapted["gguf"]),
               "--out", str(tmp_path / "m.gguf"), "--compare", ""])
    assert p.returncode == 1 and p.stderr.strip().endswith("Error: --compare '' tokenizes to no tokens")
    assert not (tmp_path / "m.gguf").exists()


def test_manifest_refuses_another_base_and_force_overrides(other, adapted, capsys):
    ck, tok = load_model_files(other.gguf_path)
    model = Llama(ck)
    for path in (adapted["peft"], adapted["gguf"]):      # file beside, and embedded in GGUF
        with pytest.raises(ManifestMismatch) as e:
            load_adapter(model, path, tok)
        msg = str(e.value)
        assert "base model" in msg and "tiny.gguf" in msg and "--force" in msg
        assert model.lora == {}
        load_adapter(model, path, tok, force=True)
        err = capsys.readouterr().err
        assert "WARNING" in err and "base model" in err and len(model.lora) == 14
        model.lora = {}


def test_manifest_contents_and_tokenizer_mismatch(tiny, adapted, tmp_path):
    man = read_manifest(adapted["peft"] / "vkdsl_manifest.json")
    assert man["base"]["name"] == "tiny.gguf" and len(man["base"]["sha256"]) == 64
    assert man["adapter"] == {"target_modules": sorted(LINEARS), "r": R, "alpha": ALPHA,
                              "rslora": True, "scaling": SCALE, "dtype": "float32"}
    assert man["objective"] == "sft" and man["chat_template_sha256"]
    # the same vocabulary from tokenizer.json hashes the same as from the GGUF
    _, tok_hf = load_model_files(tiny.hf_dir)
    assert tokenizer_sha256(tok_hf) == man["tokenizer_sha256"]
    folder = tmp_path / "peft"
    shutil.copytree(adapted["peft"], folder)
    man["tokenizer_sha256"] = "0" * 64
    write_manifest(folder, man)
    with pytest.raises(ManifestMismatch, match="tokenizer"):
        load_adapter(Llama(adapted["ck"]), folder, adapted["tok"])


def _rewrite(folder, edit):
    t = stn.load_file(str(folder / "adapter_model.safetensors"))
    edit(t)
    stn.save_file(t, str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize("case", ["missing_key", "wrong_shape", "unknown_module", "bad_layer",
                                  "no_config", "wrong_rank"])
def test_bad_peft_folders_give_clear_errors(adapted, tmp_path, case):
    folder = tmp_path / "bad"
    shutil.copytree(adapted["peft"], folder)
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
    if case == "missing_key":
        _rewrite(folder, lambda t: t.pop(key))
        expect = [key, "missing key", "adapter_model.safetensors"]
    elif case == "wrong_shape":
        _rewrite(folder, lambda t: t.__setitem__(key, np.zeros((33, R), np.float32)))
        expect = [key, "(33, 4)", "(32, 4)"]
    elif case == "unknown_module":
        bad = "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight"
        _rewrite(folder, lambda t: t.__setitem__(bad, np.zeros((R, 64), np.float32)))
        expect = [bad, "unexpected key"]
    elif case == "bad_layer":
        bad = "base_model.model.model.layers.7.mlp.up_proj.lora_A.weight"
        _rewrite(folder, lambda t: t.__setitem__(bad, np.zeros((R, 64), np.float32)))
        expect = [bad, "layer 7"]
    elif case == "no_config":
        (folder / "adapter_config.json").unlink()
        expect = ["adapter_config.json", str(folder)]
    else:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        cfg["r"] = 8
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
        expect = ["r=8", "lora_A.weight"]
    with pytest.raises(ModelFileError) as e:
        load_adapter(Llama(adapted["ck"]), folder, adapted["tok"])
    for s in expect:
        assert s in str(e.value), (s, str(e.value))


@pytest.mark.parametrize("edit, what", [
    (lambda cfg: cfg.update(lora_alpha=16), "adapter alpha is 16.0, the manifest records 8.0"),
    (lambda cfg: cfg.update(use_rslora=False), "adapter rslora is False"),
], ids=["alpha", "rslora"])
def test_an_edited_peft_config_is_refused(adapted, tmp_path, edit, what):
    folder = tmp_path / "peft"
    shutil.copytree(adapted["peft"], folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    edit(cfg)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    model = Llama(adapted["ck"])
    with pytest.raises(ManifestMismatch, match=what):
        load_adapter(model, folder, adapted["tok"])
    assert model.lora == {}


def test_changed_weight_bytes_are_refused_and_force_is_loud(adapted, tmp_path, capsys):
    folder = tmp_path / "peft"
    shutil.copytree(adapted["peft"], folder)
    w = folder / "adapter_model.safetensors"
    data = bytearray(w.read_bytes())
    for i in range(len(data) - 50, len(data)):      # 50 bytes of the last tensor's data
        data[i] ^= 0x10
    w.write_bytes(bytes(data))
    model = Llama(adapted["ck"])
    with pytest.raises(ManifestMismatch, match=r"weights' sha256 .*\(changed after saving\)"):
        load_adapter(model, folder, adapted["tok"])
    load_adapter(model, folder, adapted["tok"], force=True)
    assert "WARNING" in capsys.readouterr().err and len(model.lora) == 14


def test_changed_gguf_adapter_tensors_are_refused(adapted, tmp_path):
    path = tmp_path / "adapter.gguf"
    data = bytearray(adapted["gguf"].read_bytes())
    data[-8] ^= 0x01                               # inside the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(ManifestMismatch, match="weights' sha256"):
        load_adapter(Llama(adapted["ck"]), path, adapted["tok"])


def test_a_foreign_peft_adapter_without_manifest_loads(adapted, tmp_path):
    folder = tmp_path / "foreign"
    shutil.copytree(adapted["peft"], folder)
    (folder / "vkdsl_manifest.json").unlink()
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 16                         # whatever the foreign tool chose: nothing to check against
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    model = Llama(adapted["ck"])
    aw = load_adapter(model, folder, adapted["tok"])
    assert aw.manifest is None and len(model.lora) == 14 and aw.alpha == 16.0


def _foreign_gguf(src, dst, alpha):
    """src's tensors re-written as a tool other than vkdsl would: adapter.lora.alpha = alpha and no
    vkdsl.* keys (so no manifest, no trainer alpha)."""
    import gguf
    reader = GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), "llama")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("alpha, scale", [(0.0, 1.0), (2.0 * R, 2.0), (float(R), 1.0)])
def test_a_gguf_adapter_scales_as_llama_cpp_does_alpha_zero_included(adapted, tmp_path, alpha,
                                                                     scale):
    # llama.cpp (src/llama-adapter.h, get_scale): scale = alpha ? alpha / rank : 1. An alpha of 0
    # once gave scale 0 here: the adapter loaded and changed nothing.
    from vkdsl.models.adapters import gguf_lora
    path = _foreign_gguf(adapted["gguf"], tmp_path / "foreign.gguf", alpha)
    aw = gguf_lora.read(path, Llama(adapted["ck"]).cfg)
    assert len(aw.modules) == 14 and aw.manifest is None
    assert {s for _, _, s in aw.modules.values()} == {scale}
    assert aw.alpha / aw.r == scale


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -1.0])
def test_a_gguf_adapter_alpha_that_is_no_scale_is_one_line(adapted, tmp_path, alpha):
    from vkdsl.models.adapters import gguf_lora
    path = _foreign_gguf(adapted["gguf"], tmp_path / "foreign.gguf", alpha)
    with pytest.raises(ModelFileError, match=re.escape(
            f"{path}: adapter.lora.alpha = {alpha!r}, expected a finite number >= 0")):
        gguf_lora.read(path, Llama(adapted["ck"]).cfg)


@pytest.mark.parametrize("key, value, want", [
    ("lora_alpha", "16", 'lora_alpha = "16", expected a finite number > 0'),
    ("lora_alpha", float("nan"), "lora_alpha = NaN, expected a finite number > 0"),
    ("lora_alpha", 0, "lora_alpha = 0, expected a finite number > 0"),
    ("r", 0, "r = 0, expected an integer >= 1"), ("r", 4.5, "r = 4.5, expected an integer >= 1"),
    ("r", True, "r = true, expected an integer >= 1"),
    ("use_rslora", "yes", 'use_rslora = "yes", expected true or false')])
def test_peft_hyper_parameters_of_the_wrong_kind_are_one_line(adapted, tmp_path, key, value, want):
    # once "could not convert string to float: '16'", a silent NaN scale, or r = true read as 1
    folder = tmp_path / "peft"
    shutil.copytree(adapted["peft"], folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg[key] = value
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match=re.escape(f"adapter_config.json: {want}")):
        load_adapter(Llama(adapted["ck"]), folder, adapted["tok"])
