"""Row packing (train.packing): the placement and its maps, checked against a direct construction;
a row scores the same packed as alone (positions restart, attention never crosses rows) through
both attention paths; and the trainer's step gives the same loss and gradients packed or padded,
with TMKL's cached base logits and the frozen prefix moved into the packed layout."""
import numpy as np
import pytest

import vkdsl
from vkdsl.models import load_model_files
from vkdsl.models.llama import Llama
from vkdsl.train.config import TrainConfig
from vkdsl.train.inject import inject, params_of
from vkdsl.train.packing import Packing
from vkdsl.train.prefix import FrozenPrefix
from vkdsl.train.step import Stepper
from fixtures.synthetic import build_tiny

IGN = -100


def test_plan_places_rows_first_fit_and_maps_positions():
    pk = Packing.plan([5, 3, 7, 2], 8)
    assert pk.place == [(0, 0), (0, 5), (1, 0), (2, 0)] and pk.n_seq == 3 and pk.packed
    assert pk.positions().tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 0], [0, 1, 0, 0, 0, 0, 0, 0]]
    starts = [[0, 0, 0, 0, 0, 5, 5, 5], [0, 0, 0, 0, 0, 0, 0, 7], [0, 0, 2, 3, 4, 5, 6, 7]]
    ends = [[5, 5, 5, 5, 5, 8, 8, 8], [7, 7, 7, 7, 7, 7, 7, 8], [2, 2, 3, 4, 5, 6, 7, 8]]
    assert pk.spans()[..., 0].tolist() == starts and pk.spans()[..., 1].tolist() == ends
    lab = np.full((4, 8), IGN, np.int32)
    lab[0, 2:4], lab[1, 1:3], lab[2, 6], lab[3, 0] = [10, 11], [20, 21], 30, 40
    order = pk.supervised_order(lab)
    padded = lab.reshape(-1)[lab.reshape(-1) != IGN]
    packed = pk.apply(lab, IGN).reshape(-1)
    assert padded[order].tolist() == packed[packed != IGN].tolist() == [10, 11, 20, 21, 30, 40]
    assert not Packing.plan([5, 6], 8).packed
    with pytest.raises(ValueError, match="does not fit"):
        Packing.plan([9], 8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny_pack"), seed=5)


def rows_of(lengths, T, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), T), np.int32)
    lab = np.full((len(lengths), T), IGN, np.int32)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(3, 300, n)
        lab[b, n // 2:n - 1] = ids[b, n // 2 + 1:n]          # the row's second half is supervised
    return ids, lab, np.array(lengths)


@pytest.mark.parametrize("T,lengths", [(12, [5, 7, 3, 9]), (32, [20, 9, 12, 3, 30])],
                         ids=["composite attention", "fused attention"])
def test_a_row_scores_the_same_packed_or_alone(tiny, T, lengths):
    m = Llama(load_model_files(tiny.gguf_path)[0])
    ids, _, lens = rows_of(lengths, T)
    pk = Packing.plan(lens, T)
    assert pk.packed
    out = m.forward(vkdsl.tensor(pk.apply(ids, 0)), positions=vkdsl.tensor(pk.positions()),
                    spans=vkdsl.tensor(pk.spans())).numpy()
    for b, ((s, o), n) in enumerate(zip(pk.place, lens)):
        alone = m.forward(vkdsl.tensor(ids[b:b + 1, :n])).numpy()[0]
        np.testing.assert_allclose(out[s, o:o + n], alone, rtol=0, atol=1e-5 * np.abs(alone).max())


def test_a_row_loss_is_the_same_packed_in_a_4096_window_or_alone(tmp_path):
    """Four conversations-length rows packed into one 4096-token window (fused attention with row
    spans): each row's summed cross-entropy equals its own forward's, to 1e-5 relative."""
    m = Llama(load_model_files(build_tiny(tmp_path, seed=6, context_length=4096).gguf_path)[0])
    T, lengths = 4096, [1500, 1100, 900, 560]
    ids, lab, lens = rows_of(lengths, T, seed=2)
    pk = Packing.plan(lens, T)
    assert pk.n_seq == 1 and pk.lengths.sum() == 4060
    logits = m.forward(vkdsl.tensor(pk.apply(ids, 0)), positions=vkdsl.tensor(pk.positions()),
                       spans=vkdsl.tensor(pk.spans())).numpy()[0]

    def ce(lg, labels):                                   # float64, from the logits
        lg = lg.astype(np.float64)
        live = labels != IGN
        lse = np.log(np.exp(lg - lg.max(1, keepdims=True)).sum(1)) + lg.max(1)
        return float((lse[live] - lg[live, labels[live]]).sum())
    for b, ((_, o), n) in enumerate(zip(pk.place, lens)):
        alone = m.forward(vkdsl.tensor(ids[b:b + 1, :n])).numpy()[0]
        assert ce(logits[o:o + n], lab[b, :n]) == pytest.approx(ce(alone, lab[b, :n]), rel=1e-5)


def stepper(tiny, pack, prefix_layer=0, **kw):
    m = Llama(load_model_files(tiny.gguf_path)[0])
    cfg = TrainConfig(**{**dict(targets=["attn_q", "attn_v", "ffn_down"], rank=4, alpha=8.0, lr=0.05, clip=0.0,
                                pack=pack), **kw})
    if prefix_layer:
        cfg.layers = f"{prefix_layer}-1"
    params = params_of(m, inject(m, cfg))
    prefix = FrozenPrefix(m, prefix_layer, 1 << 20) if prefix_layer else None
    return Stepper(m, params, cfg, prefix), params


@pytest.mark.parametrize("tmkl,prefix_layer,window", [(0.0, 0, 0), (0.3, 0, 0), (0.3, 1, 0), (0.3, 1, 48)],
                         ids=["plain", "tmkl cached", "tmkl cached + frozen prefix", "one 48-token window"])
def test_the_step_is_the_same_packed_or_padded(tiny, tmkl, prefix_layer, window):
    ids, lab, lens = rows_of([20, 9, 12, 3], 32, seed=1)
    got = {}
    for pack in (False, True):
        win = dict(window=window, batch_size=1) if pack and window else {}     # one window a micro-batch
        st, params = stepper(tiny, pack, prefix_layer, tmkl=tmkl, **win)
        recs = [st.step([(ids, lab, lens)], 0.05) for _ in range(2)]     # step 2: A and TMKL live
        got[pack] = recs, [p.numpy() for p in params]
    (padded, p_pad), (packed, p_pack) = got[False], got[True]
    assert packed[0]["computed"] == (window or 2 * 32) < padded[0]["computed"] == 4 * 32
    for a, b in zip(packed, padded):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["tmkl"] == pytest.approx(b["tmkl"], rel=1e-4, abs=1e-7)
        for x, y in zip(a["raw_grads"], b["raw_grads"]):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4 * np.abs(y).max())
    for x, y in zip(p_pack, p_pad):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-4 * 0.05)


def conversation_lengths(n, seed):
    """Token counts of n multi-turn conversations: mostly short exchanges, a long tail up to 3.9k
    (a log-uniform mix, as chat data has)."""
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(40), np.log(3900), n)).astype(int)


def test_window_sampler_packs_an_epoch_of_600_conversations_at_95_percent(tmp_path):
    from vkdsl.train.data import Example, WindowSampler
    lengths = conversation_lengths(600, seed=3)
    rows = [Example([1] * n, [1] * n, f"row {i}", "") for i, n in enumerate(lengths)]
    ws = WindowSampler(rows, 2, seed=7, window=4096)
    epoch = []
    while sum(len(w) for w in epoch) < len(rows):
        epoch += ws.next()
    assert sorted(i for w in epoch for i in w) == list(range(len(rows)))          # each row once
    assert max(sum(lengths[i] for i in w) for w in epoch) <= 4096
    real = lengths.sum() / (len(epoch) * 4096)
    assert real >= 0.95 and ws.utilization() == pytest.approx(real)
    # a resumed order continues exactly: its state survives JSON
    import json
    st = json.loads(json.dumps(ws.state()))
    again = WindowSampler(rows, 2, seed=0, window=4096)
    again.set_state(st)
    assert again.next() == ws.next()


def test_windows_place_each_row_in_a_sequence_no_later_than_its_window():
    """First-fit over rows listed window by window never needs more sequences than windows."""
    from vkdsl.train.data import Example, WindowSampler
    lengths = conversation_lengths(300, seed=4)
    ws = WindowSampler([Example([1] * n, [1] * n, "", "") for n in lengths], 4, seed=1, window=4096)
    for _ in range(20):
        windows = ws.next()
        pk = Packing.plan([lengths[i] for w in windows for i in w], 4096)
        assert pk.n_seq <= len(windows)
