"""Trainer config and data: unknown keys/flags, bad values, JSONL errors with file:line,
masking of prompt vs completion tokens, truncation, batching, preflight data checks."""
import json

import click
import pytest

from vkdsl.cli.train import parse
from vkdsl.models import load_model_files
from vkdsl.train import config as C
from vkdsl.train.data import (IGNORE, DataError, Example, Sampler, check_batches, collate, encode_row,
                              load_examples)
from vkdsl.train.schedule import checkpoints, sft_lr as lr_at


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_model_files(tiny_model.gguf_path)[1]


def test_unknown_toml_key(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('lr = 0.01\nlearning_rat = 3\n')
    with pytest.raises(C.ConfigError, match="learning_rat"):
        C.load(p)


def test_unknown_flag_and_bad_value():
    with pytest.raises(C.ConfigError, match="unknown setting 'stepz'"):
        C.load(None, {"stepz": 3})
    with pytest.raises(click.NoSuchOption, match="stepz"):
        parse(["--stepz", "3"])
    with pytest.raises(C.ConfigError, match="steps"):
        C.load(None, {"steps": "many"})
    with pytest.raises(C.ConfigError, match="truncation_side"):
        C.load(None, {"truncation_side": "middle"})


def test_flags_override_toml(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('steps = 7\nrank = 2\ntargets = ["q_proj"]\n')
    path, resume, over = parse(["--config", str(p), "--rank=3", "--no-verify", "--quiet",
                                        "--targets", "attn_q,v_proj"])
    cfg = C.load(path, over)
    assert (cfg.steps, cfg.rank, cfg.verify, cfg.quiet, cfg.targets) == (7, 3, False, True, ["attn_q", "v_proj"])
    assert json.loads(cfg.dumps())["rank"] == 3


def test_toml_files_are_relative_to_the_toml(tmp_path):
    (tmp_path / "cfg").mkdir()
    p = tmp_path / "cfg" / "c.toml"
    p.write_text('train_file = "../data/t.jsonl"\nheldout_file = "/abs/h.jsonl"\nout = "runs/x"\n')
    cfg = C.load(p)
    assert cfg.train_file == str(tmp_path / "cfg" / "../data/t.jsonl") and cfg.heldout_file == "/abs/h.jsonl"
    assert cfg.out == "runs/x"                        # the run folder stays relative to where it runs


def test_the_example_config_names_files_that_exist():
    from pathlib import Path
    cfg = C.load(Path(__file__).parent.parent / "examples" / "priority.toml")
    for f in ("train_file", "heldout_file", "dpo_train_file", "dpo_heldout_file"):
        assert Path(getattr(cfg, f)).is_file(), f


def test_lr_schedule_values():
    cfg = C.TrainConfig(lr=1e-3, warmup=10, steps=110, min_lr_ratio=0.1)
    assert lr_at(5, cfg) == pytest.approx(5e-4)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(1e-4 + 0.9e-3 * 0.5)          # half way down the cosine
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    assert [s for _, s, _ in checkpoints(cfg)] == [10, 28, 55, 82, 110]


def test_malformed_json_names_file_and_line(tmp_path, tok):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "a", "completion": }\n')
    with pytest.raises(DataError, match=r"d\.jsonl:3: malformed JSON"):
        load_examples(p, tok, True, 64, "left")


def test_missing_or_empty_fields(tmp_path, tok):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "completion": ""}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:1: field 'completion' is missing or empty"):
        load_examples(p, tok, True, 64, "left")
    p.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(DataError, match="no assistant message"):
        load_examples(p, tok, True, 64, "left")


def test_prompt_leaves_no_room(tok):
    obj = {"prompt": "the " * 40, "completion": "ok"}
    with pytest.raises(DataError, match="leaves no room for the completion at max_len=16"):
        encode_row(obj, tok, False, 16, "right", "f.jsonl:9")
    ex = encode_row(obj, tok, False, 16, "left", "f.jsonl:9")          # left truncation keeps the completion
    assert ex.truncated and len(ex.ids) == 16
    assert tok.decode([t for t in ex.labels if t != IGNORE]).startswith("ok")


def test_chat_mask_covers_assistant_and_end_of_turn(tok):
    obj = {"messages": [{"role": "user", "content": "Is it down?"}, {"role": "assistant", "content": "high"}]}
    ex = encode_row(obj, tok, True, 200, "left", "x:1")
    sup = [t for t in ex.labels if t != IGNORE]
    assert tok.decode(sup) == "high<|im_end|>"                        # the model learns to stop
    assert sup[-1] == tok.eos_id
    # labels are next-token targets: where supervised, label[i] == ids[i+1]
    for i, t in enumerate(ex.labels[:-1]):
        if t != IGNORE:
            assert t == ex.ids[i + 1]


def test_a_row_system_turn_replaces_the_default(tok):
    plain = encode_row({"prompt": "Is it down?", "completion": "high"}, tok, True, 200, "left", "x:1")
    own = encode_row({"prompt": "Is it down?", "completion": "high", "system": "Route tickets."}, tok, True, 200,
                     "left", "x:2")
    assert "named SmolLM" in tok.decode(plain.ids) and "named SmolLM" not in tok.decode(own.ids)
    assert tok.decode(own.ids).startswith("<|im_start|>system\nRoute tickets.<|im_end|>")
    assert [t for t in own.labels if t != IGNORE] == [t for t in plain.labels if t != IGNORE]
    with pytest.raises(DataError, match="x:3: field 'system' needs a chat template"):
        encode_row({"prompt": "a", "completion": "b", "system": "s"}, tok, False, 200, "left", "x:3")
    with pytest.raises(DataError, match="x:4: field 'system' is missing or empty"):
        encode_row({"prompt": "a", "completion": "b", "system": ""}, tok, True, 200, "left", "x:4")


def test_collate_pads_to_bucket_and_masks(tok):
    rows = [Example([5, 6, 7], [6, 7, IGNORE], "", "a"), Example([5] * 20, [IGNORE] * 19 + [9], "", "b")]
    ids, lab = collate(rows, tok.pad_id, 16, 64)
    assert ids.shape == (2, 32) and (ids[0, 3:] == tok.pad_id).all() and (lab[0, 2:] == IGNORE).all()
    assert lab[1, 19] == 9


def test_preflight_names_unsupervised_rows():
    rows = [Example([1, 2], [2, IGNORE], "", "t.jsonl:1"), Example([1, 2], [IGNORE, IGNORE], "", "t.jsonl:2")]
    with pytest.raises(DataError, match=r"t\.jsonl:2"):
        check_batches(rows)


def test_sampler_state_roundtrip():
    ex = [Example([1] * (i + 2), [1] * (i + 2), "", str(i)) for i in range(10)]
    a = Sampler(ex, 3, seed=5)
    [a.next() for _ in range(4)]
    st = json.loads(json.dumps(a.state()))
    b = Sampler(ex, 3, seed=99)
    b.set_state(st)
    assert [a.next() for _ in range(6)] == [b.next() for _ in range(6)]
    c = Sampler(ex, 2, 0)
    assert sorted(sum((c.next() for _ in range(5)), [])) == list(range(10))     # one epoch = each row once


def test_wilson_interval_known_values():
    from vkdsl.train.evidence import wilson
    lo, hi = wilson(8, 10)                       # textbook values (Newcombe 1998 style): 0.490, 0.943
    assert (round(lo, 3), round(hi, 3)) == (0.490, 0.943)
    lo, hi = wilson(0, 20)
    assert lo == 0.0 and hi == pytest.approx(0.1611, abs=1e-4)
