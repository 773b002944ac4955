"""Crash-consistent state: one checkpoint is one atomic file; resume verifies it and refuses
anything inconsistent, naming the file; stale temp files go; metrics carry a resume marker and no
duplicate step; the base evaluation is cached with its key and reused on resume."""
import io
import json
import zipfile

import numpy as np
import pytest

from fixtures.train_data import tiny_cfg, tiny_setup
from vkdsl.train import checkpoint
from vkdsl.train.checkpoint import CheckpointError
from vkdsl.train.trainer import run


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("tiny_ckpt"))


@pytest.fixture(scope="module")
def stopped(setup, tmp_path_factory):
    """A run of 4 steps stopped after step 3 (checkpoints every 2): its folder and config."""
    folder = tmp_path_factory.mktemp("stopped") / "run"
    cfg = tiny_cfg(setup, steps=4, checkpoint_every=2)
    run(cfg, folder, stop_after=3, evidence_at_end=False)
    return folder, cfg


def _rewrite(path, edit):
    """Rewrite a checkpoint's members through edit(members, meta) (a forger's tool, for tests)."""
    with np.load(path) as z:
        members = {k: z[k] for k in z.files}
    meta = json.loads(members.pop("meta").tobytes())
    edit(members, meta)
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **members)
    path.write_bytes(buf.getvalue())


def _copy(src, dst):
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_checkpoint_is_one_verified_file(stopped):
    folder, _ = stopped
    assert not (folder / "checkpoint.json").exists()
    meta, params, opt = checkpoint.load(folder)
    assert meta["step"] == int(opt["t"]) == 2 and len(params) == 2 * len(meta["modules"])
    with zipfile.ZipFile(folder / checkpoint.NAME) as z:
        assert "meta.npy" in z.namelist()


def test_truncated_checkpoint_is_refused_naming_the_file(stopped, tmp_path):
    d = _copy(stopped[0], tmp_path / "t")
    data = (d / checkpoint.NAME).read_bytes()
    (d / checkpoint.NAME).write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=r"checkpoint\.npz: truncated or corrupt"):
        checkpoint.load(d)


def test_a_step_that_disagrees_with_the_optimizer_is_refused(stopped, tmp_path):
    d = _copy(stopped[0], tmp_path / "s")
    _rewrite(d / checkpoint.NAME, lambda m, meta: meta.update(step=3))
    with pytest.raises(CheckpointError, match="step 3 but the optimizer has taken 2 steps"):
        checkpoint.load(d)


def test_a_damaged_member_is_refused(stopped, tmp_path):
    d = _copy(stopped[0], tmp_path / "m")
    _rewrite(d / checkpoint.NAME, lambda m, meta: m.update(p1=m["p1"] + np.float32(1e-3)))
    with pytest.raises(CheckpointError, match="member p1 does not match its sha256"):
        checkpoint.load(d)


def test_a_checkpoint_of_another_data_order_is_refused(setup, stopped, tmp_path):
    d = _copy(stopped[0], tmp_path / "o")
    cfg = tiny_cfg(setup, steps=4, checkpoint_every=2, data_seed=7)
    with pytest.raises(CheckpointError, match="data-order state is not the one of step 2"):
        run(cfg, d, resume=d, evidence_at_end=False)


def test_a_checkpoint_of_the_previous_format_is_refused_in_one_line(setup, stopped, tmp_path, capsys):
    # format 2 hashed the tokenizer another way: its identity cannot be compared, so it is refused
    from vkdsl.cli.train import main
    d = _copy(stopped[0], tmp_path / "f2")
    _rewrite(d / checkpoint.NAME, lambda m, meta: meta.update(format=2))
    assert main(["--resume", str(d)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint.npz: a checkpoint of format 2" in err[0] and "start a new run" in err[0]


def test_the_old_two_file_format_is_not_resumed(tmp_path):
    (tmp_path / "checkpoint.json").write_text('{"step": 2}')
    with pytest.raises(CheckpointError, match="old two-file format"):
        checkpoint.load(tmp_path)


def test_resume_cleans_temps_marks_metrics_and_reuses_base_eval(setup, stopped, tmp_path, capsys):
    folder, cfg = stopped
    d = _copy(folder, tmp_path / "r")
    (d / ".checkpoint.npz.abc123.tmp").write_bytes(b"half a write")
    cfg = tiny_cfg(setup, steps=4, checkpoint_every=2, quiet=False)
    first = run(cfg, d, resume=d)                                 # evaluates the base, caches it
    assert not list(d.glob(".*.tmp"))
    recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if r["event"] == "step"]
    assert steps == [1, 2, 3, 4]                                  # step 3 ran twice, recorded once
    assert {"event": "resume", "step": 2} in recs
    out = capsys.readouterr().out
    assert "removed .checkpoint.npz.abc123.tmp" in out
    cached = json.loads((d / "base_eval.json").read_text())
    assert cached["base"]["preservation_loss"] == pytest.approx(first.base.preservation_loss)
    again = run(cfg, d, resume=d)
    assert "base evaluation reused from base_eval.json" in capsys.readouterr().out
    assert again.base.heldout_loss == first.base.heldout_loss


def test_resume_before_the_first_checkpoint_starts_from_step_zero(setup, tmp_path):
    cfg = tiny_cfg(setup, steps=3, checkpoint_every=2)
    full = run(cfg, tmp_path / "full", evidence_at_end=False)
    d = tmp_path / "early"
    run(cfg, d, stop_after=1, evidence_at_end=False)          # stopped before any checkpoint
    assert not (d / checkpoint.NAME).exists()
    resumed = run(cfg, d, resume=d, evidence_at_end=False)
    assert resumed.step == 3
    for a, b in zip(full.params, resumed.params):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["event"] == "step"] == [1, 2, 3]


def test_a_base_model_with_non_finite_weights_stops_before_training(setup, tmp_path):
    import vkdsl
    from vkdsl.train.progress import Reporter
    from vkdsl.train.trainer import Run
    r = Run(tiny_cfg(setup), tmp_path / "nan", Reporter(None, quiet=True))
    w = next(iter(r.model.norm.values()))
    w.assign(vkdsl.tensor(np.full(w.shape, np.nan, np.float32)))
    with pytest.raises(ValueError, match=r"not finite before any training: its weights hold NaN or Inf"):
        r.base_evidence()
