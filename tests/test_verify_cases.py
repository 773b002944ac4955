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
