"""The mutation check's machinery on one cheap mutant (the full campaign: python tests/mutants.py):
the copy is what gets imported, the mutant is killed, and the tree is left as it was."""
import mutants


def test_one_mutant_is_killed_in_a_copy():
    m = next(x for x in mutants.MUTANTS if x.name == "rslora_scale_over_r")
    before = (mutants.REPO / m.path).read_text()
    rows = mutants.campaign([m], out=lambda line: None)
    assert rows[0]["killed"] and rows[0]["failed"] >= 1 and rows[0]["tests"] >= 1
    assert (mutants.REPO / m.path).read_text() == before        # only the copy was mutated


def test_every_mutant_still_applies():
    # each mutant's text occurs exactly once where it points: a refactor cannot silently retire one
    for m in mutants.MUTANTS:
        assert (mutants.REPO / m.path).read_text().count(m.old) == 1, m.name
    assert len(mutants.MUTANTS) >= 40
