"""Per-device tuning (vkdsl.tuning, `vkdsl tune`): every tile the tuner may choose computes the
matmul (against numpy float64) and the default tile's bits; a tuning file from another driver or a
damaged one is ignored in one line; the command writes a file the planners then read."""
import json

import numpy as np
import pytest

from fixtures.cli import vkdsl
from vkdsl import tuning
from vkdsl.matmul import plan_matmul, record_matmul
from vkdsl.ops.quant.bench import example_weight
from vkdsl.ops.quant.formats import dequantize
from vkdsl.ops.quant.kernels import plan_qmatmul, qtile_fits, record_qmatmul
from vkdsl.ops.quant.linear import upload_weight
from vkdsl.runtime import Buffer, Recording, default_device


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VKDSL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VKDSL_TUNING", raising=False)
    monkeypatch.setattr(tuning, "SHIPPED", str(tmp_path / "shipped"))   # no shipped table either
    tuning.forget()
    yield tmp_path
    tuning.forget()


def _run(dev, plan, record, C):
    C.write(np.full(C.nbytes // 4, np.nan, np.float32))       # no output left over from another tile
    rec = Recording(dev, 1)
    record(rec, plan)
    rec.submit_wait()
    return rec


def test_every_tile_computes_the_default_tiles_bits():
    # ragged edges (37 x 100 x 40, 300 x 9 x 64): every tile clamps, masks and grids differently
    dev, rng = default_device(), np.random.default_rng(3)
    for (M, N, K), tb in (((37, 100, 40), True), ((300, 9, 64), False)):
        a = rng.standard_normal((M, K)).astype(np.float32)
        b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
        ref = a.astype(np.float64) @ (b.T if tb else b).astype(np.float64)
        A, B, C = Buffer(dev, a.nbytes), Buffer(dev, b.nbytes), Buffer(dev, 4 * M * N)
        A.write(a)
        B.write(b)
        outs = {}
        for tile in tuning.TILES:
            p = plan_matmul(dev, M=M, N=N, K=K, tb=tb, tile=tile, variant="lvp")
            _run(dev, p, lambda rec, p: record_matmul(rec, p, C, A, B), C).release()
            outs[tile] = C.read(np.float32, M * N).reshape(M, N).copy()
            err = np.abs(outs[tile] - ref).max() / np.abs(ref).max()
            assert err < 1e-5, (tile, p.name, err)
        assert all(np.array_equal(o, outs[tuning.DEFAULT_TILE]) for o in outs.values())


def test_every_qmatmul_tile_computes_the_default_tiles_bits():
    dev, rng = default_device(), np.random.default_rng(4)
    M, N, K = 45, 36, 64
    w = rng.standard_normal((N, K)).astype(np.float32)
    qw = example_weight("q4_1", w)
    wd = dequantize(qw).astype(np.float64)            # the format's own values, independent of the kernel
    qbufs = upload_weight(dev, qw)
    for form in ("nt", "nn"):
        rows, cols, red = (M, N, K) if form == "nt" else (M, K, N)
        x = rng.standard_normal((rows, red)).astype(np.float32)
        ref = x.astype(np.float64) @ (wd.T if form == "nt" else wd)
        X, C = Buffer(dev, x.nbytes), Buffer(dev, 4 * rows * cols)
        X.write(x)
        outs = {}
        for tile in (t for t in tuning.TILES if qtile_fits(t, form)):
            p = plan_qmatmul(dev, "q4_1", M=M, N=N, K=K, form=form, tile=tile, variant="lvp")
            _run(dev, p, lambda rec, p: record_qmatmul(rec, p, C, X, *qbufs), C).release()
            outs[tile] = C.read(np.float32, rows * cols).reshape(rows, cols).copy()
            assert np.abs(outs[tile] - ref).max() / np.abs(ref).max() < 1e-5, (form, tile, p.name)
        assert len(outs) >= 3 and all(np.array_equal(o, outs[tuning.DEFAULT_TILE]) for o in outs.values())


def _plant(dev, data) -> str:
    path = tuning.path(dev)
    import os
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("how", ["not json", "another driver", "another CPU", "a tile no kernel has"])
def test_a_foreign_or_damaged_tuning_file_is_ignored_in_one_line(own_cache, capsys, how):
    dev = default_device()
    good = {"format": 1, "identity": tuning.identity(dev),
            "entries": {tuning.shape_class("matmul", "nt", 64, 8, 64): {"tile": [8, 8]}}}
    data = {"not json": "{\"format\": 1, ", "another driver": {**good, "identity": {**good["identity"], "driver_info": "Mesa 0.1"}},
            "another CPU": {**good, "identity": {**good["identity"], "cpu": "GenuineIntel Some Other CPU"}},
            "a tile no kernel has": {**good, "entries": {"x": {"tile": [3, 5]}}}}[how]
    path = _plant(dev, data)
    assert plan_matmul(dev, M=64, N=8, K=64, tb=True).name == "matmul_nt_lvp_t4s4"    # the default
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"vkdsl: ignoring the tuning file {path} (")
    tuning.forget()
    _plant(dev, good)                                   # the same entry, measured here: used
    assert plan_matmul(dev, M=64, N=8, K=64, tb=True).name == "matmul_nt_lvp_t4s4_8x8"


def test_tune_writes_what_the_planners_then_read(own_cache, monkeypatch):
    p = vkdsl(["tune", "--shape", "matmul:nt:256x8x64", "--shape", "qmatmul:q4_1:nt:64x64x64", "--rounds", "2"],
              VKDSL_CACHE_DIR=str(own_cache))
    assert p.returncode == 0, p.stderr
    assert "tuned 2 shape classes" in p.stdout
    dev = default_device()
    e = tuning.entries(dev)
    key = tuning.shape_class("matmul", "nt", 256, 8, 64)
    tile = tuple(e[key]["tile"])
    name = plan_matmul(dev, M=200, N=8, K=60, tb=True).name      # the same class
    assert name.endswith("" if tile == tuning.DEFAULT_TILE else f"_{tile[0]}x{tile[1]}")
    monkeypatch.setenv("VKDSL_TUNING", "0")
    assert plan_matmul(dev, M=200, N=8, K=60, tb=True).name == "matmul_nt_lvp_t4s4"
    show = vkdsl(["tune", "--show"], VKDSL_CACHE_DIR=str(own_cache))
    assert key in show.stdout and "2 shape classes" in show.stdout


def test_a_shipped_table_serves_its_driver_build_and_cpu_vendor_and_a_local_file_overrides_it(
        own_cache, monkeypatch, capsys):
    dev = default_device()
    here, ident = tuning.identity(dev), tuning.shipped_identity(dev)
    assert ident == {**{k: v for k, v in here.items() if k != "cpu"},
                     **({"cpu": here["cpu"].split()[0]} if "cpu" in here else {})}
    a, b = tuning.shape_class("matmul", "nt", 64, 8, 64), tuning.shape_class("matmul", "nn", 64, 8, 64)
    table = {"format": 1, "identity": ident, "entries": {a: {"tile": [8, 8]}, b: {"tile": [8, 16]}}}
    shipped = own_cache / "shipped" / tuning.shipped_path(dev).rsplit("/", 1)[-1]
    shipped.parent.mkdir()
    foreign = {"another build": {**ident, "driver_info": "Mesa 0.1"}}
    if "cpu" in ident:
        foreign["another vendor"] = {**ident, "cpu": "OtherVendor"}
    for what, other in foreign.items():                 # at this build's path: one line, defaults
        shipped.write_text(json.dumps({**table, "identity": other}))
        tuning.forget()
        assert plan_matmul(dev, M=64, N=8, K=64, tb=True).name == "matmul_nt_lvp_t4s4", what
        assert capsys.readouterr().err.count("ignoring the tuning file") == 1, what
    if "cpu" in ident:                                  # another vendor's table, under its own name
        shipped.unlink()
        theirs = shipped.name.replace(f"-{ident['cpu']}.json", "-OtherVendor.json")
        (shipped.parent / theirs).write_text(json.dumps({**table, "identity": foreign["another vendor"]}))
        tuning.forget()
        assert plan_matmul(dev, M=64, N=8, K=64, tb=True).name == "matmul_nt_lvp_t4s4"
        assert capsys.readouterr().err == ""            # not an error: it is not this machine's table
        from vkdsl.cli.doctor import _tuning
        assert _tuning(dev) == ("none", "default tiles; `vkdsl tune --for \"COMMAND\"` measures a "
                                "job's shapes here; this driver build ships tables for OtherVendor CPUs")
    shipped.write_text(json.dumps(table))
    tuning.forget()
    assert plan_matmul(dev, M=64, N=8, K=64, tb=True).name == "matmul_nt_lvp_t4s4_8x8"
    assert plan_matmul(dev, M=64, N=8, K=64).name == "matmul_nn_lvp_t4s4_8x16"
    tuning.forget()
    _plant(dev, {**table, "identity": here, "entries": {a: {"tile": [16, 16]}}})   # measured here: it wins
    assert plan_matmul(dev, M=64, N=8, K=64, tb=True).name == "matmul_nt_lvp_t4s4_16x16"
    assert plan_matmul(dev, M=64, N=8, K=64).name == "matmul_nn_lvp_t4s4_8x16"
    tuning.save(dev, {})                                # the local file never takes in the shipped entries
    assert json.loads(open(tuning.path(dev)).read())["entries"] == {a: {"tile": [16, 16]}}
    monkeypatch.setenv("VKDSL_TUNING", "0")
    assert plan_matmul(dev, M=64, N=8, K=64).name == "matmul_nn_lvp_t4s4"


def test_each_shipped_table_names_the_vendor_its_file_names():
    # the reference machines' tables (vkdsl/tuned): one file per driver build and CPU vendor
    import glob
    import os
    vendors = []
    for f in glob.glob(os.path.join(tuning.SHIPPED, "*.json")):
        vendor = json.load(open(f))["identity"]["cpu"]
        assert f.endswith(f"-{vendor}.json")
        vendors.append(vendor)
    assert "AuthenticAMD" in vendors


def test_cpu_names_the_vendor_and_model_of_proc_cpuinfo():
    field = {}
    for line in open("/proc/cpuinfo").read().splitlines():      # the first processor's fields
        k, sep, v = line.partition(":")
        if sep and k.strip() not in field:
            field[k.strip()] = v.strip()
    assert tuning.cpu() == f"{field['vendor_id']} {field['model name']}"


@pytest.mark.parametrize("arg", ["matmul:nt:8x8", "qmatmul:q4_1:tn:8x8x8", "conv:nt:8x8x8",
                                 "matmul:nn:0x8x8"])
def test_a_bad_shape_is_one_line(arg):
    p = vkdsl(["tune", "--shape", arg])
    assert p.returncode == 2 and "expected OP:FORM:MxNxK" in p.stderr and "Traceback" not in p.stderr
