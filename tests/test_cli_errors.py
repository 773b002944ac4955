"""Every error a user can cause is one line naming what it concerns, exit status 1, no traceback
(VKDSL_DEBUG=1 keeps it): a missing device, undecodable data, settings written wrong."""
import json
import re

import pytest

from fixtures.cli import vkdsl
from fixtures.train_data import tiny_cfg, tiny_setup
from vkdsl.cli.train import main
from vkdsl.train.config import ConfigError, TrainConfig
from vkdsl.train.data import DataError, load_examples
from vkdsl.train.inject import InjectError, parse_layers
from vkdsl.models import load_model_files


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("tiny_err"))


def test_a_device_that_is_not_there(setup):
    p = vkdsl(["devices"], VKDSL_DEVICE="nvidia")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.startswith("Error: no device matches 'nvidia'; devices present:") and "[0]" in p.stderr
    d = vkdsl(["devices"], VKDSL_DEVICE="nvidia", VKDSL_DEBUG="1")
    assert d.returncode != 0 and "Traceback" in d.stderr


@pytest.mark.parametrize("icd, said", [
    ({"file_format_version": "1.0.0", "ICD": {"library_path": "/nonexistent/libvk.so", "api_version": "1.3.0"}},
     "its library_path /nonexistent/libvk.so does not exist"),
    ("{not json", "not a Vulkan ICD file (expected JSON with ICD.library_path)"),
    (None, "No such file or directory")], ids=["missing_library", "not_json", "no_file"])
def test_a_broken_driver_file_is_one_line_naming_it(tmp_path, icd, said):
    f = tmp_path / "driver.json"
    if icd is not None:
        f.write_text(icd if isinstance(icd, str) else json.dumps(icd))
    p = vkdsl(["devices"], VK_ICD_FILENAMES=str(f))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: vkCreateInstance failed with VK_ERROR_")
    assert lines[0].endswith(f": {f}: {said}"), lines[0]


def test_a_broken_driver_file_beside_a_working_one_is_named_and_the_other_device_runs(tmp_path):
    import glob
    good = sorted(glob.glob("/usr/share/vulkan/icd.d/lvp_icd*.json"))
    assert good, "the system lavapipe is part of the test setup"
    bad = tmp_path / "gone.json"
    bad.write_text(json.dumps({"file_format_version": "1.0.0",
                               "ICD": {"library_path": "/nonexistent/libvk.so", "api_version": "1.3.0"}}))
    p = vkdsl(["devices"], VK_ICD_FILENAMES=f"{bad}:{good[0]}")
    assert p.returncode == 0 and "llvmpipe" in p.stdout, p.stderr
    assert p.stderr.strip() == (f"vkdsl: warning: a Vulkan driver file was skipped: {bad}: "
                                "its library_path /nonexistent/libvk.so does not exist")


def test_with_swiftshader_beside_lavapipe_lavapipe_is_the_default_and_both_name_a_version():
    import glob
    lvp = sorted(glob.glob("/usr/share/vulkan/icd.d/lvp_icd*.json"))[0]
    ss = "/usr/lib/chromium/vk_swiftshader_icd.json"      # ./setup.sh --test installs chromium
    p = vkdsl(["devices", "--json"], VK_ICD_FILENAMES=f"{ss}:{lvp}")
    assert p.returncode == 0, p.stderr
    devs = [json.loads(line) for line in p.stdout.splitlines()]         # one object a device
    assert sorted(d["name"].split()[0] for d in devs) == ["SwiftShader", "llvmpipe"]
    assert [d["name"].split()[0] for d in devs if d["default"]] == ["llvmpipe"]
    assert all(re.search(r"\d+\.\d+", d["driver_info"]) for d in devs), devs


def test_vkdsl_train_names_the_missing_device_before_loading_anything(setup, capsys, monkeypatch):
    monkeypatch.setenv("VKDSL_DEVICE", "nvidia")
    import vkdsl.runtime.context as ctx
    monkeypatch.setattr(ctx, "_default", None)              # as a fresh process: no device opened yet
    tm = setup[0]
    assert main(["--model", str(tm.gguf_path), "--no-verify", "--steps", "10"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vkdsl-train: error: no device matches 'nvidia'") and "loaded" not in err


def test_non_utf8_data_names_file_line_and_column(setup, tmp_path):
    tok = load_model_files(setup[0].gguf_path)[1]
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: byte 0xe9 at column 16 is not UTF-8"):
        load_examples(p, tok, True, 64, "left")


def test_an_empty_assistant_turn_is_refused_like_an_empty_completion(setup, tmp_path):
    tok = load_model_files(setup[0].gguf_path)[1]
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": ""}]}) + "\n")
    with pytest.raises(DataError, match=r"m\.jsonl:1: messages\[1\] is an assistant turn with empty content"):
        load_examples(p, tok, True, 64, "left")


def test_booleans_layers_and_warmup_written_wrong(capsys):
    assert main(["--verify", "false"]) == 1
    assert "--verify takes no value: write --verify to turn it on or --no-verify" in capsys.readouterr().err
    with pytest.raises(InjectError, match="'5-2' is reversed"):
        parse_layers("5-2", 30)
    assert parse_layers("last:10", 30) == list(range(20, 30)) and parse_layers("last:10", 2) == [0, 1]
    with pytest.raises(InjectError, match="'last:0' needs a positive count"):
        parse_layers("last:0", 30)
    with pytest.raises(ConfigError, match=r"warmup \(100\) must not exceed steps \(10\)"):
        TrainConfig(warmup=100, steps=10).validate()


def test_unknown_flag_is_one_line(capsys):
    assert main(["--stepz", "3"]) == 1
    err = capsys.readouterr().err
    assert "No such option '--stepz'" in err and "--steps" in err and "Traceback" not in err


def test_a_damaged_run_config_names_the_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"steps": 3, "rank": ')
    assert main(["--resume", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'config.json'}: not the run's settings as JSON" in err and "Traceback" not in err


@pytest.mark.parametrize("args,want", [(["--shape", "4by256"], "--shape '4by256': expected ROWSxTOKENS"),
                                       (["--targets", "qk"], "--targets 'qk': expected qv, all or qv,all")])
def test_bench_train_shape_and_targets_are_one_line_errors(args, want):
    p = vkdsl(["bench", "train", "--plan", *args])
    assert p.returncode != 0 and want in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("args,want", [
    (["generate", "--prompt", "hi", "--max-new-tokens", "-1"], "'--max-new-tokens': -1 is not in the range x>=0"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "'--temperature': -1.0 is not in the range x>=0.0"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "'--temperature': 'nan' is not a finite number"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "'--top-p': 0.0 is not in the range 0.0<x<=1.0"),
    (["generate", "--prompt", "hi", "--top-p", "1.5"], "'--top-p': 1.5 is not in the range 0.0<x<=1.0"),
    (["generate", "--prompt", "hi", "--top-p", "nan"], "'--top-p': 'nan' is not a finite number"),
    (["generate", "--prompt", "hi", "--seed", "-1"], "'--seed': -1 is not in the range x>=0"),
    (["bench", "matmul", "--sizes", "abc"], "'--sizes': 'abc': expected comma-separated integers >= 1"),
    (["bench", "matmul", "--sizes", "256,0"], "'--sizes': '256,0': expected comma-separated integers >= 1"),
    (["bench", "matmul", "--sizes", ""], "'--sizes': '': expected comma-separated integers >= 1"),
    (["bench", "train", "--steps", "-1"], "'--steps': -1 is not in the range x>=0"),
    (["bench", "train", "--lr", "nan"], "'--lr': 'nan' is not a finite number"),
    (["bench", "train", "--lr", "0"], "'--lr': 0.0 is not in the range x>0.0"),
    (["bench", "parallel", "--steps", "0"], "'--steps': 0 is not in the range x>=1")],
    ids=lambda a: "_".join(a) if isinstance(a, list) else None)
def test_numeric_options_out_of_range_are_refused_before_any_work(args, want):
    # once a sampler's nan probabilities, a negative seed's numpy message, a matmul with no rows
    # or a benchmark row of inf seconds; now click refuses the value, naming the option
    from click.testing import CliRunner
    from vkdsl.cli import main as vkdsl_main
    res = CliRunner().invoke(vkdsl_main, args)
    assert res.exit_code == 2 and want in res.output and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("kw,want", [({"max_new": -1}, "max_new -1: expected >= 0"),
                                     ({"temperature": float("nan")}, "temperature nan: expected a finite"),
                                     ({"temperature": float("inf")}, "temperature inf: expected a finite"),
                                     ({"top_p": 0.0}, "top_p 0.0: expected 0 < top_p <= 1"),
                                     ({"top_p": float("nan")}, "top_p nan: expected 0 < top_p <= 1"),
                                     ({"seed": -2}, "seed -2: expected >= 0")])
def test_generate_refuses_bad_sampling_settings_before_any_work(tiny_model, kw, want):
    from vkdsl.models import load_checkpoint
    from vkdsl.models.generate import Generator
    from vkdsl.models.llama import Llama
    gen = Generator(Llama(load_checkpoint(tiny_model.gguf_path)), 16)
    args = {"max_new": 2, **kw}
    with pytest.raises(ValueError, match=re.escape(want)):
        gen.generate([1, 2, 3], args.pop("max_new"), **args)


@pytest.mark.parametrize("field,value,want", [
    ("seed", -1, "seed must be >= 0"), ("data_seed", -1, "data_seed must be >= 0"),
    ("eval_batch", 0, "eval_batch must be >= 1"),
    ("merge_check_rows", -1, "merge_check_rows must be >= 0"),
    ("gate_heldout_acc", 2.0, "gate_heldout_acc must be in [0, 1]"),
    ("gate_dpo_pair_acc", -0.5, "gate_dpo_pair_acc must be in [0, 1]"),
    ("gate_preservation", -1.0, "gate_preservation must be >= 0"),
    ("gate_merge", -0.01, "gate_merge must be >= 0")])
def test_settings_a_run_could_not_use_are_refused_before_it_starts(field, value, want):
    # each once went through: numpy's "expected non-negative integer" for a seed, a matmul with
    # no rows (eval_batch 0), a 256 MB buffer from rows[:-1], or a gate that could never pass
    with pytest.raises(ConfigError, match=re.escape(f"config: {want}")):
        TrainConfig(**{field: value}).validate()
    TrainConfig(**{field: {"seed": 0, "data_seed": 0, "eval_batch": 1, "merge_check_rows": 0}.get(
        field, 0.0)}).validate()                        # the edge of each rule is allowed


@pytest.mark.parametrize("make", ["missing", "folder"])
def test_an_unreadable_data_file_is_named_with_why(tmp_path, make):
    path = tmp_path / "rows.jsonl"
    if make == "folder":
        path.mkdir()
    with pytest.raises(DataError, match=re.escape(f"{path}: cannot read it (")):
        load_examples(path, None, True, 64, "left")    # refused before any row needs a tokenizer


def test_a_run_folder_that_cannot_be_made_is_one_line_before_the_run(tmp_path, capsys):
    # once "[Errno 20] Not a directory: '.../afile/run'" after the model had loaded
    (tmp_path / "afile").write_text("x")
    assert main(["--out", str(tmp_path / "afile" / "run"), "--steps", "2"]) == 1
    err = capsys.readouterr().err
    assert err.strip().endswith(f"{tmp_path / 'afile' / 'run'}: cannot create this folder "
                                f"({tmp_path / 'afile'} is a file, not a folder)"), err
    assert "loaded" not in err and "Traceback" not in err


@pytest.mark.parametrize("value", [5, ["payment"], {"a": 1}, True])
def test_a_field_that_is_not_text_says_what_it_is(tmp_path, value):
    # once "field 'completion' is missing or empty" for a completion that was there, as a number
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": value}) + "\n")
    with pytest.raises(DataError, match=re.escape(
            f"{path}:1: field 'completion' is {json.dumps(value)}, expected a non-empty string")):
        load_examples(path, None, True, 64, "left")
