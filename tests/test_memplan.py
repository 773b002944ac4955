"""The device-memory plan (train.memplan) and window-mode training on the tiny model: the plan's
step is the program the run then builds (its buffers, to 1%), window mode builds one step program
whatever the rows, a run over its budget is refused in one line naming settings that fit, and
`vkdsl-train --plan` prints the plan without training."""
import dataclasses
import gc

import numpy as np
import pytest

from fixtures.cli import vkdsl
from fixtures.synthetic import build_tiny
from fixtures.train_data import tiny_cfg, write_jsonl
from vkdsl.train import loop, memplan
from vkdsl.train.progress import Reporter
from vkdsl.train.trainer import Run, SftObjective

WORDS = "a b c d e f g h".split()


def chats(n, seed=0):
    """n conversations of one or two exchanges, 1-5 short words a turn (the tiny model's 64-token
    context holds the longest)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        turns = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 6)))) for _ in range(2 * int(rng.integers(1, 3)))]
        out.append({"messages": [{"role": "user" if k % 2 == 0 else "assistant", "content": t}
                                 for k, t in enumerate(turns)]})
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memplan")
    (tmp / "model").mkdir()
    tm = build_tiny(tmp / "model", seed=0)
    tr = write_jsonl(tmp / "chats.jsonl", chats(40))
    return tm, tr, tmp


def window_run(setup, **kw):
    tm, tr, tmp = setup
    cfg = tiny_cfg((tm, tr, "", ""), **{**dict(label_eval=False, window=64, batch_size=2, layers="",
                                                checkpoint="layers"), **kw})
    return Run(cfg, tmp / "run", Reporter(None, quiet=True))


def program_bytes(prog):
    return prog.device_bytes


def test_the_planned_step_is_the_program_window_mode_builds_and_the_only_one(setup):
    r = window_run(setup)
    planned = memplan.plan(r)["parts"]["sft step"]
    obj = SftObjective(r)
    for s in range(4):                       # four steps, windows of different rows and counts
        rec = loop.one_step(obj, r.params, r.stepper.opt, s)
        assert np.isfinite(rec["loss"]) and rec["computed"] == 2 * 64
    progs = [p for p, _, _ in r.stepper.fn_packed.programs.values()]
    assert len(progs) == 1 and not r.stepper.fn.programs
    assert program_bytes(progs[0]) == pytest.approx(planned, rel=0.01)


def test_a_run_over_its_budget_is_refused_naming_settings_that_fit(setup):
    r = window_run(setup, checkpoint="none")
    p = memplan.plan(r)
    fix = memplan.alternatives(r.cfg)[0]
    with_layers = memplan.plan(r, fix)["total"]
    assert (fix.checkpoint, fix.batch_size, fix.eval_batch) == ("layers", 2, 4) and with_layers < p["total"]
    r.cfg.device_memory = str((with_layers + p["total"]) // 2)     # the layers plan fits, this one not
    with pytest.raises(memplan.MemoryPlanError, match=r"budget is .* MiB: checkpoint = layers, batch_size = 2, "
                                                      r"grad_accum = 1, eval_batch = 4 fits"):
        memplan.check(r, lambda s: None)
    r.cfg.device_memory = "1K"
    with pytest.raises(memplan.MemoryPlanError, match="no checkpointing, batch split, stability_rows = 0 or fp16 activations fits"):
        memplan.check(r, lambda s: None)
    alts = memplan.alternatives(r.cfg)              # fp16 saved activations only after every exact setting
    first16 = next(i for i, c in enumerate(alts) if c.activations == "fp16")
    assert first16 > 0 and all(c.activations == "fp16" for c in alts[first16:])
    as32 = dataclasses.replace(alts[first16], activations="fp32")
    assert memplan.plan(r, alts[first16])["total"] < memplan.plan(r, as32)["total"]


def test_a_run_that_cannot_fit_is_refused_before_its_weights_reach_the_device(setup, tmp_path):
    """The model is built with its weights on the host (vkdsl.realize.deferred_uploads) and planned
    from shapes: the refusal comes with less allocated than the weights alone; a run that fits
    has every weight on the device once the plan passed."""
    from vkdsl.runtime import default_device
    from vkdsl.train.trainer import run
    tm, tr, _ = setup
    weights = window_run(setup).model.device_bytes()["device_bytes"]
    gc.collect()                  # that run's buffers freed now, not during the one measured
    cfg = tiny_cfg((tm, tr, "", ""), label_eval=False, window=64, batch_size=2, layers="", steps=1,
                   device_memory="1K")
    dev = default_device()
    dev.peak_bytes = before = dev.allocated_bytes
    with pytest.raises(memplan.MemoryPlanError, match="budget is 0 MiB"):
        run(cfg, tmp_path / "refused", evidence_at_end=False)
    assert dev.peak_bytes - before < weights / 2
    r = run(dataclasses.replace(cfg, device_memory=""), tmp_path / "fits", evidence_at_end=False)
    assert r.step == 1 and not r.pending and r.model.device_bytes()["device_bytes"] == weights


def test_vkdsl_train_plan_prints_the_plan_and_trains_nothing(setup, tmp_path):
    tm, tr, _ = setup
    args = ["train", "--plan", "--model", str(tm.gguf_path), "--train-file", tr, "--heldout-file", "",
            "--preservation-file", "", "--no-label-eval", "--window", "64", "--max-len", "64", "--layers", "",
            "--batch-size", "2", "--out", str(tmp_path / "out"), "--no-verify"]
    p = vkdsl(args)
    assert p.returncode == 0, p.stderr
    text = p.stdout + p.stderr
    assert "device memory plan (2 window(s) of 64 tokens" in text and "sft step" in text
    assert not (tmp_path / "out").exists()
    bad = vkdsl(args + ["--device-memory", "1K"])
    assert bad.returncode == 1 and "budget is 0 MiB" in bad.stderr and "Traceback" not in bad.stderr
    worse = vkdsl(args + ["--device-memory", "lots"])
    assert worse.returncode != 0 and "device_memory 'lots'" in worse.stderr


def test_a_window_run_killed_after_step_3_resumes_to_the_same_adapter(setup, tmp_path):
    """The window order (lists of rows) is checkpointed and replayed: 5 steps in one go equal 3
    steps, a 'kill', and a resume from the step-2 checkpoint, bit for bit."""
    from vkdsl.train import checkpoint
    from vkdsl.train.trainer import run
    tm, tr, _ = setup
    cfg = tiny_cfg((tm, tr, "", ""), label_eval=False, window=64, batch_size=2, grad_accum=2, layers="",
                   checkpoint="layers", steps=5, checkpoint_every=2)
    full = run(cfg, tmp_path / "full", evidence_at_end=False)
    part = run(cfg, tmp_path / "part", stop_after=3, evidence_at_end=False)
    assert part.step == 3 and checkpoint.load(tmp_path / "part")[0]["step"] == 2
    resumed = run(cfg, tmp_path / "part", resume=tmp_path / "part", evidence_at_end=False)
    assert resumed.step == full.step == 5 and full.tokens["computed"] == 5 * 2 * 2 * 64
    for a, b in zip(full.params, resumed.params):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert full.last_loss < full.first_loss


def test_a_window_micro_batch_always_has_batch_size_sequences(setup):
    """Rows that would fit one sequence still make batch_size windows: one program shape."""
    r = window_run(setup)
    pk = r.stepper.packing([10, 12], 16)
    assert (pk.n_seq, pk.T) == (2, 64) and pk.place == [(0, 0), (0, 10)]


def test_the_planned_dpo_step_is_the_program_the_dpo_stage_builds(setup, tmp_path, monkeypatch):
    """Every pair in each DPO step: the stage builds one DPO program, of the plan's bytes (to 1%),
    after the SFT step's programs are released; the plan counts the larger of the two steps."""
    from vkdsl.train import dpo
    from vkdsl.train.stages import dpo_stage
    from vkdsl.train.trainer import run
    tm, tr, _ = setup
    prefs = write_jsonl(tmp_path / "prefs.jsonl", [
        {"prompt": " ".join(WORDS[:1 + i % 5]), "chosen": " ".join(WORDS[:1 + i % 3]),
         "rejected": " ".join(WORDS[2:3 + i % 4])} for i in range(6)])
    built = []
    monkeypatch.setattr(dpo, "build_dpo_step",
                        lambda *a, _b=dpo.build_dpo_step, **k: built.append(_b(*a, **k)) or built[-1])
    cfg = tiny_cfg((tm, tr, "", ""), label_eval=False, layers="", steps=1, objective="sft+dpo",
                   dpo_train_file=prefs, dpo_heldout_file="", dpo_steps=2, dpo_batch=6)
    r = run(cfg, tmp_path / "run", evidence_at_end=False)
    parts = r.plan["parts"]
    assert r.plan["total"] == sum(parts.values()) - min(parts["sft step"], parts["dpo step"])
    dpo_stage(r)
    assert not r.stepper.fn.programs and not r.stepper.fn_packed.programs
    progs = [p for p, _, _ in built[-1].programs.values()]
    assert len(progs) == 1 and program_bytes(progs[0]) == pytest.approx(parts["dpo step"], rel=0.01)


def test_a_run_given_exactly_its_plan_as_device_memory_completes_sft_and_dpo(tmp_path, monkeypatch):
    """The plan is what must fit: with the device's budget set to it (VKDSL_DEVICE_MEMORY_LIMIT),
    SFT, the final evaluation's fp32 base check and DPO all run (programs of other shapes give way
    when a program needs the room), and the peak stays within the plan."""
    from fixtures.train_data import tiny_prefs, tiny_setup
    from vkdsl.runtime import default_device
    from vkdsl.train.stages import dpo_stage
    from vkdsl.train.trainer import run
    s = tiny_setup(tmp_path)
    prefs = tiny_prefs(tmp_path / "prefs.jsonl")
    cfg = tiny_cfg(s, steps=4, objective="sft+dpo", dpo_train_file=prefs, dpo_heldout_file=prefs,
                   dpo_steps=3, dpo_batch=2, quant="int4", stability_rows=4)
    total = run(cfg, tmp_path / "plan", plan_only=True).plan["total"]
    gc.collect()
    dev = default_device()
    monkeypatch.setenv("VKDSL_DEVICE_MEMORY_LIMIT", str(dev.allocated_bytes + total))
    dev.peak_bytes = before = dev.allocated_bytes
    r = run(cfg, tmp_path / "run")
    dpo_stage(r)
    assert r.final.stability_fp32 is not None and len(r.gates) > 10
    assert dev.peak_bytes - before <= total
