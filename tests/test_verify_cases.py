"""Every stored golden case as its own test, through the same path `vkdsl verify` takes (the built-in
rows as vkdsl.cases.Case, vkdsl.cases.run against the installed goldens): a failing kernel shows up
by name (`pytest -k "softmax["`)."""
import hashlib

import pytest

from vkdsl_golden import store

ENTRIES = list(store.iter_cases(1))


@pytest.fixture(scope="module")
def builtin():
    from vkdsl import cases as C
    return {c.name: c for c in C.load("builtin")}


@pytest.mark.parametrize("entry", ENTRIES, ids=[c["name"] for c in ENTRIES])
def test_golden_case(dev, builtin, entry):
    from vkdsl.case_goldens import stale
    from vkdsl.cases import run
    from vkdsl.verify import REGISTRY
    assert entry["op"] in REGISTRY, f"no device implementation registered for {entry['op']}"
    case, arrays = builtin[entry["name"]], store.load_case(entry)
    assert stale(case, arrays) == "", "the stored inputs are not what the declared case draws"
    rows = run(case, arrays)
    assert rows, "run returned no rows"
    bad = [f"{r.name}: nmse {r.error:.3g} > {r.limit:.3g} {r.note}" for r in rows if not r.passed]
    assert not bad, "; ".join(bad)


def test_every_registered_op_has_cases():
    import vkdsl.ops  # noqa: F401  (registers the op library's rows beside the core's)
    from vkdsl.verify import REGISTRY
    assert set(REGISTRY) <= {c["op"] for c in ENTRIES}


def test_the_builtin_cases_are_declared_through_the_public_api_and_reproduce_the_goldens(builtin):
    """The built-in rows are vkdsl.cases.Case values; a sample of them (every op's first case, the
    gradient ops among them) regenerated through vkdsl.cases.references gives the stored npz
    byte for byte (independent of the stored file: it is re-derived from the generator and the
    float64 reference)."""
    from vkdsl.cases import Case, references
    from vkdsl_golden.generate import npz_bytes
    assert [c["name"] for c in ENTRIES] == list(builtin) and all(isinstance(c, Case) for c in builtin.values())
    firsts = {}
    for e in ENTRIES:
        if "attention[4096" not in e["name"] and "attention[2048" not in e["name"]:
            firsts.setdefault(e["op"], e)
    for e in firsts.values():
        data = npz_bytes(references(builtin[e["name"]]))
        assert hashlib.sha256(data).hexdigest() == e["sha256"], e["name"]


def test_a_run_verifies_the_long_attention_rows_only_when_its_sequences_are_long():
    from vkdsl.cli.verify_pass import verify_cases

    def lengths(tokens):
        return sorted(a["in0"].shape[0] for c, a, _ in verify_cases("fp32", tokens) if c.op == "attention")
    short, long_ = lengths(96), lengths(4096)
    assert max(short) <= 512 and long_ == sorted(short + [2048, 4096])
    assert lengths(2048) == sorted(short + [2048])
