"""Write a file of multi-turn conversations of mixed length (for long-window SFT, `window`):

    .venv/bin/python examples/long_chat.py OUT.jsonl [N]        # N conversations, default 600

Deterministic (seeded). Each conversation is 1-6 user/assistant exchanges whose total length is
log-uniform between about 40 and 3,700 SmolLM2 tokens -- mostly short chats with a long tail, the
shape of real chat data. The text is drawn from a small vocabulary: it has the lengths and the
structure of conversations, not their meaning (enough to measure packing, memory and speed)."""
from __future__ import annotations

import json
import sys

import numpy as np

WORDS = ("the model reads each request and answers with care while the user asks about routing payment "
         "accounts devices kernels memory windows tokens training data shapes layers adapters gradients "
         "steps loss evaluation report queue order refund invoice password login screen battery update "
         "shipping return warranty please thanks because when which could would should explain more").split()


def conversation(rng) -> dict:
    words = int(np.exp(rng.uniform(np.log(30), np.log(2800))))
    turns = int(rng.integers(1, 7))
    cuts = np.sort(rng.choice(np.arange(1, words), size=2 * turns - 1, replace=False)) if words > 2 * turns else []
    parts = np.split(rng.choice(WORDS, size=words), cuts) if len(cuts) else [rng.choice(WORDS, size=words)]
    msgs = [{"role": "user" if k % 2 == 0 else "assistant", "content": " ".join(p)} for k, p in enumerate(parts)]
    if msgs[-1]["role"] == "user":
        msgs.append({"role": "assistant", "content": "thanks"})
    return {"messages": msgs}


def write(path: str, n: int = 600, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            f.write(json.dumps(conversation(rng)) + "\n")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: long_chat.py OUT.jsonl [N]")
    write(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 600)
