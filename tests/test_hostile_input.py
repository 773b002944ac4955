"""Hostile input, third round (issue 31): each of the 18 bugs as a case that failed before its fix.
Every refusal is one line naming the file:line, field or variable and what was expected; the
messages are the ones RELIABILITY.md shows beside the cases."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fixtures.cli import vkdsl as cli
from fixtures.train_data import tiny_cfg, tiny_setup, write_jsonl
from vkdsl.cli.train import main as train_main
from vkdsl.models import ModelFileError, load_model_files
from vkdsl.train.config import ConfigError, TrainConfig
from vkdsl.train.data import DataError, load_examples


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("hostile"))


def _args(setup, out, *extra):
    tm, tr, he, pr = setup
    return ["--model", str(tm.gguf_path), "--train-file", tr, "--heldout-file", he, "--preservation-file", pr,
            "--labels", "low,medium,high", "--max-len", "64", "--rank", "4", "--alpha", "8", "--lr", "1e-2",
            "--warmup", "1", "--steps", "2", "--checkpoint-every", "1", "--batch-size", "4", "--eval-batch", "4",
            "--tmkl", "0", "--objective", "sft", "--no-verify", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def finished(setup, tmp_path_factory):
    """One finished tiny SFT run, --quiet, with what it printed."""
    out = tmp_path_factory.mktemp("finished") / "run"
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = train_main(_args(setup, out, "--quiet"))
    return out, rc, buf.getvalue()


# 1 ------------------------------------------------------------------------------------------
def test_labels_must_cover_every_heldout_completion(setup, tmp_path):
    from vkdsl.train.trainer import Run
    from vkdsl.train.progress import Reporter
    cfg = tiny_cfg(setup, labels=["low", "medium"])
    with pytest.raises(DataError) as e:
        Run(cfg, tmp_path / "r", Reporter(None, quiet=True))
    assert "held.jsonl:1: completion 'high' is not one of the labels (low, medium)" in str(e.value)
    with pytest.raises(ConfigError, match="labels is empty"):
        tiny_cfg(setup, labels=[])
    assert tiny_cfg(setup, labels=[], label_eval=False).label_eval is False      # off on purpose
    assert train_main(_args(setup, tmp_path / "x", "--labels", "")) == 1


# 2 ------------------------------------------------------------------------------------------
def test_a_fresh_run_into_a_run_folder_is_refused_and_overwrite_empties_only_run_folders(setup, tmp_path, capsys):
    out = tmp_path / "old"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"event": "step", "step": 1}\n')
    assert train_main(_args(setup, out)) == 1
    err = capsys.readouterr().err
    assert f"--out {out} already holds files of a run: continue it with --resume" in err
    assert (out / "metrics.jsonl").read_text().count("\n") == 1            # untouched
    from vkdsl.cli.train import _fresh_folder
    _fresh_folder(str(out), overwrite=True)
    assert list(out.iterdir()) == []
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="not a run folder"):
        _fresh_folder(str(other), overwrite=True)
    assert (other / "notes.txt").is_file()


# 3 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template,kind", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ("{% if messages %}", "line 1"),
    ("{{ messages[0].content.nope.deeper }}", "UndefinedError"),
    ("{% for i in range(10**12) %}{% endfor %}", "OverflowError")])
def test_chat_template_errors_are_one_line_naming_where_the_template_lives(setup, template, kind):
    _, tok = load_model_files(setup[0].gguf_path)
    tok.chat_template = template
    with pytest.raises(ModelFileError) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    msg = str(e.value)
    assert "tiny.gguf (GGUF key tokenizer.chat_template): chat template" in msg and kind in msg
    assert "\n" not in msg


# 4 ------------------------------------------------------------------------------------------
def test_an_empty_prompt_is_refused_and_matmul_refuses_a_zero_length_axis(setup):
    import vkdsl
    from vkdsl.tensor import ShapeError
    p = cli(["generate", "--model", str(setup[0].gguf_path), "--prompt", ""])
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "Error: --prompt '' tokenizes to no tokens" in p.stderr
    a = vkdsl.tensor(np.ones((3, 4), np.float32))
    with pytest.raises(ShapeError, match="zero-length axis"):
        vkdsl.tensor(np.ones((0, 3), np.float32)) @ a


# 5 ------------------------------------------------------------------------------------------
def test_a_for_line_that_does_not_parse_fails_before_any_work_and_gates_have_their_own_status(tmp_path):
    p = cli(["compile", "--bundle", str(tmp_path / "b"), "--for", "vkdsl-train --steps"])
    assert p.returncode == 2 and "'vkdsl-train --steps' does not parse" in p.stderr
    assert not (tmp_path / "b").exists()                       # nothing built, nothing recorded
    p = cli(["compile", "--bundle", str(tmp_path / "b"), "--for", "vkdsl verify --nope"])
    assert p.returncode == 2 and "does not parse" in p.stderr and "--nope" in p.stderr
    from vkdsl.cli.common import GATE_FAILED
    assert GATE_FAILED not in (0, 1, 2)                        # 2 is click's usage error


# 6 ------------------------------------------------------------------------------------------
def test_probe_parameters_have_bounds():
    from vkdsl.train.probes import ProbeError, get, parse_sets
    low = get("lowrank")
    with pytest.raises(ProbeError, match=r"probe lowrank: steps=-5 is out of bounds: expected >= 1"):
        parse_sets(low, ["steps=-5"])
    with pytest.raises(ProbeError, match=r"probe lowrank: d=0 is out of bounds: expected >= 4"):
        parse_sets(low, ["d=0"])
    with pytest.raises(ProbeError, match=r"n=64 is out of bounds: expected in \[4, 32\]"):
        parse_sets(low, ["d=32", "n=64"])
    with pytest.raises(ProbeError, match=r"ranks=0 is out of bounds"):
        parse_sets(get("rank-floor"), ["ranks=1,0"])
    assert parse_sets(get("rehearsal"), ["weights=0,0.5"])["weights"] == [0.0, 0.5]


# 7, 8 ---------------------------------------------------------------------------------------
def test_report_needs_a_run_folder_and_names_missing_records(finished, tmp_path):
    from vkdsl.train.report import build_report
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="not a vkdsl-train run folder"):
        build_report(empty)
    assert not (empty / "report.html").exists()
    out, rc, _ = finished
    for name in ("metrics.jsonl", "gates.json", "adapter/adapter_config.json"):
        cut = tmp_path / name.replace("/", "_")
        shutil.copytree(out, cut)
        (cut / name).unlink()
        with pytest.raises(FileNotFoundError, match=f"a finished run \\(summary.json\\) without {name}"):
            build_report(cut)
    p = cli(["report", str(empty)])
    assert p.returncode == 1 and "not a vkdsl-train run folder" in p.stderr


# 9 ------------------------------------------------------------------------------------------
def test_resume_records_changed_settings_and_refuses_other_training_rows(setup, finished, tmp_path, capsys):
    out, rc, _ = finished
    run = tmp_path / "run"
    shutil.copytree(out, run)
    capsys.readouterr()
    assert train_main(["--resume", str(run), "--lr", "5e-3", "--quiet"]) in (0, 3)
    assert "resume: lr changed from 0.01 to 0.005 (given now)" in capsys.readouterr().out
    assert json.loads((run / "config.json").read_text())["lr"] == 0.005
    tm, tr, he, pr = setup
    other = write_jsonl(tmp_path / "train.jsonl", [json.loads(x) | {"completion": "low"} for x in open(tr)])
    assert train_main(["--resume", str(run), "--train-file", other, "--quiet"]) == 1
    assert "refusing to resume: the train_file's content differs" in capsys.readouterr().err


# 10 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("msgs,where", [
    ([{"role": "assistant", "content": "low"}, {"role": "user", "content": "Dark mode"}],
     "messages[0] is a 'assistant' turn where a 'user' turn is expected"),
    ([{"role": "user", "content": "Dark mode"}, {"role": "assistant", "content": "low"},
      {"role": "system", "content": "Be brief"}], "messages[2] is a 'system' turn where a 'user' turn")])
def test_turns_out_of_order_are_refused(setup, tmp_path, msgs, where):
    _, tok = load_model_files(setup[0].gguf_path)
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": msgs}])
    with pytest.raises(DataError, match=re.escape(f"m.jsonl:1: {where}")):
        load_examples(path, tok, True, 64, "left")


# 11 -----------------------------------------------------------------------------------------
def test_quiet_still_prints_the_gates_and_the_run_folder(finished):
    out, rc, printed = finished
    gates = json.loads((out / "gates.json").read_text())
    assert "gates:" in printed and f"run folder: {out}" in printed
    for g in gates:
        assert f"{'PASS' if g['pass'] else 'FAIL'}  {g['gate']}:" in printed
    assert "step 1/2" not in printed                           # progress stays quiet
    assert rc == (0 if all(g["pass"] for g in gates) else 3)


# 12 -----------------------------------------------------------------------------------------
def test_target_modules_must_name_every_adapted_module(setup, finished, tmp_path):
    from vkdsl.models.adapters.bundle import read_adapter
    ck, _ = load_model_files(setup[0].gguf_path)
    folder = tmp_path / "adapter"
    shutil.copytree(finished[0] / "adapter", folder)
    conf = json.loads((folder / "adapter_config.json").read_text())
    assert read_adapter(folder, ck.config).modules                       # as written: accepted
    conf["target_modules"] = ["q_proj"]
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(ModelFileError, match=r'target_modules \["q_proj"\] does not name \w+ of layer \d, which the weights'):
        read_adapter(folder, ck.config)


# 13 -----------------------------------------------------------------------------------------
def test_a_wrong_typed_config_value_is_named(setup, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(setup[0].hf_dir, hf)
    conf = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(conf | {"hidden_size": "sixty-four"}))
    with pytest.raises(ModelFileError, match=r'config.json: hidden_size = "sixty-four", expected a positive integer'):
        load_model_files(hf)
    conf.pop("head_dim", None)
    (hf / "config.json").write_text(json.dumps(conf | {"num_attention_heads": 7, "num_key_value_heads": 7}))
    with pytest.raises(ModelFileError, match="hidden_size 64 is not divisible by num_attention_heads 7"):
        load_model_files(hf)


# 14 -----------------------------------------------------------------------------------------
def test_a_nan_weight_is_refused_at_load(setup, tmp_path):
    from safetensors.numpy import load_file, save_file
    hf = tmp_path / "hf"
    shutil.copytree(setup[0].hf_dir, hf)
    (st,) = hf.glob("*.safetensors")
    w = load_file(str(st))
    name = next(k for k in w if k.endswith("layers.1.mlp.up_proj.weight"))
    w[name] = w[name].copy()
    w[name][2, 3] = np.nan
    save_file(w, str(st))
    with pytest.raises(ModelFileError, match=r"tensor 'blk.1.ffn_up.weight' holds 1 non-finite value\(s\)"):
        load_model_files(hf)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_the_scale_fields_are_where_the_formats_put_them(kind):
    """The check reads only each block's fp16 fields: with them finite and every other byte random,
    gguf's own dequantize (the reference) gives finite values; one NaN field gives NaN there."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize
    from vkdsl.models.tensors import F16_FIELDS, TensorRecord, nonfinite
    per, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = np.random.default_rng(0).integers(0, 256, (16, size), dtype=np.uint8)
    for o in F16_FIELDS[kind]:
        raw[:, o:o + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    rec = TensorRecord("w", kind, (16 * per,), raw.reshape(-1))
    assert np.isfinite(dequantize(raw.reshape(-1), GGMLQuantizationType[kind])).all() and nonfinite(rec) == 0
    for o in F16_FIELDS[kind]:
        bad = raw.copy()
        bad[3, o:o + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
        ref = dequantize(bad.reshape(-1), GGMLQuantizationType[kind])
        assert not np.isfinite(ref).all() and nonfinite(TensorRecord("w", kind, (16 * per,), bad.reshape(-1))) == 1


# 15, 16 -------------------------------------------------------------------------------------
def test_every_command_validates_the_environment(setup, tmp_path, capsys, monkeypatch):
    p = cli(["devices"], VKDSL_PROFILE="bogus")
    assert p.returncode == 1 and "profile 'bogus' is not known" in p.stderr
    p = cli(["devices"], VKDSL_DEVICE_MEMORY_LIMIT="lots")
    assert p.returncode == 1 and "VKDSL_DEVICE_MEMORY_LIMIT='lots'" in p.stderr
    monkeypatch.setenv("VKDSL_PRECISION", "bogus")
    assert train_main(_args(setup, tmp_path / "p")) == 1
    assert "VKDSL_PRECISION 'bogus' is not known" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


# 17 -----------------------------------------------------------------------------------------
def test_mpi_ranks_with_other_profiles_are_named(setup, tmp_path):
    exe = shutil.which("mpirun")
    if exe is None:
        pytest.fail("mpirun not found: ./setup.sh --test (or --mpi) installs Open MPI and mpi4py")
    train = str(Path(sys.executable).parent / "vkdsl-train")
    args = _args(setup, tmp_path / "mpi")
    env = {**os.environ, "LP_NUM_THREADS": "1"}
    env.pop("VKDSL_PROFILE", None)
    p = subprocess.run([exe, "--allow-run-as-root", "--oversubscribe", "-np", "1", train, *args, ":",
                        "-np", "1", "-x", "VKDSL_PROFILE=minimal", train, *args],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode != 0 and "rank(s) [1] were started with other settings" in p.stderr, p.stderr[-2000:]
    assert "VKDSL_PROFILE" in p.stderr


# 18 -----------------------------------------------------------------------------------------
def test_a_bundle_index_entry_that_is_not_an_object_is_named(tmp_path):
    from vkdsl.compiler.bundle import read_index
    from vkdsl.compiler.errors import NoCompiler
    (tmp_path / "index.json").write_text(json.dumps({"format": 1, "kernels": {"abc": 5}}))
    with pytest.raises(NoCompiler, match=rf"SPIR-V bundle {tmp_path}: cannot read index.json \(kernels\['abc'\] is 5"):
        read_index(str(tmp_path))
    (tmp_path / "index.json").write_text(json.dumps({"kernels": {"k": {"name": "n", "file": "../x", "sha256": "0"}}}))
    with pytest.raises(NoCompiler, match="not a file inside the bundle"):
        read_index(str(tmp_path))


# the round's notes --------------------------------------------------------------------------
def test_max_len_beyond_the_context_and_a_toml_error_at_its_end(setup, tmp_path):
    from vkdsl.train import config as C
    from vkdsl.train.progress import Reporter
    from vkdsl.train.trainer import Run
    ck, _ = load_model_files(setup[0].gguf_path)
    too_long = ck.config.context_length + 1
    with pytest.raises(ValueError, match=f"max_len {too_long} is beyond the model's context of "
                                         f"{ck.config.context_length} tokens"):
        Run(tiny_cfg(setup, max_len=too_long), tmp_path / "r", Reporter(None, quiet=True))
    bad = tmp_path / "x.toml"
    bad.write_text("steps = 3\nlr = ")
    with pytest.raises(ConfigError, match=re.escape(f"{bad}:2: Invalid value (at end of document)")):
        C.load(bad)


def test_an_output_path_under_a_file_or_an_unwritable_folder_is_one_line(tmp_path):
    # once "[Errno 17] File exists: '...'" naming the blocking file as if it were the output
    from vkdsl.fileio import atomic_write
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OSError) as e:
        atomic_write(tmp_path / "afile" / "sub" / "x.npy", b"data")
    assert str(e.value) == (f"{tmp_path / 'afile' / 'sub' / 'x.npy'}: cannot write there "
                            f"({tmp_path / 'afile'} is a file, not a folder)")
    with pytest.raises(OSError) as e:
        atomic_write("/proc/vkdsl-test.npy", b"data")
    assert str(e.value).startswith("/proc/vkdsl-test.npy: cannot write there (")
    assert not list(tmp_path.glob("afile*/**/*.tmp"))


@pytest.mark.parametrize("flag, path, said", [
    ("--train-file", "missing.jsonl", "train_file {}: no such file"),
    ("--model", "missing.gguf", "model {}: no such file or folder"),
    ("--heldout-file", ".", "heldout_file {}: a folder, expected a file")])
def test_a_mistyped_input_path_is_one_line_and_makes_no_run_folder(setup, tmp_path, capsys, monkeypatch,
                                                                   flag, path, said):
    # once errno's "[Errno 2] No such file or directory: 'missing.jsonl'", after runs/<time>/ was
    # made holding config.json and a log of the error (or, for --model, nothing)
    monkeypatch.chdir(tmp_path)
    args = _args(setup, "x")[:-2] + [flag, path]          # --out left to its default, runs/<time>
    assert train_main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"vkdsl-train: error: config: {said.format(path)}"
    assert not (tmp_path / "runs").exists()
