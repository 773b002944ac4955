"""Training data: JSONL rows -> token ids with labels (-100 = not supervised), length batching.

Row shapes (TRL's): {"prompt", "completion"} or {"messages": [{"role", "content"}, ...]},
optional "category". Loss falls on completion / assistant tokens only, including the
end-of-turn token so the model learns to stop. Preservation files hold plain text, one
passage a line (or JSONL {"text": ...})."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vkdsl.ops.losses import IGNORE  # noqa: F401  (the one label mask value; re-exported)


class DataError(ValueError):
    pass


@dataclass
class Example:
    ids: list           # token ids
    labels: list        # same length; IGNORE where not supervised
    category: str
    where: str          # "file:line" for error messages
    prompt_ids: list = None
    completion: str = ""
    truncated: bool = False
    obj: dict = None


def text_lines(path):
    """(line number, text) of a UTF-8 file; bytes that are not UTF-8 are a DataError naming the
    file, line and column."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:        # missing, a folder, unreadable: the path and why, not errno's form
        raise DataError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(f"{path}:{line}: byte 0x{raw[e.start]:02x} at column {col} is not UTF-8 "
                        f"(save the file as UTF-8)") from None
    return enumerate(text.split("\n"), 1)


def read_jsonl(path) -> list[tuple[int, dict]]:
    rows = []
    for n, line in text_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: malformed JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
        rows.append((n, obj))
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def _text(obj, key, where):
    v = obj.get(key)
    if v is not None and not isinstance(v, str):
        raise DataError(f"{where}: field {key!r} is {json.dumps(v)}, expected a non-empty string")
    if not v or not v.strip():
        raise DataError(f"{where}: field {key!r} is missing or empty")
    return v


def _segments(obj, tok, use_template, where):
    """[(text, supervised)] in order. Assistant turns (or the completion) are supervised."""
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                    or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: messages[{i}] needs a role (system/user/assistant) and "
                                f"string content")
            if m["role"] == "assistant" and not m["content"].strip():
                raise DataError(f"{where}: messages[{i}] is an assistant turn with empty content "
                                f"(nothing to learn)")
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: no assistant message, so nothing to learn")
        _check_turn_order(msgs, where)
    else:
        prompt, completion = _text(obj, "prompt", where), _text(obj, "completion", where)
        if not use_template:
            if "system" in obj:
                raise DataError(f"{where}: field 'system' needs a chat template (the model has "
                                f"none, or chat_template is off)")
            return [(prompt, False), (completion, True)], None
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        if "system" in obj:  # a row's own system turn instead of the template's default
            msgs.insert(0, {"role": "system", "content": _text(obj, "system", where)})
    return _template_segments(msgs, tok, where), msgs


def _check_turn_order(msgs, where):
    """A system turn only first, then user and assistant turns alternating from a user turn: the
    order chat templates are written for (some render any order without a word)."""
    want = "user"
    for i, m in enumerate(msgs):
        if m["role"] == "system" and i == 0:
            continue
        if m["role"] != want:
            raise DataError(f"{where}: messages[{i}] is a {m['role']!r} turn where a {want!r} turn "
                            f"is expected (order: an optional system turn first, then user and "
                            f"assistant alternating)")
        want = "assistant" if want == "user" else "user"


_MARK = "\ue000vkdsl-turn-{}\ue001"     # private-use characters: never in a row's own text


def _template_segments(msgs, tok, where):
    """[(text, supervised)] of the conversation rendered once by the model's template: each
    assistant turn's content is supervised, the template's markup around it (role headers, Qwen3's
    empty think block, the turns before) is prompt. The content's place is found by rendering it
    as a marker; the whole must then equal the real rendering, else the template rewrote it."""
    marked = [dict(m, content=_MARK.format(k)) if m["role"] == "assistant" else m
              for k, m in enumerate(msgs)]
    text = tok.apply_chat_template(marked, add_generation_prompt=False)
    segs, pos = [], 0
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        mark = _MARK.format(k)
        at = text.find(mark, pos)
        if at < 0 or text.count(mark) != 1:
            raise DataError(f"{where}: the chat template does not render messages[{k}] (an "
                            f"assistant turn) once, in order")
        segs += [(text[pos:at], False), (m["content"], True)]
        pos = at + len(mark)
    segs.append((text[pos:], False))
    if "".join(t for t, _ in segs) != tok.apply_chat_template(msgs, add_generation_prompt=False):
        raise DataError(f"{where}: the chat template rewrites an assistant turn's content (e.g. "
                        f"Qwen3 moves <think>...</think> out of it, or strips it): write the "
                        f"content as it renders")
    return segs


def reply_end(tok, use_template) -> int | None:
    """The token a supervised reply ends with: the template's end of turn, or EOS for plain text."""
    return (tok.end_of_turn_id if use_template and getattr(tok, "chat_template", None)
            else tok.eos_id)


def encode_row(obj, tok, use_template, max_len, side, where) -> Example:
    use_template = use_template and getattr(tok, "chat_template", None) is not None
    segs, _ = _segments(obj, tok, use_template, where)
    templated = use_template or "messages" in obj
    turn_end = reply_end(tok, templated)
    ids, labels, after_reply = [], [], False
    for text, sup in segs:
        t = tok.encode(text, add_special=False) if text else []
        if sup:
            lab = list(t)
            if not templated:                   # plain text: the completion ends with EOS
                t, lab = t + [tok.eos_id], lab + [tok.eos_id]
            if not lab:
                raise DataError(f"{where}: the completion is empty after tokenization")
        else:
            lab = [IGNORE] * len(t)
            if after_reply and t and t[0] == turn_end:   # the end-of-turn token is the reply's last
                lab[0] = t[0]
        after_reply = sup
        ids += t
        labels += lab
    # Labels are next-token targets: position i predicts ids[i+1].
    tgt = labels[1:] + [IGNORE]
    ids, tgt, trunc = _truncate(ids, tgt, max_len, side, where)
    return Example(ids, tgt, str(obj.get("category", "")), where, truncated=trunc,
                   completion=completion_of(obj), obj=obj)


def completion_of(obj) -> str:
    if "messages" in obj:
        return [m["content"] for m in obj["messages"] if m["role"] == "assistant"][-1]
    return str(obj.get("completion", ""))


def with_completion(obj, text) -> dict:
    """The same row with its (last assistant) completion replaced: label candidates."""
    if "messages" not in obj:
        return dict(obj, completion=text)
    msgs = [dict(m) for m in obj["messages"]]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    msgs[last]["content"] = text
    return dict(obj, messages=msgs)


def _truncate(ids, tgt, max_len, side, where):
    if len(ids) <= max_len:
        return ids, tgt, False
    first = next(i for i, x in enumerate(tgt) if x != IGNORE)      # last prompt position
    if side == "right":
        if first + 1 >= max_len:
            raise DataError(f"{where}: the prompt ({first + 1} tokens) leaves no room for the "
                            f"completion at max_len={max_len}")
        return ids[:max_len], tgt[:max_len], True
    drop = len(ids) - max_len
    if drop > first:
        raise DataError(f"{where}: the completion alone ({len(ids) - first - 1} tokens) "
                        f"does not fit max_len={max_len} with left truncation")
    return ids[drop:], tgt[drop:], True


def load_examples(path, tok, use_template, max_len, side) -> list[Example]:
    return [encode_row(obj, tok, use_template, max_len, side, f"{path}:{n}")
            for n, obj in read_jsonl(path)]


def load_passages(path, tok, max_len) -> list[Example]:
    """Preservation text: every next token is scored. Plain lines or JSONL {"text"}."""
    out = []
    for n, line in text_lines(path):
        if not line.strip():
            continue
        text = line.strip()
        if str(path).endswith(".jsonl"):
            try:
                text = _text(json.loads(line), "text", f"{path}:{n}")
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: malformed JSON: {e.msg}") from None
        ids = tok.encode(text, add_special=False)[:max_len]
        if len(ids) < 2:
            raise DataError(f"{path}:{n}: a passage needs at least 2 tokens")
        out.append(Example(ids, ids[1:] + [IGNORE], "preservation", f"{path}:{n}"))
    if not out:
        raise DataError(f"{path}: no passages")
    return out


def load_run_rows(cfg, tok, say) -> tuple[list, list, list, list]:
    """A run's training, held-out, preservation and rehearsal rows, with what was truncated said."""
    enc = (cfg.chat_template, cfg.max_len, cfg.truncation_side)
    train = load_examples(cfg.train_file, tok, *enc)
    if cfg.loss_on == "all":          # the negative control: the prompt's tokens are scored too
        train = [dataclasses.replace(x, labels=x.ids[1:] + [IGNORE]) for x in train]
    heldout = load_examples(cfg.heldout_file, tok, *enc) if cfg.heldout_file else []
    passages = (load_passages(cfg.preservation_file, tok, cfg.max_len)
                if cfg.preservation_file else [])
    rehearsal = load_passages(cfg.rehearsal_file, tok, cfg.max_len) if cfg.rehearsal_file else []
    for what, rows in (("train", train), ("held-out", heldout)):
        n = sum(r.truncated for r in rows)
        say(f"{what}: {len(rows)} rows, {n} truncated ({cfg.truncation_side} side, "
            f"max_len {cfg.max_len})")
    say(f"preservation: {len(passages)} passages")
    if rehearsal:
        say(f"rehearsal: {len(rehearsal)} passages of general text, weight "
            f"{cfg.rehearsal_weight}, {cfg.rehearsal_batch} per step")
    return train, heldout, passages, rehearsal

def bucket_len(n, bucket, max_len):
    return min(-(-n // bucket) * bucket, max_len)


def collate(rows: list[Example], pad_id, bucket, max_len):
    """Right padding (causal attention keeps real tokens blind to it), labels -100 on padding.
    -> ids (B, T) int32, labels (B, T) int32."""
    T = bucket_len(max(len(r.ids) for r in rows), bucket, max_len)
    ids = np.full((len(rows), T), pad_id, np.int32)
    lab = np.full((len(rows), T), IGNORE, np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r.ids)] = r.ids
        lab[i, :len(r.labels)] = r.labels
    return ids, lab


def check_batches(rows: list[Example]):
    """Preflight: rows with no supervised token (after truncation) are named."""
    bad = [r.where for r in rows if not any(x != IGNORE for x in r.labels)]
    if bad:
        raise DataError(f"{len(bad)} row(s) have no supervised token after truncation: "
                        f"{', '.join(bad[:10])}")


class Sampler:
    """Epoch-wise shuffled order (seeded), grouped by length inside windows so batches pad little.
    state() / set_state() make the order resumable."""

    def __init__(self, examples, rows_per_step, seed):
        self.ex, self.n = examples, rows_per_step
        self.rng = np.random.default_rng(seed)
        self.queue = []

    def _refill(self):
        order = self.rng.permutation(len(self.ex)).tolist()
        w = self.n * 4
        for s in range(0, len(order), w):
            order[s:s + w] = sorted(order[s:s + w], key=lambda i: len(self.ex[i].ids))
        self.queue += order

    def next(self) -> list:
        while len(self.queue) < self.n:
            self._refill()
        out, self.queue = self.queue[:self.n], self.queue[self.n:]
        return out

    def state(self):
        return {"rng": self.rng.bit_generator.state, "queue": list(self.queue)}

    def set_state(self, st):
        self.rng.bit_generator.state = st["rng"]
        self.queue = list(st["queue"])


class WindowSampler(Sampler):
    """Long data: each epoch the rows are shuffled (seeded), packed first-fit decreasing into
    windows of `window` tokens, and the windows shuffled; next() -> the next n windows, each a list
    of row indices. train.packing then places a micro-batch's rows, window by window, into at most
    as many sequences as it has windows (first-fit never puts a row past its own window)."""

    def __init__(self, examples, windows_per_step, seed, window):
        super().__init__(examples, windows_per_step, seed)
        self.window = window

    def _refill(self):
        order = self.rng.permutation(len(self.ex)).tolist()
        order.sort(key=lambda i: -len(self.ex[i].ids))          # stable: ties keep the shuffle
        free, bins = [], []
        for i in order:
            n = len(self.ex[i].ids)
            b = next((j for j, f in enumerate(free) if f >= n), None)
            if b is None:
                b = len(bins)
                free.append(self.window)
                bins.append([])
            free[b] -= n
            bins[b].append(i)
        self.queue += [bins[j] for j in self.rng.permutation(len(bins)).tolist()]

    def utilization(self) -> float:
        """Real tokens / window tokens of one epoch's packing (what the seed run calls
        utilization)."""
        lens = [len(e.ids) for e in self.ex]
        probe = WindowSampler(self.ex, 1, 0, self.window)
        probe._refill()
        return sum(lens) / (len(probe.queue) * self.window)


def sampler(rows, per_step, cfg) -> Sampler:
    """The SFT order: per_step rows a step, or with cfg.window as many packed windows."""
    if cfg.window:
        return WindowSampler(rows, per_step, cfg.data_seed, cfg.window)
    return Sampler(rows, per_step, cfg.data_seed)
