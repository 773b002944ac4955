"""Fuzzing every reader a user hands files to (see tests/fuzzing.py for the campaign command):
each generated input ends in the reader's own error type, with a message, or a correct result."""
import gc
import json
import os
from collections import Counter

import click
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures.train_data import tiny_setup
from fuzzing import (DEADLINE_MS, EXAMPLES, SEED_TOML, copy_folder, mutated, mutated_text, seed_pairs, seed_rows,
                     write)
from vkdsl.compiler import cache
from vkdsl.models import ModelFileError, load_model_files
from vkdsl.models.adapters import read_adapter
from vkdsl.models.safetensors_loader import read_safetensors
from vkdsl.train import checkpoint
from vkdsl.train import config as C
from vkdsl.train.checkpoint import CheckpointError
from vkdsl.train.data import DataError, load_examples
from vkdsl.train.dpo import load_pairs
from vkdsl_golden import store

FUZZ = settings(max_examples=EXAMPLES, deadline=DEADLINE_MS, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Seeds: the tiny model (GGUF and HF), its tokenizer, a trained-looking adapter, a checkpoint."""
    root = tmp_path_factory.mktemp("fuzz")
    tm, tr, he, pr = tiny_setup(root / "data")
    ck, tok = load_model_files(tm.gguf_path)
    from vkdsl.models.llama import Llama
    from vkdsl.models.adapters import save_adapter_bundle
    from vkdsl.ops.lora import LoRA
    import vkdsl
    model = Llama(ck)
    rng = np.random.default_rng(0)
    model.lora = {f"blk.0.{m}": LoRA(vkdsl.tensor(rng.standard_normal((ck.config.dim, 2)).astype(np.float32)),
                                     vkdsl.tensor(rng.standard_normal((2, ck.config.q_dim)).astype(np.float32)), 2.0)
                  for m in ("attn_q",)}
    save_adapter_bundle(model, root / "run", model_path=tm.gguf_path, tokenizer=tok, r=2, alpha=4.0)
    checkpoint.save(root / "ckpt", 2, ["blk.0.attn_q"], [np.ones((4, 2), np.float32), np.zeros((2, 4), np.float32)],
                    {"t": np.int64(2)}, {"rng": {"x": 1}, "queue": [1, 2]}, {"base_sha256": "a" * 64})
    return dict(root=root, tm=tm, tok=tok, cfg=ck.config, gguf=tm.gguf_path.read_bytes(),
                st=(tm.hf_dir / "model.safetensors").read_bytes(), peft=root / "run" / "adapter",
                lora=(root / "run" / "adapter.gguf").read_bytes(),
                ckpt=(root / "ckpt" / checkpoint.NAME).read_bytes())


COUNTS = Counter()            # reader -> inputs tried, and how many ended in the reader's error


def expect(errors, fn):
    """fn() returns, or raises one of errors with a message; anything else fails the example."""
    reader = os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].split(" ")[0]      # the test = the reader
    COUNTS[reader] += 1
    try:
        return fn()
    except errors as e:
        assert str(e).strip(), f"{type(e).__name__} without a message"
        COUNTS[reader + " (refused)"] += 1
        return None


# After the rest of the suite has run in the same process, this target's memory grows by ~0.1 GB
# per second (not seen when the fuzz file runs alone, where 10,000 inputs stay under 0.2 GB): an
# open lead. Until it is found the suite gives it 60 inputs; the campaign runs the file alone.
GGUF_EXAMPLES = EXAMPLES if "VKDSL_FUZZ_EXAMPLES" in os.environ else 60


def test_gguf_model(world):
    @settings(FUZZ, max_examples=GGUF_EXAMPLES)
    @given(st.data())
    def check(data):
        path = write(world["root"] / "m.gguf", data.draw(mutated(world["gguf"], near=6000)))
        res = expect(ModelFileError, lambda: load_model_files(path))
        if res is not None:
            assert res[0].config.n_layers >= 1
        del res
        gc.collect()                 # readers hold memory maps of the rewritten file: drop them now
    check()


def test_safetensors(world):
    @FUZZ
    @given(st.data())
    def check(data):
        path = write(world["root"] / "w.safetensors", data.draw(mutated(world["st"], near=2000)))
        res = expect(ModelFileError, lambda: read_safetensors(path))
        for dtype, shape, raw in (res or {}).values():
            assert raw.nbytes == int(np.prod(shape)) * {"F32": 4, "F16": 2, "BF16": 2}[dtype]
    check()


def test_training_jsonl(world):
    seed = seed_rows()

    @FUZZ
    @given(st.data())
    def check(data):
        path = write(world["root"] / "t.jsonl", data.draw(mutated_text(seed)))
        res = expect(DataError, lambda: load_examples(path, world["tok"], True, 64, "left"))
        for ex in res or []:
            assert len(ex.ids) == len(ex.labels) and any(label != -100 for label in ex.labels)
    check()


def test_preference_jsonl(world):
    seed = seed_pairs()

    @FUZZ
    @given(st.data())
    def check(data):
        path = write(world["root"] / "p.jsonl", data.draw(mutated_text(seed)))
        expect(DataError, lambda: load_pairs(path, world["tok"], True, 64, "left"))
    check()


def test_toml_config(world):
    @FUZZ
    @given(st.data())
    def check(data):
        path = write(world["root"] / "c.toml", data.draw(mutated_text(SEED_TOML)))
        res = expect(C.ConfigError, lambda: C.load(path))
        if res is not None:
            assert res.steps >= 1 and res.rank >= 1
    check()


def test_command_line_flags():
    from vkdsl.cli.train import parse
    words = st.sampled_from(["--steps", "--rank", "--lr", "--verify", "--no-verify", "--labels", "--betas",
                             "--layers", "--objective", "3", "-1", "0", "1e-3", "nan", "x,y", "0.9,2", "sft",
                             "--stepz", "", "=", "--rank=2", "--lr=abc"])

    @FUZZ
    @given(st.lists(words, max_size=6))
    def check(argv):
        def go():
            config_path, resume, over = parse(argv)
            return C.load(config_path, over)
        expect((C.ConfigError, click.UsageError, click.BadParameter), go)
    check()


def test_peft_adapter_folder(world):
    weights = (world["peft"] / "adapter_model.safetensors").read_bytes()
    config = (world["peft"] / "adapter_config.json").read_text()

    @FUZZ
    @given(st.data(), st.booleans())
    def check(data, in_weights):
        folder = copy_folder(world["peft"], world["root"] / "peft_fuzz")
        if in_weights:
            write(folder / "adapter_model.safetensors", data.draw(mutated(weights, near=1000)))
        else:
            write(folder / "adapter_config.json", data.draw(mutated_text(config)))
        res = expect(ModelFileError, lambda: read_adapter(folder, world["cfg"]))
        for A, B, s in (res.modules.values() if res else []):
            assert A.shape[1] == B.shape[0] and np.isfinite(s)
    check()


def test_gguf_adapter(world):
    @FUZZ
    @given(st.data())
    def check(data):
        path = write(world["root"] / "a.gguf", data.draw(mutated(world["lora"], near=3000)))
        expect(ModelFileError, lambda: read_adapter(path, world["cfg"]))
    check()


def test_checkpoint(world):
    @FUZZ
    @given(st.data())
    def check(data):
        folder = world["root"] / "ck_fuzz"
        folder.mkdir(exist_ok=True)
        write(folder / checkpoint.NAME, data.draw(mutated(world["ckpt"])))
        res = expect((CheckpointError, FileNotFoundError), lambda: checkpoint.load(folder))
        if res is not None:                 # only an unchanged (or equivalent) file may load
            meta, params, _ = res
            assert meta["step"] == 2 and [p.shape for p in params] == [(4, 2), (2, 4)]
    check()


def test_goldens(world, tmp_path_factory):
    src = store.data_dir(1)
    case = next(store.iter_cases(1, match="exp["))
    manifest = (src / store.MANIFEST).read_text()
    npz = (src / case["file"]).read_bytes()
    root = tmp_path_factory.mktemp("golden_fuzz")

    @FUZZ
    @given(st.data(), st.booleans())
    def check(data, in_manifest):
        folder = root / "v1"
        folder.mkdir(exist_ok=True)
        write(folder / case["file"], npz if in_manifest else data.draw(mutated(npz, near=400)))
        write(folder / store.MANIFEST, data.draw(mutated_text(manifest[:4000] + "]}")) if in_manifest
              else json.dumps({**json.loads(manifest), "cases": [case]}).encode())

        def go():
            return [store.load_case(c, root=root) for c in store.iter_cases(1, root=root)]
        expect(store.GoldenError, go)
    check()


def test_spirv_cache_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("VKDSL_CACHE_DIR", str(tmp_path))
    good = b"\x03\x02\x23\x07" + bytes(range(60))
    cache.store("k", good)
    entry = (tmp_path / "k.spv").read_bytes()

    @FUZZ
    @given(st.data())
    def check(data):
        write(tmp_path / "k.spv", data.draw(mutated(entry)))
        COUNTS["test_spirv_cache_entries"] += 1
        got = cache.load("k")                       # a damaged entry is dropped (None), never used
        assert got is None or got == good
        COUNTS["test_spirv_cache_entries (refused)"] += got is None
    check()


def test_zz_report_counts():
    """Last: how many inputs each reader saw and refused (written to $VKDSL_FUZZ_REPORT if set)."""
    rows = sorted(k for k in COUNTS if not k.endswith("(refused)"))
    lines = [f"{k:28s} {COUNTS[k]:7d} inputs  {COUNTS[k + ' (refused)']:7d} refused with the reader's error"
             for k in rows]
    if os.environ.get("VKDSL_FUZZ_REPORT"):
        with open(os.environ["VKDSL_FUZZ_REPORT"], "w") as f:
            f.write("\n".join(lines) + "\n")
    assert all(COUNTS[k] > 0 for k in rows)
