"""The device forward pass of real file formats against the float64 numpy reference
(golden/llama_ref.py): tiny random models the test writes (GGUF with packed Q4_0/Q4_1/Q8_0 and
F16 tensors, and a Hugging Face safetensors folder), the KV-cache path, and SmolLM2 itself.

Tolerance: fp32 on the device vs float64; logits of a few-layer model agree to ~1e-5 of their
scale, so we require max |diff| <= 1e-3 * max |ref| and the same argmax at every position."""
import json
import subprocess
import sys

import numpy as np
import pytest

import vkdsl
from vkdsl_golden import llama_ref
from vkdsl.models import load_checkpoint, load_model_files
from vkdsl.models.default import default_model_path
from vkdsl.models.generate import Generator
from vkdsl.models.llama import Llama


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model


def device_logits(model, ids):
    return vkdsl.trace(lambda x: model.forward(x))(np.asarray(ids, np.int32))


def close(lg, ref):
    assert np.abs(lg - ref).max() <= 1e-3 * np.abs(ref).max()
    assert (lg.argmax(-1) == ref.argmax(-1)).all()


IDS = [5, 17, 200, 33, 9, 1, 2, 250, 44, 45, 46]


def test_gguf_forward_matches_reference_with_packed_weights(tiny):
    ck = load_checkpoint(tiny.gguf_path)
    model = Llama(ck)
    packed = [n for n, w in model.linear.items() if hasattr(w, "fmt")]
    assert packed, "quantized tensors must stay packed on the device"
    ref = llama_ref.forward(ck.dequantized(), ck.config.to_dict(), IDS)
    close(device_logits(model, [IDS])[0], ref)


def test_gguf_and_safetensors_loaders_give_the_same_logits(tiny):
    lg_gguf = device_logits(Llama(load_checkpoint(tiny.gguf_path)), [IDS])[0]
    lg_hf = device_logits(Llama(load_checkpoint(tiny.hf_dir)), [IDS])[0]
    # same snapped weights; the GGUF side reads packed blocks, the HF side fp32: rounding only
    assert np.abs(lg_gguf - lg_hf).max() <= 1e-4 * np.abs(lg_hf).max()
    assert (lg_gguf.argmax(-1) == lg_hf.argmax(-1)).all()


@pytest.mark.parametrize("mode", ["int4", "nf4"])
def test_quantize_on_load(tiny, mode):
    ck = load_checkpoint(tiny.hf_dir)
    model = Llama(ck, quant=mode)
    mem = model.device_bytes()
    assert mem["device_bytes"] < 0.4 * mem["fp32_bytes"]
    # reference: the float64 forward on the same quantization, dequantized on the host by numpy
    from vkdsl.ops import quant
    w = ck.dequantized()
    for name, a in w.items():
        if a.ndim == 2 and a.shape[1] % 64 == 0:
            q = quant.quantize_int4(a) if mode == "int4" else quant.quantize_nf4(a)
            w[name] = quant.dequantize(q)
    close(device_logits(model, [IDS])[0], llama_ref.forward(w, ck.config.to_dict(), IDS))


def test_batched_forward_rows_are_independent(tiny):
    model = Llama(load_checkpoint(tiny.gguf_path))
    a, b = IDS[:8], IDS[3:11]
    both = device_logits(model, [a, b])
    close(both[0], device_logits(model, [a])[0])
    close(both[1], device_logits(model, [b])[0])


def test_kv_cache_steps_match_full_forward(tiny):
    ck = load_checkpoint(tiny.gguf_path)
    model = Llama(ck)
    gen = Generator(model, 20)
    prompt = IDS[:4]
    first = gen.logits_prefill(prompt)
    close(first, llama_ref.forward(ck.dequantized(), ck.config.to_dict(), prompt))
    seq = list(prompt)
    for nxt in [7, 100, 3]:
        step = gen.logits_step(nxt, len(seq))
        seq.append(nxt)
        close(step[None], llama_ref.forward(ck.dequantized(), ck.config.to_dict(), seq)[-1:])


def test_prompt_longer_than_context_is_refused(tiny):
    model = Llama(load_checkpoint(tiny.gguf_path))
    with pytest.raises(ValueError, match="exceed the model's context"):
        Generator(model, model.cfg.context_length + 1)


def test_smollm2_greedy_paris_and_memory():
    ck, tok = load_model_files(default_model_path())
    model = Llama(ck)
    mem = model.device_bytes()
    assert mem["device_bytes"] < 0.2 * mem["fp32_bytes"]          # Q4_1 / Q8_0 stay packed
    ids = tok.encode("The capital of France is")
    out, _ = Generator(model, len(ids) + 3).generate(ids, 3)
    assert tok.decode(out).startswith(" Paris.")


def test_logits_and_tokenize_commands(tmp_path):
    path = default_model_path()
    ids = json.loads(subprocess.run([sys.executable, "-m", "vkdsl.cli", "tokenize", "Hello world 123"],
                                    capture_output=True, text=True, check=True).stdout)
    _, tok = load_model_files(path)
    assert ids == tok.encode("Hello world 123") and len(ids) == 6
    out = tmp_path / "l.npy"
    subprocess.run([sys.executable, "-m", "vkdsl.cli", "logits", "--prompt", "Hello world 123", "--out", str(out)],
                   capture_output=True, text=True, check=True)
    lg = np.load(out)
    assert lg.shape == (6, 49152) and lg.dtype == np.float32 and np.isfinite(lg).all()


def test_rows_decoded_together_match_the_reference_row_by_row(tiny):
    # three prompts of different lengths in one prefill and one step per token: each row's logits
    # against the float64 reference's forward over that row's own sequence
    ck = load_checkpoint(tiny.gguf_path)
    model = Llama(ck)
    prompts = [IDS[:4], IDS[:7], IDS[:2]]
    gen = Generator(model, 20, batch=3)
    ref = lambda seq: llama_ref.forward(ck.dequantized(), ck.config.to_dict(), seq)[-1]  # noqa: E731
    first = gen.logits_prefill_rows(prompts)
    for b, p in enumerate(prompts):
        close(first[b][None], ref(p)[None])
    seqs = [list(p) for p in prompts]
    for nxt in ([7, 100, 3], [5, 5, 250]):
        step = gen.logits_step_rows(nxt, [len(s) for s in seqs])
        for b, t in enumerate(nxt):
            seqs[b].append(t)
            close(step[b][None], ref(seqs[b])[None])


def test_generate_many_gives_each_row_what_generating_it_alone_gives(tiny):
    model = Llama(load_checkpoint(tiny.gguf_path))
    prompts = [IDS[:4], IDS[:7], IDS[:2]]
    alone = [Generator(model, 20).generate(p, 6)[0] for p in prompts]
    stop = {alone[1][2]}                  # row 1 stops early, at its third token; the rest go on
    together = Generator(model, 20, batch=3).generate_many(prompts, 6, stop=stop)
    want = [a[:next((i + 1 for i, t in enumerate(a) if t in stop), len(a))] for a in alone]
    assert together == want and len(together[1]) <= 3
    # fewer prompts than the batch (the last group of many): the spare row decodes unreturned
    assert Generator(model, 20, batch=3).generate_many(prompts[:2], 6) == alone[:2]
    with pytest.raises(ValueError, match="4 prompts for a Generator of batch 3"):
        Generator(model, 20, batch=3).generate_many(prompts + prompts[:1], 4)
