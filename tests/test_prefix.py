"""The frozen-prefix cache (train.prefix): with adapters only on layers >= L, feeding the cached
output of layers 0..L-1 trains and scores exactly as the whole model does, whatever the padding."""
import numpy as np
import pytest

from vkdsl.models import load_model_files
from vkdsl.models.llama import Llama
from vkdsl.train.config import TrainConfig
from vkdsl.train.data import Example
from vkdsl.train.scoring import Scorer
from vkdsl.train.inject import inject, params_of
from vkdsl.train.prefix import FrozenPrefix, first_adapted_layer
from vkdsl.train.step import Stepper
from fixtures.synthetic import build_tiny
from fixtures.train_data import batch

IGN = -100


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny_prefix"), seed=5)


def adapted(tiny, budget, **kw):
    m = Llama(load_model_files(tiny.gguf_path)[0])
    cfg = TrainConfig(**{**dict(targets=["attn_q", "attn_v", "ffn_down"], layers="1", rank=4, alpha=8.0, lr=0.05,
                                clip=0.0, prefix_cache_bytes=budget), **kw})
    names = inject(m, cfg)
    start = first_adapted_layer(names)
    assert start == 1
    return m, params_of(m, names), cfg, FrozenPrefix(m, start, budget)


@pytest.mark.parametrize("tmkl", [0.0, 0.5])
def test_training_from_the_prefix_equals_the_whole_model(tiny, tmkl):
    runs = {}
    for budget in (0, 1 << 30):
        m, params, cfg, prefix = adapted(tiny, budget, tmkl=tmkl)
        st = Stepper(m, params, cfg, prefix)
        ids, lab = batch(B=4, seed=2)
        recs = [st.step([(ids[:2], lab[:2]), (ids[2:], lab[2:])], cfg.lr) for _ in range(3)]
        runs[budget] = ([p.numpy() for p in params], recs, prefix)
    (p0, r0, off), (p1, r1, on) = runs[0], runs[1 << 30]
    assert off.start == 0 and on.start == 1
    assert on.misses == 2 and on.hits == 8 and on.bytes > 0      # 2 micro-batches computed once, then reused
    for a, b in zip(r0, r1):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["tmkl"] == pytest.approx(b["tmkl"], rel=1e-4, abs=1e-7)
    for a, b in zip(p0, p1):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_cached_row_is_exact_under_other_padding(tiny):
    # the same rows padded to another length (and batched with others) hit the cache and score the same
    m, params, cfg, prefix = adapted(tiny, 1 << 30)
    rng = np.random.default_rng(9)
    rows = []
    for n in (7, 11, 13):
        ids = [int(t) for t in rng.integers(3, 300, n)]
        lab = [IGN] * (n - 3) + ids[n - 3:]
        rows.append(Example(ids, lab, "", f"row{n}"))
    plain = Scorer(m, 0, 4, 32, 2)
    cached = Scorer(m, 0, 4, 32, 2, prefix)
    want = plain.row_logprobs(rows)
    first = cached.row_logprobs(rows)
    misses = prefix.misses
    again = Scorer(m, 0, 16, 32, 3, prefix).row_logprobs(rows[::-1])[::-1]   # other bucket, batch, order
    assert prefix.misses == misses and prefix.hits > 0
    for (w, n), (a, k), (b, j) in zip(want, first, again):
        assert n == k == j
        assert a == pytest.approx(w, rel=1e-5) and b == pytest.approx(w, rel=1e-5)


def test_over_budget_recomputes(tiny):
    m, params, cfg, prefix = adapted(tiny, 1)
    st = Stepper(m, params, cfg, prefix)
    ids, lab = batch(B=2, seed=4)
    st.step([(ids, lab)], cfg.lr)
    st.step([(ids, lab)], cfg.lr)
    assert prefix.bytes == 0 and prefix.misses == 2 and prefix.hits == 0


def test_merged_check_from_the_prefix(tiny):
    # merged-vs-separate logits starting at the first adapted layer equal the whole-model check
    from vkdsl.train.evidence import merged_check
    import vkdsl
    m, params, cfg, prefix = adapted(tiny, 1 << 30)
    rng = np.random.default_rng(3)
    for p in params:                                  # a non-zero update, so the merge matters
        p.assign(vkdsl.tensor(rng.normal(0, 0.05, p.shape).astype(np.float32)))
    ck = load_model_files(tiny.gguf_path)[0]
    ids = rng.integers(3, 300, (2, 12)).astype(np.int32)
    whole = merged_check(m, ck, "blk.1.attn_q", ids)
    part = merged_check(m, ck, "blk.1.attn_q", ids, prefix)
    assert prefix.misses == 1 and whole[0] < 1e-3 and part[0] < 1e-3 and part[1] == whole[1] == 1.0
