"""The fuzzing campaign's targets: for each reader a valid seed input, how to mutate it, how to
read it, and the one error type it may raise. A generated input must end in that error (with a
message) or a correct result: never another exception, and never longer than the deadline.

    .venv/bin/python -m pytest tests/test_fuzz.py                        # the suite's subset
    VKDSL_FUZZ_EXAMPLES=10000 .venv/bin/python -m pytest tests/test_fuzz.py   # the full campaign

Mutations (hypothesis draws them, and shrinks a failure to the smallest input): byte
overwrites, a truncation, an insertion, and for text formats replacements with characters and
tokens that parsers meet at their edges."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("VKDSL_FUZZ_EXAMPLES", "500"))
DEADLINE_MS = 3000


@st.composite
def mutated(draw, seed: bytes, near: int | None = None):
    """seed with a few byte overwrites (biased to the first `near` bytes: headers and tables), a
    possible truncation and a possible insertion."""
    b = bytearray(seed)
    span = min(len(b), near or len(b))
    for _ in range(draw(st.integers(0, 4))):
        if b:
            b[draw(st.integers(0, max(span - 1, 0)))] = draw(st.integers(0, 255))
    if draw(st.booleans()) and b:
        del b[draw(st.integers(0, len(b))):]
    if draw(st.integers(0, 3)) == 0:
        at = draw(st.integers(0, len(b)))
        b[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(b)


EDGE_TEXT = st.sampled_from(['"', "\\", "{", "}", "[", "]", ",", ":", "\n", "\x00", "\ufeff", "é", "\ud800",
                             "-100", "1e999", "NaN", "null", "true", "[]", "{}", '""', " " * 3, "=", "#"])


@st.composite
def mutated_text(draw, seed: str):
    """seed with a few slices replaced by edge characters or tokens, as UTF-8 (lone surrogates
    become bytes that are not UTF-8)."""
    s = seed
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(s)))
        j = min(len(s), i + draw(st.integers(0, 6)))
        s = s[:i] + draw(EDGE_TEXT) + s[j:]
    return s.encode("utf-8", "surrogatepass")


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def copy_folder(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def seed_rows() -> str:
    rows = [{"prompt": "Is it down?", "completion": "high", "category": "outage"},
            {"messages": [{"role": "user", "content": "Add a theme"}, {"role": "assistant", "content": "low"}]}]
    return "".join(json.dumps(r) + "\n" for r in rows)


def seed_pairs() -> str:
    return json.dumps({"prompt": "Is it down?", "chosen": "high", "rejected": "low"}) + "\n"


SEED_TOML = 'steps = 7\nrank = 2\ntargets = ["q_proj", "attn_v"]\nlr = 1e-3\nverify = false\nlabels = ["a", "b"]\n'
