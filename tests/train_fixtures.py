"""Shared helpers for the trainer tests: a tiny model and tiny data sets (no SmolLM2)."""
import json

from vkdsl.models.synthetic import build_tiny
from vkdsl.train.config import TrainConfig

TRAIN = [("Is it down?", "high", "outage"), ("Add a theme", "low", "feature"),
         ("Bill twice", "medium", "billing"), ("Hacked now", "high", "account"),
         ("Site is slow", "medium", "outage"), ("Dark mode", "low", "feature"),
         ("Refund me", "medium", "billing"), ("Reset pw", "high", "account")]
HELD = [("Down again", "high", "outage"), ("New color", "low", "feature"),
        ("Charged wrong", "medium", "billing"), ("Hello", "fine thanks", "chat")]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tiny_setup(tmp):
    (tmp / "model").mkdir(parents=True, exist_ok=True)
    tm = build_tiny(tmp / "model", seed=0)
    tr = write_jsonl(tmp / "train.jsonl", [{"prompt": p, "completion": c, "category": k} for p, c, k in TRAIN])
    he = write_jsonl(tmp / "held.jsonl", [{"prompt": p, "completion": c, "category": k} for p, c, k in HELD])
    pr = write_jsonl(tmp / "pres.jsonl", [{"text": "The quick brown fox jumps over the lazy dog."},
                                         {"text": "Paris is the capital of France."}])
    return tm, tr, he, pr


def tiny_cfg(setup, **kw):
    tm, tr, he, pr = setup
    base = dict(model=str(tm.gguf_path), train_file=tr, heldout_file=he, preservation_file=pr,
                labels=["low", "medium", "high"], max_len=64, bucket=16, rank=4, alpha=8.0, lr=1e-2,
                warmup=1, steps=4, batch_size=4, eval_every=0, checkpoint_every=2, verify=False, quiet=True,
                eval_batch=4, tmkl=0.0)
    base.update(kw)
    return TrainConfig(**base).validate()
