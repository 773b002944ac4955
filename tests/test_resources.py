"""Resource faults: a model that does not fit the device's memory budget is refused before any of
it is allocated, naming the bytes needed and left; a long run keeps host RSS and device bytes flat."""
import os
import subprocess
import sys

import numpy as np
import pytest

from fixtures.train_data import tiny_cfg, tiny_setup
from vkdsl.models import load_model_files
from vkdsl.models.llama import Llama
from vkdsl.runtime import DeviceMemoryError, default_device
from vkdsl.train.inject import inject, params_of
from vkdsl.train.step import Stepper


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_setup(tmp_path_factory.mktemp("tiny_res"))


def test_a_model_over_the_budget_is_refused_before_allocating(setup, monkeypatch):
    ck, _ = load_model_files(setup[0].gguf_path)
    from vkdsl.runtime import context
    monkeypatch.setattr(context, "RECLAIM", [])   # other tests' cached programs stay where they are
    dev = default_device()
    before = dev.allocated_bytes
    monkeypatch.setenv("VKDSL_DEVICE_MEMORY_LIMIT", str(before + 4096))
    with pytest.raises(DeviceMemoryError, match=r"model tiny\.gguf \(quant keep\) needs [\d.]+ MiB .* left of a"):
        Llama(ck)
    assert dev.allocated_bytes == before                     # nothing half-allocated


def test_the_command_line_says_it_in_one_line(setup):
    p = subprocess.run([sys.executable, "-m", "vkdsl.cli", "info", "--model", str(setup[0].gguf_path)],
                       capture_output=True, text=True, env={**os.environ, "VKDSL_DEVICE_MEMORY_LIMIT": "1K"},
                       timeout=120)
    assert p.returncode == 1 and "needs" in p.stderr and "MiB" in p.stderr and "Traceback" not in p.stderr


# Steps of the flat-memory test: 600 in the suite; VKDSL_MEMORY_STEPS=2000 for the campaign.
MEMORY_STEPS = int(os.environ.get("VKDSL_MEMORY_STEPS", "600"))


def test_a_long_run_keeps_memory_flat(setup):
    ck, _ = load_model_files(setup[0].gguf_path)
    model = Llama(ck)
    cfg = tiny_cfg(setup, tmkl=0.1, lr=1e-3)
    names = inject(model, cfg)
    params = params_of(model, names)
    st = Stepper(model, params, cfg)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 300, (4, 16)).astype(np.int32)
    lab = np.where(np.arange(16) >= 12, ids, -100).astype(np.int32)
    dev = default_device()
    first, span = 100, MEMORY_STEPS - 100
    marks = {}
    for step in range(1, MEMORY_STEPS + 1):
        st.step([(ids, lab)], cfg.lr)
        if step in (first, MEMORY_STEPS):
            marks[step] = (rss_bytes(), dev.allocated_bytes)
    (rss0, dev0), (rss1, dev1) = marks[first], marks[MEMORY_STEPS]
    assert dev1 == dev0, f"device bytes grew by {dev1 - dev0} over {span} steps"
    # under 18 KiB a step: 32 MiB over 1800 steps
    assert rss1 - rss0 < 32 * 2**20 * span / 1800, f"host RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB over {span} steps"


def test_bench_train_says_which_case_does_not_fit_and_frees_each_case(setup, monkeypatch):
    # `vkdsl bench train` on a device whose budget holds one case's program but not the larger one:
    # the smaller case runs, the other is a "does not fit" row, and no case's buffers outlive it
    from vkdsl.train.bench import bench_sft
    ck, _ = load_model_files(setup[0].gguf_path)
    model = Llama(ck)
    w = {k: v.astype(np.float32) for k, v in ck.dequantized().items()}
    dev = default_device()
    import gc
    gc.collect()                                      # earlier tests' garbage must not count as this one's
    before = dev.allocated_bytes
    rows = bench_sft(model, w, B=2, T=16)
    assert all("error" not in r for r in rows) and dev.allocated_bytes == before
    qv, seven = rows[0]["device_peak_bytes"] - before, rows[1]["device_peak_bytes"] - before
    assert 0 < qv < seven
    monkeypatch.setenv("VKDSL_DEVICE_MEMORY_LIMIT", str(before + (qv + seven) // 2))
    rows = bench_sft(model, w, B=2, T=16)
    assert "error" not in rows[0] and rows[1]["error"].startswith("does not fit: ")
    assert "MiB left of a" in rows[1]["error"] and dev.allocated_bytes == before


def test_bench_train_times_the_trainers_own_step(setup, monkeypatch):
    # the bench must run the objects vkdsl-train runs: the loop's one_step over the Stepper's
    # gradient (SFT) and over DpoObjective (DPO), with the loop's clip + AdamW + write-back
    from vkdsl.train import bench, dpo, loop
    seen = []

    def spy(cls_or_mod, name):
        real = getattr(cls_or_mod, name)

        def wrapped(*a, **k):
            seen.append((name, type(a[0]).__name__ if name == "gradient" else ""))
            return real(*a, **k)
        monkeypatch.setattr(cls_or_mod, name, wrapped)
    spy(Stepper, "gradient")
    spy(dpo.DpoObjective, "gradient")
    spy(loop, "apply")          # the name the loop calls
    ck, _ = load_model_files(setup[0].gguf_path)
    model = Llama(ck)
    w = {k: v.astype(np.float32) for k, v in ck.dequantized().items()}
    rows = bench.bench_sft(model, w, B=2, T=16)
    assert [r["case"] for r in rows[:2]] == ["sft 2x16, adapters on q,v (trainer step)",
                                             "sft 2x16, adapters on all seven (trainer step)"]
    assert seen.count(("gradient", "Stepper")) == 2 * 3 and seen.count(("apply", "")) == 2 * 3   # warm-up + best of 2
    # the trainer's step moves the adapters: the loss of the same batch falls from the first step on
    assert rows[0]["loss_last"] < rows[0]["loss_first"]
    seen.clear()
    d = bench.bench_dpo(model, P=2, T_prompt=8, T_resp=8)
    assert seen == [("gradient", "DpoObjective"), ("apply", "")] * 3 and d[0]["pairs_per_s"] > 0
