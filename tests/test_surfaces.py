"""The failure surfaces every run reports: calibration against the definition computed here, the
format surface (decided from teacher-forced greedy flags) against real greedy generation with the
KV cache, in both scoring modes, slices and the fp32 stability check, and their gates."""
import math

import numpy as np
import pytest

from fixtures.train_data import TRAIN, tiny_cfg, tiny_setup, write_jsonl
from vkdsl.models.generate import Generator
from vkdsl.train import evidence
from vkdsl.train.trainer import run


@pytest.fixture(scope="module", params=["candidates", "single-token", "single-token, label then more"])
def fitted(request, tmp_path_factory):
    """A tiny model trained until it reproduces most of its rows, evaluated on those rows. Its
    labels are several tokens each (candidate scoring) or one token each ('a', 'b', 'c' are single
    tokens of the tiny vocabulary: single-token scoring). 'label then more' trains on 'a x' but is
    evaluated on 'a': the greedy output starts with the right label and goes on (not the format)."""
    tmp = tmp_path_factory.mktemp("surfaces")
    setup = tiny_setup(tmp)
    tm, tr, he, pr = setup
    kw = {}
    held = tr
    if request.param.startswith("single-token"):
        short = {"high": "a", "medium": "b", "low": "c"}
        more = " x" if "more" in request.param else ""
        held = write_jsonl(tmp / "abc.jsonl", [{"prompt": p, "completion": short[c], "category": k} for p, c, k in TRAIN])
        tr = write_jsonl(tmp / ("abc_more.jsonl" if more else "abc_train.jsonl"),
                         [{"prompt": p, "completion": short[c] + more, "category": k} for p, c, k in TRAIN])
        kw = dict(train_file=tr, labels=["a", "b", "c"])
    cfg = tiny_cfg(setup, heldout_file=held, steps=40, lr=2e-2, out=str(tmp / "run"), rank=8, alpha=16.0, **kw)
    r = run(cfg, tmp / "run")
    assert (r.held.extra is not None) == request.param.startswith("single-token")
    return r


def test_calibration_matches_definition():
    rng = np.random.default_rng(0)
    lp = rng.standard_normal((200, 3)) * 3
    truth = rng.integers(0, 3, 200)
    got = evidence.calibration(lp, truth)
    p = np.exp(lp - lp.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ece = 0.0
    for lo in np.arange(10) / 10:
        rows = [i for i in range(200) if lo <= p[i].max() < lo + 0.1 or (lo == 0.9 and p[i].max() == 1.0)]
        if rows:
            acc = np.mean([p[i].argmax() == truth[i] for i in rows])
            conf = np.mean([p[i].max() for i in rows])
            ece += len(rows) / 200 * abs(acc - conf)
    assert math.isclose(got["ece"], ece, rel_tol=1e-12)
    assert sum(b["n"] for b in got["bins"]) == 200


def test_spectrum_matches_dense_svd():
    """The update's singular values from the r x r core equal a dense float64 SVD of s * A @ B."""
    from types import SimpleNamespace as NS
    rng = np.random.default_rng(1)
    arr = lambda a: NS(numpy=lambda: a.astype(np.float32))  # noqa: E731
    shapes = {"wide": (48, 160, 8), "tall": (200, 24, 4), "rank-deficient": (64, 64, 6)}
    lora = {}
    for n, (i, o, r) in shapes.items():
        A, B = rng.standard_normal((i, r)), rng.standard_normal((r, o))
        if n == "rank-deficient":
            B[3:] = 0.0
        lora[n] = NS(A=arr(A), B=arr(B), scale=-1.7)
    got = evidence.spectrum(NS(lora=lora), list(shapes), top=10)
    for n, lo in lora.items():
        d = lo.scale * (lo.A.numpy().astype(np.float64) @ lo.B.numpy().astype(np.float64))
        sv = np.linalg.svd(d, compute_uv=False)
        np.testing.assert_allclose(got[n]["sv"], sv[:10], rtol=1e-9, atol=1e-9 * sv[0])
        assert math.isclose(got[n]["stable_rank"], (sv ** 2).sum() / sv[0] ** 2, rel_tol=1e-9)
        assert math.isclose(got[n]["fro"], np.linalg.norm(d), rel_tol=1e-9)


def greedy_is_label(r, ex, adapters_on):
    """Real greedy decoding with the KV cache: does it emit exactly one label's tokens then EOS?"""
    if not adapters_on:
        saved = r.model.lora
        r.model.lora = {}
        try:
            return greedy_is_label(r, ex, True)
        finally:
            r.model.lora = saved
    p0 = next(t for t, x in enumerate(ex.labels) if x != -100)
    prompt = ex.ids[:p0 + 1]
    longest = max(len(r.tok.encode(lab, add_special=False)) for lab in r.cfg.labels) + 1
    ctx = r.model.cfg.context_length
    new, _ = Generator(r.model, min(ctx, len(prompt) + longest)).generate(
        prompt, min(longest, ctx - len(prompt)), stop={r.tok.eos_id})
    return any(new == r.tok.encode(lab, add_special=False) + [r.tok.eos_id] for lab in r.cfg.labels)


def test_format_equals_greedy_generation(fitted):
    r = fitted
    held = r.held
    got = {on: held.scores(on).format for on in (True, False)}
    for on in (True, False):
        assert got[on] == [greedy_is_label(r, r.heldout[i], on) for i in range(len(r.heldout))], f"adapters_on={on}"
    if "more" in r.cfg.train_file:                      # right first token, then more than end-of-turn
        assert not any(got[True]) and r.final.heldout_acc > 0.5
    else:
        assert any(got[True]) and not all(got[False])   # the fitted adapter answers with labels, the base not


def test_final_evidence_carries_every_surface(fitted):
    f = fitted.final
    assert 0 <= f.calibration["ece"] <= 1 and len(f.calibration["bins"]) == 10
    assert f.format_n == len(fitted.heldout)
    assert len(f.format_failures) == min(3, round((1 - f.format_valid) * f.format_n))
    # per-category accuracy recomputed from the decisions and the rows' own labels
    labels = [x.strip() for x in fitted.cfg.labels]
    rows = list(fitted.heldout)
    hits = {}
    for row, d in zip(rows, f.decisions):
        hits.setdefault(row.category or "-", []).append(labels[d] == row.completion.strip())
    for c, h in hits.items():
        assert f.slices["categories"][c]["accuracy"] == pytest.approx(np.mean(h)), c
    assert np.mean(hits[f.slices["worst"]]) == min(np.mean(h) for h in hits.values())
    assert f.stability_fp32["agreement"] == 1.0            # Q4_1/Q8_0/F16 vs fp32 on the fit rows
    assert f.stability_checkpoint["step"] == "base"
    names = [g.gate for g in evidence.gates(f, fitted.first_loss, fitted.cfg)]
    assert {"calibration", "format", "worst slice", "stability (fp32 base)"} <= set(names)


@pytest.mark.parametrize("after, passes", [(0.750, False), (0.78125, True), (0.844, True), (0.90625, True)])
def test_dpo_task_gate_allows_two_of_32_rows(after, passes):
    # 27/32 after SFT; the default tolerance is 0.0625 (two rows of 32): 25/32 passes, 24/32 fails
    from vkdsl.train.config import TrainConfig
    g = evidence.task_cost_gate(27 / 32, after, TrainConfig())
    assert g.gate == "DPO did not cost the task" and g.passed is passes and f"{after:.3f} after DPO" in g.detail
