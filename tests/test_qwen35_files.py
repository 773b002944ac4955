"""Qwen3.5 files made by the tools users have them from (tests/fixtures/qwen35/, written by
tests/fixtures/make_qwen35_files.py): the Hugging Face folder transformers saved (bf16), the GGUF
llama.cpp's converter made of it (f16, value heads in its tiled order), and transformers' own
logits of 84 token ids. Both load in vkdsl with those logits (max |diff| <= 1e-4 of the largest,
every argmax equal), and adapters cross between the two orders of the value heads: an adapter
saved from either model, as PEFT or as GGUF LoRA, gives the same logits on the other."""
import numpy as np
import pytest

import vkdsl
from vkdsl.models import ModelFileError, load_checkpoint, load_tokenizer
from vkdsl.models.adapters import load_adapter, save_gguf_adapter, save_peft
from vkdsl.models.build import build_model
from vkdsl.models.llama import LogitsFn
from vkdsl.models.merge import compare_logits, merge
from vkdsl.ops.lora import LoRA

from pathlib import Path

FILES = Path(__file__).parent / "fixtures" / "qwen35"
HF, GGUF = FILES / "hf", FILES / "qwen35-f16.gguf"
REF = np.load(FILES / "transformers_logits.npz")
IDS, WANT = REF["ids"], REF["logits"].astype(np.float64)


def rel(got, want):
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("path,quant", [(HF, "keep"), (GGUF, "keep"), (GGUF, "none")])
def test_transformers_logits(path, quant):
    model = build_model(load_checkpoint(path), quant=quant)
    assert model.cfg.v_tiled == (path == GGUF)        # the converter tiles the value heads
    got = LogitsFn(model)(IDS[None])[0]
    assert rel(got, WANT) <= 1e-4
    assert (got.argmax(-1) == WANT.argmax(-1)).all()


@pytest.fixture(scope="module")
def models():
    return {"hf": build_model(load_checkpoint(HF)), "gguf": build_model(load_checkpoint(GGUF))}


def adapt(model, seed=0):
    """Random adapters on every module whose value-head order differs between the files."""
    rng = np.random.default_rng(seed)
    table = {}
    for j, n in enumerate(["blk.0.attn_qkv", "blk.1.attn_gate", "blk.1.ssm_beta", "blk.2.ssm_alpha",
                           "blk.2.ssm_out", "blk.3.attn_q"]):
        d_out, d_in = model.linear[n].shape
        table[n] = LoRA.init(d_in, d_out, 2, 4.0, seed=j, name=n)
        table[n].A.assign(vkdsl.tensor(rng.standard_normal((d_in, 2)).astype(np.float32) * 0.3))
        table[n].B.assign(vkdsl.tensor(rng.standard_normal((2, d_out)).astype(np.float32) * 0.3))
    model.lora = table


@pytest.mark.parametrize("src,fmt", [("gguf", "peft"), ("gguf", "gguf"), ("hf", "peft"), ("hf", "gguf")])
def test_adapters_cross_between_the_two_orders(models, tmp_path, src, fmt):
    dst = "hf" if src == "gguf" else "gguf"
    adapt(models[src])
    want = LogitsFn(models[src])(IDS[None])
    path = tmp_path / ("adapter" if fmt == "peft" else "adapter.gguf")
    (save_peft if fmt == "peft" else save_gguf_adapter)(models[src], path, r=2, alpha=4.0)
    models[src].lora = {}
    load_adapter(models[dst], path, load_tokenizer(HF))
    got = LogitsFn(models[dst])(IDS[None])
    models[dst].lora = {}
    assert rel(got, want) <= 1e-4
    assert rel(want, LogitsFn(models[src])(IDS[None])) > 1e-2          # the adapter is no no-op


def test_gguf_lora_is_in_the_files_order(models, tmp_path):
    """An adapter trained on the HF model, merged into the GGUF base as llama.cpp would apply it
    (the GGUF LoRA's own tensors added to the file's tensors): the merged file's logits equal the
    separate path's on the GGUF model."""
    adapt(models["hf"], seed=1)
    save_gguf_adapter(models["hf"], tmp_path / "a.gguf", r=2, alpha=4.0)
    models["hf"].lora = {}
    merge(GGUF, tmp_path / "a.gguf", tmp_path / "merged.gguf", out_type="f32")
    c = compare_logits(GGUF, tmp_path / "a.gguf", tmp_path / "merged.gguf", IDS[None, :40])
    assert c["rel_diff"] <= 1e-4 and c["argmax_agreement"] == 1.0, c


def _rewrite(dst, fields=lambda name, value: value, tensors=lambda name, data: data, extra=(), keys=()):
    """A copy of the fixture GGUF with metadata values or tensors changed, tensors and uint32 keys added."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    reader = GGUFReader(GGUF)
    w = GGUFWriter(dst, "qwen35")
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = GGUFValueType(int(f.types[0]))
        sub = GGUFValueType(int(f.types[-1])) if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        w.add_key_value(name, fields(name, f.contents()), vtype, sub_type=sub)
    for name, value in keys:
        w.add_uint32(name, value)
    for t in reader.tensors:
        data = tensors(t.name, None)
        if data is None:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        else:
            w.add_tensor(t.name, data)
    for name, data in extra:
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_misshapen_deltanet_tensor_is_named(tmp_path):
    path = _rewrite(tmp_path / "bad.gguf", tensors=lambda name, data: np.zeros((128, 3), np.float32)
                    if name == "blk.1.ssm_conv1d.weight" else None)       # a kernel of 3 where the keys say 4
    with pytest.raises(ModelFileError, match=r"'blk.1.ssm_conv1d.weight' has shape \(128, 3\), the config implies "
                                             r"\(128, 4\)"):
        load_checkpoint(path)


def test_multi_token_prediction_blocks_are_read_past(tmp_path):
    """A GGUF converted with its MTP layer (block_count + 1, nextn_predict_layers = 1, the extra
    block's tensors) loads as the model without it: the same logits."""
    def fields(name, value):
        if name == "qwen35.block_count":
            return value + 1
        return value + [False] if name == "qwen35.attention.recurrent_layers" else value
    path = _rewrite(tmp_path / "mtp.gguf", fields, keys=[("qwen35.nextn_predict_layers", 1)],
                    extra=[("blk.4.nextn.eh_proj.weight", np.ones((64, 128), np.float32)),
                           ("blk.4.attn_norm.weight", np.ones(64, np.float32))])
    model = build_model(load_checkpoint(path))
    assert model.cfg.n_layers == 4
    assert rel(LogitsFn(model)(IDS[None])[0], WANT) <= 1e-4
