"""Every stored golden case as its own test, through the same run_case that `vkdsl verify` uses:
a failing kernel shows up by name (`pytest -k "softmax["`)."""
import pytest

from vkdsl_golden import store

CASES = list(store.iter_cases(1))


@pytest.fixture(scope="module")
def registry():
    import vkdsl.ops  # noqa: F401  (registers the op library's rows beside the core's)
    from vkdsl.verify import REGISTRY
    return REGISTRY


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_golden_case(dev, registry, case):
    from vkdsl.verify import run_case
    assert case["op"] in registry, f"no device implementation registered for {case['op']}"
    rows = run_case(case, store.load_case(case))
    assert rows, "run_case returned no rows"
    bad = [f"{r.name}: nmse {r.error:.3g} > {r.limit:.3g} {r.note}" for r in rows if not r.passed]
    assert not bad, "; ".join(bad)


def test_every_registered_op_has_cases(registry):
    assert set(registry) <= {c["op"] for c in CASES}


def test_a_run_verifies_the_long_attention_rows_only_when_its_sequences_are_long():
    from vkdsl.cli.train import verify_cases

    def lengths(tokens):
        return sorted(a[c["inputs"][0]].shape[0] for c, a in verify_cases("fp32", tokens) if c["op"] == "attention")
    short, long_ = lengths(96), lengths(4096)
    assert max(short) <= 512 and long_ == sorted(short + [2048, 4096])
    assert lengths(2048) == sorted(short + [2048])
