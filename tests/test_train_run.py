"""Whole runs on a tiny model: resume equals an uninterrupted run, a NaN loss stops with the
step named and the last good checkpoint kept, preflight errors, base/tokenizer identity."""
import json

import numpy as np
import pytest

from fixtures.train_data import tiny_cfg, tiny_prefs, tiny_setup
from vkdsl.train import checkpoint
from vkdsl.cli.train import main
from vkdsl.train.trainer import Run, TrainingStopped, run
from vkdsl.train.progress import Reporter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("tiny_run"))


def adapter(r):
    return [p.numpy() for p in r.params]


def test_resume_matches_uninterrupted(setup, tmp_path):
    cfg = tiny_cfg(setup, steps=5, checkpoint_every=2, tmkl=0.1, batch_size=2, grad_accum=2)
    full = run(cfg, tmp_path / "full", evidence_at_end=False)
    part = run(cfg, tmp_path / "part", stop_after=3, evidence_at_end=False)     # "killed" after step 3
    assert checkpoint.load(tmp_path / "part")[0]["step"] == 2
    resumed = run(cfg, tmp_path / "part", resume=tmp_path / "part", evidence_at_end=False)
    assert resumed.step == full.step == 5
    for a, b in zip(adapter(full), adapter(resumed)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(adapter(full)[1], np.zeros_like(adapter(full)[1]))
    assert part.step == 3


def test_checkpointed_layers_train_the_same_adapter_through_sft_and_dpo(setup, tmp_path):
    # --checkpoint layers reaches both objectives' traced steps; the adapter after SFT (TMKL on) and
    # DPO equals the one trained keeping every activation, to float rounding
    from vkdsl.train.stages import dpo_stage
    prefs = tiny_prefs(tmp_path / "prefs.jsonl")
    out = {}
    for c in ("none", "layers"):
        cfg = tiny_cfg(setup, steps=3, tmkl=0.1, objective="sft+dpo", dpo_train_file=prefs, dpo_heldout_file="",
                       dpo_steps=2, dpo_batch=2, dpo_lr=5e-3, checkpoint=c)
        r = run(cfg, tmp_path / c, evidence_at_end=False)
        dpo_stage(r)
        out[c] = adapter(r)
    for a, b in zip(out["none"], out["layers"]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(out["none"][1], np.zeros_like(out["none"][1]))


def test_a_kill_during_dpo_resumes_from_its_own_last_step_bit_identically(setup, tmp_path):
    from vkdsl.train import loop
    from vkdsl.train.stages import dpo_stage
    prefs = tiny_prefs(tmp_path / "prefs.jsonl")
    cfg = tiny_cfg(setup, steps=3, checkpoint_every=2, objective="sft+dpo", dpo_train_file=prefs,
                   dpo_heldout_file=prefs, dpo_steps=5, dpo_batch=2, dpo_lr=5e-3)

    def whole(d, resume=None, stop_after=None):
        r = run(cfg, d, resume=resume)
        ev = dpo_stage(r, stop_after=stop_after)
        return r, ev
    full, full_ev = whole(tmp_path / "full")
    with pytest.raises(loop.Interrupted):
        whole(tmp_path / "part", stop_after=3)                   # "killed" after DPO step 3
    assert checkpoint.load(tmp_path / "part", checkpoint.DPO)[0]["step"] == 2
    resumed, resumed_ev = whole(tmp_path / "part", resume=tmp_path / "part")
    log = (tmp_path / "part" / "train.log").read_text()
    assert "resumed DPO from" in log and "at DPO step 2" in log
    assert "SFT evidence at step 3 as the DPO checkpoint recorded it" in log
    for a, b in zip(adapter(full), adapter(resumed)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(adapter(full)[1], np.load(tmp_path / "full" / "adapter.npz")[f"{full.names[0]}.lora_B"])
    assert resumed_ev.heldout == full_ev.heldout
    assert [(g.gate, g.passed) for g in resumed.gates] == [(g.gate, g.passed) for g in full.gates]
    # the resumed records: every DPO step once, the ones after the checkpoint recomputed
    steps = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    dpo_steps = [e["step"] - cfg.steps for e in steps if e.get("event") == "dpo_step"]
    assert dpo_steps == [1, 2, 3, 4, 5]
    full_losses = [e["dpo_loss"] for e in map(json.loads, (tmp_path / "full" / "metrics.jsonl").read_text().splitlines())
                   if e.get("event") == "dpo_step"]
    assert [e["dpo_loss"] for e in steps if e.get("event") == "dpo_step"] == full_losses


def test_nan_loss_stops_and_keeps_checkpoint(setup, tmp_path):
    cfg = tiny_cfg(setup, steps=6, checkpoint_every=1, lr=1e38, warmup=0, clip=0.0)
    with pytest.raises(TrainingStopped, match=r"sft step (\d+): non-finite loss .*before applying it") as e:
        run(cfg, tmp_path / "nan", evidence_at_end=False)
    bad = int(str(e.value).split("sft step ")[1].split(":")[0])
    meta = checkpoint.load(tmp_path / "nan")[0]
    assert meta["step"] == bad - 1 >= 1
    _, params, _ = checkpoint.load(tmp_path / "nan")
    assert all(np.isfinite(p).all() for p in params)


def test_preflight_zero_lr_and_dead_adapter(setup, tmp_path):
    cfg = tiny_cfg(setup, min_lr_ratio=0.0)
    with pytest.raises(ValueError, match="lr 0.0 at 100%"):
        run(cfg, tmp_path / "z", evidence_at_end=False)
    r = Run(tiny_cfg(setup), tmp_path / "d", Reporter(None, quiet=True))
    raw = [np.ones(p.shape, np.float32) for p in r.params]
    raw[3][:] = 0                                            # blk.0.attn_v's B gets no gradient
    with pytest.raises(ValueError, match="B gradient is zero for blk.0.attn_v"):
        r.after_first_step(raw)


def test_resume_refuses_other_base(setup, tmp_path):
    ident = {"base_sha256": "a" * 64, "tokenizer_sha256": "b" * 64}
    checkpoint.check_identity(dict(ident), ident)
    with pytest.raises(ValueError, match="the base model differs"):
        checkpoint.check_identity({**ident, "base_sha256": "c" * 64}, ident)
    with pytest.raises(ValueError, match="the tokenizer differs"):
        checkpoint.check_identity({**ident, "tokenizer_sha256": "c" * 64}, ident)


def test_cli_run_writes_evidence_and_gates(setup, tmp_path, capsys):
    tm, tr, he, pr = setup
    out = tmp_path / "cli"
    rows = [json.loads(x) for x in open(tr) if x.strip()]
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("\n".join(json.dumps({"prompt": r["prompt"], "chosen": r["completion"],
                                            "rejected": "low" if r["completion"] != "low" else "high"})
                               for r in rows) + "\n")
    rc = main(["--model", str(tm.gguf_path), "--train-file", tr, "--heldout-file", he, "--preservation-file", pr,
               "--labels", "low,medium,high", "--max-len", "64", "--bucket", "16", "--rank", "4", "--steps", "3",
               "--no-verify", "--jsonl", "--out", str(out), "--tmkl", "0.1", "--lr", "0.01", "--warmup", "1",
               "--dpo-train-file", str(prefs), "--dpo-heldout-file", str(prefs), "--dpo-steps", "2"])
    assert rc in (0, 3)
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    kinds = [x["event"] for x in lines]
    assert kinds.count("step") == 3 and "eval" in kinds and "gates" in kinds
    ev = [x for x in lines if x["event"] == "eval"][-1]
    lo, hi = ev["heldout_acc_ci"]
    assert lo <= ev["heldout_acc"] <= hi and ev["heldout_n"] == 4      # every held-out row is a label row
    assert ev["merge_max_diff"] < 1e-3
    assert (out / "metrics.jsonl").is_file() and (out / "gates.json").is_file() and (out / "adapter.npz").is_file()
    assert json.loads((out / "config.json").read_text())["steps"] == 3
    import re
    eff = re.search(r"SFT token efficiency: ([\d,]+) positions computed, ([\d,]+) real .*?([\d,]+) supervised",
                    (out / "train.log").read_text())
    computed, real, sup = (int(x.replace(",", "")) for x in eff.groups())
    steps = [x for x in lines if x["event"] == "step"]
    assert computed == sum(x["seq_tokens"] for x in steps) and sup == sum(x["tokens"] for x in steps)
    assert 0 < sup < real <= computed
    # SFT then DPO, then the exports other tools load and the report
    assert kinds.count("dpo_step") == 2
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "adapter.gguf").is_file()
    assert json.loads((out / "adapter" / "vkdsl_manifest.json").read_text())["objective"] == "sft+dpo"
    page = (out / "report.html").read_text()
    assert "<svg" in page and "DPO loss" in page
    assert main(["--stepz", "3"]) == 1


def test_single_token_label_scoring_equals_candidate_scoring(setup, tmp_path):
    """The fast path (one forward per held-out row, label tokens compared at the answer
    position) must give the same accuracy and held-out loss as scoring each candidate row."""
    tm, tr, he, pr = setup
    from fixtures.train_data import write_jsonl
    held = write_jsonl(tmp_path / "h.jsonl", [{"prompt": p, "completion": c, "category": "x"} for p, c in
                                              [("Is it down?", "fox"), ("A theme", "dog"), ("Bills", "the"),
                                               ("Hi", "fox")]])
    cfg = tiny_cfg(setup, heldout_file=held, labels=["fox", "dog", "the"], steps=1)
    r = Run(cfg, tmp_path / "s", Reporter(None, quiet=True))
    r.params[1].assign(__import__("vkdsl").tensor(np.full(r.params[1].shape, 0.05, np.float32)))
    r.base_evidence()
    assert r.held.extra is not None
    fast = r.held.scores(True)
    r.held.extra = None
    slow = r.held.scores(True)
    assert (fast.correct, fast.n) == (slow.correct, slow.n) and slow.n == 4
    assert fast.heldout_loss == pytest.approx(slow.heldout_loss, rel=1e-5)


def test_dpo_only_run_has_no_sft_gates(setup, tmp_path, capsys):
    """objective dpo: no SFT step, so the evidence table and gates must not need one (this crashed)."""
    tm, tr, he, pr = setup
    prefs = tiny_prefs(tmp_path / "prefs.jsonl")
    out = tmp_path / "dpo"
    rc = main(["--model", str(tm.gguf_path), "--train-file", tr, "--heldout-file", he, "--preservation-file", pr,
               "--labels", "low,medium,high", "--max-len", "64", "--rank", "4", "--objective", "dpo", "--no-verify",
               "--quiet", "--out", str(out), "--dpo-train-file", str(prefs), "--dpo-steps", "2", "--dpo-batch", "4"])
    assert rc in (0, 3)
    names = [g["gate"] for g in json.loads((out / "gates.json").read_text())]
    assert "train loss fell" not in names and "held-out accuracy" not in names      # no SFT-stage gates
    assert {"DPO held-out pairs", "preservation after DPO", "after DPO: format"} <= set(names)


def test_the_runs_verify_pass_checks_the_packed_formats_its_model_keeps():
    # the default model: Q4_1 projections and a Q8_0 embedding (the gguf package's own reader says
    # which); the run verifies those formats' kernels, fused LoRA and plain, and no other format's
    import gguf
    from vkdsl.cli.verify_pass import verify_cases
    from vkdsl.models import load_model_files
    from vkdsl.models.default import default_model_path
    from vkdsl.models.quantized import packed_formats
    path = default_model_path()
    stored = {t.tensor_type.name.lower() for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2}
    ck = load_model_files(path)[0]
    assert packed_formats(ck, "keep") == stored - {"f32"} == {"q4_1", "q8_0"}
    assert packed_formats(ck, "none") == set() and packed_formats(ck, "nf4") == {"nf4"}
    every, run = verify_cases("fp32", 64), verify_cases("fp32", 64, {"q4_1", "q8_0"})
    fmt = lambda c: c.params.get("fmt") or (c.op[8:] if c.op.startswith("dequant_") else None)
    # `vkdsl verify --model` keeps the same rows of the whole table
    from fixtures.cli import run as vkdsl
    rows = [json.loads(x) for x in vkdsl(["verify", "--json", "--no-warm", "--match", "q",
                                          "--model", path]).stdout.splitlines()]
    assert rows.pop()["failed"] == 0
    from vkdsl.cli.verify import case_pairs
    want = {c.name for c, _, _ in case_pairs(match="q") if fmt(c) in (None, "q4_1", "q8_0")}
    assert {r["name"].split(":")[0] for r in rows} == want
    kept = [c.name for c, _, _ in every if fmt(c) in (None, "q4_1", "q8_0")]
    assert [c.name for c, _, _ in run] == kept
    names = {c.name for c, _, _ in run}
    for want in ("qlinear[q4_1,19x", "qlinear[q4_1,1x", "qlinear[q8_0,19x", "qlora_linear[q4_1,",
                 "dequant_q4_1[", "qgather[q4_1,"):
        assert any(n.startswith(want) for n in names), want
    assert {fmt(c) for c, _, _ in every} > {fmt(c) for c, _, _ in run}      # others were left out
    # --quant int4 / nf4 packs the weights on load: the pass checks that format's products
    for quant in ("int4", "nf4"):
        picked = {c.name for c, _, _ in verify_cases("fp32", 64, packed_formats(ck, quant))}
        assert {n for n in picked if n.startswith(("qlinear[", "qlora_linear["))} == \
            {f"qlinear[{quant},1x36x128]", f"qlinear[{quant},19x36x128]",
             "qlora_linear[int4,19x40x128,r=8]" if quant == "int4" else "qlora_linear[nf4,25x36x192,r=4]"}


def _tiny_run_args(setup, out, *extra):
    tm, tr, he, pr = setup
    return ["--model", str(tm.gguf_path), "--train-file", tr, "--heldout-file", he, "--preservation-file", pr,
            "--labels", "low,medium,high", "--max-len", "64", "--bucket", "16", "--rank", "4", "--steps", "2",
            "--warmup", "1", "--out", str(out), "--objective", "sft", *extra]


def test_the_verify_pass_runs_beside_the_base_evaluation_and_before_the_first_step(setup, tmp_path, capsys,
                                                                                  monkeypatch):
    import multiprocessing
    from vkdsl.cli import verify_pass

    def here(*a, **k):
        raise AssertionError("the verify pass ran in the run's own process")
    monkeypatch.setattr(verify_pass, "verify_rows", here)   # a spawned process imports its own
    assert main(_tiny_run_args(setup, tmp_path / "run")) in (0, 3)   # two steps need not pass the gates
    lines = capsys.readouterr().out.splitlines()
    at = lambda text: next(i for i, l in enumerate(lines) if l.startswith(text))
    # its verdict is taken after the base evaluation, which ran while it did, and before step 1
    assert at("base evaluation in") < at("verify: ") < at("step 1/2")
    assert not multiprocessing.active_children()


def test_a_failing_verify_row_stops_the_run_before_its_first_step(setup, tmp_path, capsys, monkeypatch):
    # a golden copy in which one row the run checks expects 1% more than the float64 reference (its
    # manifest entry rewritten to match): the device disagrees, and no step may train
    import hashlib
    import shutil
    from vkdsl.cli import verify_pass
    from vkdsl_golden import store
    root = tmp_path / "golden"
    shutil.copytree(store.data_dir(1), root / "v1")
    victim = next(c for c, _, _ in verify_pass.verify_cases("fp32", 64) if c.op == "rmsnorm")
    manifest = json.loads((root / "v1" / "manifest.json").read_text())
    entry = next(e for e in manifest["cases"] if e["name"] == victim.name)
    path = root / "v1" / entry["file"]
    arrays = dict(np.load(path))
    arrays["out"] = arrays["out"] * 1.01
    np.savez(path, **arrays)
    entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (root / "v1" / "manifest.json").write_text(json.dumps(manifest))

    class Planted(verify_pass.VerifyPass):
        def __init__(self, *a, **k):
            super().__init__(*a, root=str(root), **k)
    monkeypatch.setattr(verify_pass, "VerifyPass", Planted)
    out = tmp_path / "run"
    assert main(_tiny_run_args(setup, out)) == 1
    cap = capsys.readouterr()
    last = cap.err.strip().splitlines()[-1]
    assert last.startswith(f"vkdsl-train: error: verify failed: rmsnorm {victim.name}") and \
        last.endswith("nothing was trained"), cap.err
    assert "base evaluation in" in cap.out and "step 1/" not in cap.out
    assert not (out / "adapter").exists() and not list(out.glob("checkpoint*"))


def test_a_run_that_stops_before_training_leaves_no_verify_process_behind(setup, tmp_path, capsys):
    import multiprocessing
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "low"}\n{"prompt": \n')
    args = _tiny_run_args(setup, tmp_path / "run")
    args[args.index("--train-file") + 1] = str(bad)
    assert main(args) == 1
    assert f"{bad}:2" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not multiprocessing.active_children()


def test_the_verify_pass_keeps_a_pipeline_cache_file_of_its_own(tmp_path, monkeypatch, capfd):
    # the run's process and its verify pass each write the driver's pipeline cache at the end; one
    # file each, or the later writer would drop the other's pipelines (a driver without a disk
    # cache of its own would rebuild them every run). A damaged file at the pass's path is what
    # the pass reads (said in one line) and the run's own file is not.
    import os
    from vkdsl.cli.verify_pass import VerifyPass
    from vkdsl.runtime import default_device
    from vkdsl.runtime.pipeline_cache import cache_path
    monkeypatch.setenv("VKDSL_CACHE_DIR", str(tmp_path))
    pd = default_device().info.handle
    mine = cache_path(pd, "verify")
    assert mine != cache_path(pd) and os.path.dirname(mine) == os.path.dirname(cache_path(pd))
    os.makedirs(os.path.dirname(mine))
    with open(mine, "wb") as f:
        f.write(b"\x07" * 11)
    VerifyPass("fp32", 64, {"q8_0"}).join(Reporter(None, True, False))
    said = [l for l in capfd.readouterr().err.splitlines() if "pipeline cache" in l]
    assert said == [f"vkdsl: pipeline cache {mine} is damaged or from another driver; rebuilding it"]


def test_a_verify_pass_whose_run_is_gone_ends_quietly(capfd):
    # the run killed or stopped before its verdict: the pass's process finishes without a traceback
    from vkdsl.cli.verify_pass import VerifyPass
    check = VerifyPass("fp32", 64, {"q8_0"})
    check.recv.close()
    check.proc.join(600)
    assert check.proc.exitcode == 0 and "Traceback" not in capfd.readouterr().err
