"""Llama 3.x RoPE scaling (rope_type llama3): the divisors vkdsl derives from a config.json equal
the reference's own rule (golden/llama_ref.py, written from the published definition); a tiny
model carrying it in both formats -- rope_scaling in config.json, llama.cpp's rope_freqs.weight
tensor in the GGUF -- loads to the same config and runs as the float64 reference with those
frequencies (and measurably unlike plain RoPE, so the test can fail); other RoPE types are
refused by name. Tolerance as tests/test_model_forward.py: 1e-3 of the logits' scale."""
import dataclasses
import json

import numpy as np
import pytest

import vkdsl
from vkdsl_golden import llama_ref
from fixtures import synthetic
from vkdsl.models import ModelFileError, load_checkpoint
from vkdsl.models.config import llama3_divisors
from vkdsl.models.llama import Llama

# factor 8, wavelengths over 16 positions divided, under 4 kept: every tiny frequency but the
# fastest is divided, the fastest (wavelength 6.3) interpolated
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}
IDS = [5, 17, 200, 33, 9, 1, 2, 250, 44, 45, 46, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synthetic.build_tiny(tmp_path_factory.mktemp("tiny-llama3"), rope_scaling=SCALING)


def test_divisors_follow_the_published_rule():
    for hd, base, old in ((16, 10000.0, 16), (64, 500000.0, 8192), (128, 500000.0, 8192)):
        inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        ref = inv / llama_ref.llama3_inv_freq(hd, base, 32.0, 1.0, 4.0, old)
        ours = np.array(llama3_divisors(hd, base, 32.0, 1.0, 4.0, old))
        assert np.allclose(ours, ref, rtol=1e-6), hd
    # Llama 3.2's settings: the fast frequencies keep their value, the slow ones are divided by 32
    d = llama3_divisors(64, 500000.0, 32.0, 1.0, 4.0, 8192)
    assert d[0] == 1.0 and d[-1] == 32.0 and any(1.0 < x < 32.0 for x in d)


def test_both_formats_load_the_same_scaling(tiny):
    a, b = load_checkpoint(tiny.gguf_path).config, load_checkpoint(tiny.hf_dir).config
    assert a.rope_freq_divisors is not None and len(a.rope_freq_divisors) == tiny.cfg["head_dim"] // 2
    assert np.allclose(a.rope_freq_divisors, b.rope_freq_divisors, rtol=1e-6)
    assert "rope_freqs.weight" not in load_checkpoint(tiny.gguf_path).tensors     # read into the config


@pytest.mark.parametrize("which", ["gguf", "hf"])
def test_a_scaled_model_runs_as_the_reference(tiny, which):
    ck = load_checkpoint(tiny.gguf_path if which == "gguf" else tiny.hf_dir)
    lg = vkdsl.trace(lambda x: Llama(ck).forward(x))(np.asarray([IDS], np.int32))[0]
    ref = llama_ref.forward(ck.dequantized(), dict(ck.config.to_dict(), inv_freq=tiny.cfg["inv_freq"]), IDS)
    plain = llama_ref.forward(ck.dequantized(), ck.config.to_dict(), IDS)
    assert np.abs(lg - ref).max() <= 1e-3 * np.abs(ref).max()
    assert np.abs(plain - ref).max() > 30 * np.abs(lg - ref).max()       # the scaling is seen


def test_other_rope_types_are_refused_by_name(tmp_path, tiny):
    import shutil
    for scaling, field in (({"rope_type": "yarn", "factor": 4.0}, "'yarn'"),
                           ({"rope_type": "llama3", "factor": 8.0}, "lacks"),
                           (dict(SCALING, beta_fast=32), "beta_fast")):
        d = tmp_path / field.strip("'")
        shutil.copytree(tiny.hf_dir, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg["rope_scaling"] = scaling
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelFileError, match=field):
            load_checkpoint(d)


def _with_config(tmp_path, tiny, name, **changes):
    import shutil
    d = tmp_path / name
    shutil.copytree(tiny.hf_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_mistral_without_a_sliding_window_is_llama(tmp_path, tiny):
    base = load_checkpoint(tiny.hf_dir).config
    ctx = base.context_length
    for window in (None, ctx):                  # no window, or one as long as the context
        d = _with_config(tmp_path, tiny, f"mistral-{window}", model_type="mistral",
                         architectures=["MistralForCausalLM"], sliding_window=window)
        got = load_checkpoint(d).config
        assert got.arch == "mistral" and dataclasses.replace(got, arch="llama") == base
    d = _with_config(tmp_path, tiny, "mistral-window", model_type="mistral", sliding_window=ctx // 4)
    with pytest.raises(ModelFileError, match=rf"sliding_window = {ctx // 4} .*not supported"):
        load_checkpoint(d)
    d = _with_config(tmp_path, tiny, "gemma2", model_type="gemma2")
    with pytest.raises(ModelFileError, match="model_type is 'gemma2'"):
        load_checkpoint(d)


def test_cached_generation_steps_use_the_scaled_frequencies(tiny):
    """The KV-cache step has its own RoPE tables: they must carry the scaling too."""
    from vkdsl.models.generate import Generator
    ck = load_checkpoint(tiny.gguf_path)
    gen = Generator(Llama(ck), 32)
    ref = llama_ref.forward(ck.dequantized(), dict(ck.config.to_dict(), inv_freq=tiny.cfg["inv_freq"]), IDS)
    gen.logits_prefill(IDS[:8])
    for pos in range(8, len(IDS)):
        step = gen.logits_step(IDS[pos], pos)
        assert np.abs(step - ref[pos]).max() <= 1e-3 * np.abs(ref).max(), pos
