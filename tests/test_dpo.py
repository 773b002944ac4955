"""DPO on a tiny model the test builds: ln 2 at the start, sequence log-probs over response
tokens only (checked against the float64 numpy reference forward), the margin grows, the
reference cache never uses stale inputs (it rebuilds), identical pairs are counted."""
import dataclasses
import json
import math

import numpy as np
import pytest

from vkdsl_golden import llama_ref
from fixtures import synthetic
from vkdsl.models import load_model_files
from vkdsl.models.llama import Llama
from vkdsl.ops.lora import LoRA
from vkdsl.train import dpo
from vkdsl.train.config import TrainConfig
from vkdsl.train.data import DataError

CFG = TrainConfig(bucket=16, max_len=48, dpo_batch=4, eval_batch=4, dpo_beta=0.5, dpo_lr=5e-3, dpo_steps=12,
                  dpo_nll_weight=0.0, clip=1.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, data_seed=0,
                  min_lr_ratio=0.0)
HASHES = {"base": "b", "tokenizer": "t", "template": "c"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo")
    tm = synthetic.build_tiny(d)
    ck, tok = load_model_files(tm.gguf_path)
    rows = [{"prompt": f"the dog {i} is", "chosen": " the fox", "rejected": " a capital"} for i in range(8)]
    rows.append({"prompt": "same", "chosen": " dog", "rejected": " dog"})
    path = d / "prefs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return ck, tok, path, d


def fresh_model(ck):
    m = Llama(ck)
    c = m.cfg
    for i in range(c.n_layers):
        for mod, out in (("attn_q", c.n_heads * c.head_dim), ("attn_v", c.n_kv_heads * c.head_dim)):
            m.lora[f"blk.{i}.{mod}"] = LoRA.init(c.dim, out, 4, 8.0, seed=i, name=mod)
    return m, [p for lo in m.lora.values() for p in lo.params()]


def test_dpo_starts_at_ln2_and_grows_the_margin(setup, tmp_path):
    ck, tok, path, _ = setup
    pairs, same = dpo.load_pairs(path, tok, False, 48, "left")
    assert same == 1 and len(pairs) == 8
    model, params = fresh_model(ck)
    said = []
    hist, ev = dpo.train_dpo(model, params, CFG, 0, pairs, [], tmp_path, said.append, lambda *a, **k: None, "base",
                             HASHES)
    assert abs(hist[0]["dpo_loss"] - math.log(2)) < 1e-5        # policy == reference (B = 0)
    assert any("ln 2" in s for s in said)
    assert hist[-1]["dpo_loss"] < hist[0]["dpo_loss"]
    tr = ev.train
    assert tr.margin_improvement > 0 and tr.improvement_accuracy == 1.0
    # the drifts against the float64 reference forward: the base (the reference: adapter off) and
    # the base with the trained adapter merged in (W + s (A B)^T in GGUF order)
    w0 = ck.dequantized()
    w1 = dict(w0)
    for name, lo in model.lora.items():
        W = w0[f"{name}.weight"]
        delta = lo.scale * (lo.A.numpy().astype(np.float64) @ lo.B.numpy().astype(np.float64)).T
        assert delta.shape == W.shape
        w1[f"{name}.weight"] = W + delta
    cfgd = ck.config.to_dict()
    drift = {side: np.mean([seq_logprob(w1, cfgd, getattr(p, side)) - seq_logprob(w0, cfgd, getattr(p, side))
                            for p in pairs]) for side in ("chosen", "rejected")}
    assert tr.chosen_drift == pytest.approx(drift["chosen"], abs=2e-3)
    assert tr.rejected_drift == pytest.approx(drift["rejected"], abs=2e-3)
    assert tr.margin_improvement == pytest.approx(drift["chosen"] - drift["rejected"], abs=4e-3)
    story = dpo.margin_story(tr)
    if drift["chosen"] < 0:
        assert "only because rejected responses fell further" in story
    else:
        assert "% of the margin came from" in story


def seq_logprob(w, cfgd, ex):
    """Sum of the reference forward's log-probs over the response labels (float64)."""
    lp = llama_ref.forward(w, cfgd, np.array(ex.ids))
    lp = lp - lp.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    lab = np.array(ex.labels)
    return float(sum(lp[t, lab[t]] for t in range(len(lab)) if lab[t] != -100))


def test_sequence_logprob_is_the_response_sum_of_the_reference_forward(setup):
    ck, tok, path, _ = setup
    pairs, _ = dpo.load_pairs(path, tok, False, 48, "left")
    model, params = fresh_model(ck)
    step = dpo.build_dpo_step(model, params, 1.0, 0.0)
    batch = pairs[:4]
    ic, pc, lc, sc = dpo._pack([p.chosen for p in batch], 0, 16, 48)
    ir, pr, lr, sr = dpo._pack([p.rejected for p in batch], 0, 16, 48)
    out = step(ic, pc, lc, sc, ir, pr, lr, sr, np.zeros(4, np.float32), np.ones(1, np.float32))
    w, cfgd = ck.dequantized(), ck.config.to_dict()
    for k, p in enumerate(batch):
        want = seq_logprob(w, cfgd, p.chosen)
        assert abs(out[1][k] - want) < 1e-3 * max(1.0, abs(want))


def test_stale_reference_cache_is_never_used(setup, tmp_path):
    # a cache written for other inputs (here: absurd log-probs under another key) is refused and
    # rebuilt: the first DPO loss is ln 2 (policy == reference), which the stale values would break
    ck, tok, path, _ = setup
    pairs, _ = dpo.load_pairs(path, tok, False, 48, "left")
    model, params = fresh_model(ck)
    cache = tmp_path / "dpo_reference.json"
    cache.write_text(json.dumps({"key": "stale", "chosen": [100.0] * len(pairs), "rejected": [-100.0] * len(pairs)}))
    said = []
    hist, _ = dpo.train_dpo(model, params, dataclasses.replace(CFG, dpo_steps=1), 0, pairs, [], tmp_path,
                            said.append, lambda *a, **k: None, "base", HASHES)
    assert any("computed for other inputs" in s and "recomputed" in s for s in said)
    assert hist[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert json.loads(cache.read_text())["key"] != "stale"


def test_bad_pairs(setup, tmp_path):
    _, tok, _, _ = setup
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"prompt": "x", "chosen": "", "rejected": "y"}) + "\n")
    with pytest.raises(DataError, match="bad.jsonl:1: field 'chosen'"):
        dpo.load_pairs(p, tok, False, 48, "left")


def test_with_nll_on_chosen_the_preference_term_still_starts_at_ln2(setup, tmp_path):
    # the loss is the preference term + w * NLL(chosen); at step 1 (policy == reference) the
    # preference term is ln 2 and the NLL is the chosen tokens' mean negative log-prob (float64 reference)
    ck, tok, path, _ = setup
    pairs, _ = dpo.load_pairs(path, tok, False, 48, "left")
    model, params = fresh_model(ck)
    said = []
    cfg = dataclasses.replace(CFG, dpo_steps=1, dpo_nll_weight=1.0, dpo_batch=len(pairs))
    hist, _ = dpo.train_dpo(model, params, cfg, 0, pairs, [], tmp_path, said.append, lambda *a, **k: None, "base",
                            HASHES)
    cfgd = ck.config.to_dict()
    n_c = sum(sum(t != -100 for t in p.chosen.labels) for p in pairs)
    want = -sum(seq_logprob(ck.dequantized(), cfgd, p.chosen) for p in pairs) / n_c
    assert hist[0]["nll"] == pytest.approx(want, rel=1e-4)
    assert hist[0]["dpo_loss"] == pytest.approx(math.log(2) + want, rel=1e-4)
    line = next(s for s in said if "preference loss" in s)
    assert abs(float(line.split("difference ")[1].split(")")[0])) < 1e-5
