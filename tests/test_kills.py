"""The kill campaign's machinery on a few seeded kills (the full campaign: python tests/kills.py):
killed inside writes or at random moments, every resume ends bit-identical or refuses clearly."""
import kills


def test_a_few_kills_resume_identically_or_refuse():
    lines = []
    tally = kills.campaign(kills=2, seed=5, out=lines.append)
    assert sum(tally.values()) == 2
    assert set(tally) <= {"identical", "refused"}, "\n".join(lines)
    assert tally["identical"] >= 1, "\n".join(lines)
