"""Every setting of a training run in one dataclass: TOML file, then CLI overrides. Each setting is
declared once, with its help line (`vkdsl-train --help` is generated from it) and its simple rule
(one of a few values, or a bound); validate() adds the rules that join settings.

An unknown key or flag is an error (a typo must not silently train with a default)."""
from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

DATA = Path(__file__).parent / "data"


class ConfigError(ValueError):
    pass


def setting(default, help: str, **rule):
    """A field with its help line and rule: one_of=(...), at_least=, at_most=, above=."""
    meta = {"help": help, **rule}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _broken_rule(name, v, rule) -> str | None:
    """What a value breaks of its setting's rule, in words (None: it keeps it)."""
    if "one_of" in rule and v not in rule["one_of"]:
        *first, last = rule["one_of"]
        return f"{name} {v!r}: expected {', '.join(first)} or {last}"
    lo, hi, gt = rule.get("at_least"), rule.get("at_most"), rule.get("above")
    if (lo is not None and v < lo) or (hi is not None and v > hi) or (gt is not None and v <= gt):
        want = (f"in [{lo}, {hi}]" if hi is not None else f">= {lo}" if lo is not None
                else f"> {gt}")
        return f"{name} must be {want}"
    return None


@dataclass
class TrainConfig:
    # model and data
    model: str = setting("", "GGUF file or Hugging Face folder ('' = the installed "
        "SmolLM2-135M-Instruct)")
    quant: str = setting("keep", "how the frozen base is stored on the device: keep (the file's "
        "own blocks, e.g. Q4_1), none (fp32), int4 or nf4 (packed on load, group 64)",
        one_of=("keep", "none", "int4", "nf4"))
    precision: str = setting("fp32", "fp32 matmuls, or fp16: every matmul (adapters, fp32 and "
        "quantized bases) takes fp16 inputs with fp32 sums, on cooperative matrices where the "
        "device has them (vkdsl doctor says which)", one_of=("fp32", "fp16"))
    train_file: str = setting(str(DATA / "routing_train.jsonl"), "SFT rows, JSONL: "
        "prompt/completion (optionally system) or messages")
    heldout_file: str = setting(str(DATA / "routing_heldout.jsonl"), "held-out rows (same format) "
        "for accuracy and loss evidence")
    preservation_file: str = setting(str(DATA / "preservation.jsonl"), "JSONL rows of plain text "
        "whose loss must not rise (preservation)")
    labels: list = setting(["payment", "account", "tech", "product"], "comma-separated label set "
        "the completions are scored against")
    label_eval: bool = setting(True, "score every held-out row as a decision among the labels (its "
        "completion must be one) with the accuracy, calibration, format, slice and stability "
        "surfaces and gates; off: held-out loss only")
    chat_template: bool = setting(True, "wrap prompt/completion as user/assistant turns")
    max_len: int = setting(96, "tokens per row after truncation", at_least=8)
    truncation_side: str = setting("left", "left: drop the prompt's start; right: the completion's "
        "end", one_of=("left", "right"))
    bucket: int = setting(16, "pad lengths to multiples of this (few compiled programs)",
        at_least=1)
    pack: bool = setting(True, "SFT: several short rows share one sequence (block-diagonal "
        "attention, positions restart per row) instead of padding")
    window: int = setting(0, "SFT on long data: each epoch's rows packed first-fit (longest first) "
        "into windows of this many tokens, batch_size windows per micro-batch; 0: each "
        "micro-batch's rows share sequences of its longest row")
    loss_on: str = setting("completion", "SFT tokens scored: completion (the prompt masked) or all "
        "(prompt and template too: the negative control of `vkdsl probe prompt-mask`); evaluation "
        "always scores completions", one_of=("completion", "all"))
    rehearsal_file: str = setting("", "general text (plain lines or JSONL {text}) mixed into SFT "
        "as its own loss term; keep it disjoint from preservation_file, which measures")
    rehearsal_weight: float = setting(0.0, "w: SFT objective = task mean + w * mean next-token "
        "loss on the rehearsal text", at_least=0)
    rehearsal_batch: int = setting(4, "rehearsal passages per optimizer step (taken in order, "
        "cycling)", at_least=1)
    # adapter: by default the top third of SmolLM2's 30 layers, every projection but k; layers
    # below the first adapter run once per row (prefix cache), so a step costs a third of the
    # model (BENCHMARKS.md)
    targets: list = setting(["attn_q", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"],
        "comma-separated module patterns the adapters go on (attn_q, q_proj, in_proj_qkv, ..., or "
        "all-linear)")
    layers: str = setting("last:10", "layers to adapt: '' = all, e.g. 0-3,7, or last:N for the top "
        "N layers")
    rank: int = setting(8, "LoRA rank r", at_least=1)
    alpha: float = setting(16.0, "LoRA alpha (scale alpha/r, or alpha/sqrt(r) with rslora)",
        above=0)
    rslora: bool = setting(False, "rank-stabilized scale alpha/sqrt(r)")
    # objective and optimizer
    tmkl: float = setting(0.3, "lambda of the target-masked KL to the base; 0 = plain SFT (no base "
        "forward)", at_least=0)
    tmkl_cache_bytes: int = setting(1 << 30, "bytes of host memory for the base model's logits at "
        "supervised positions, computed once per training row; 0 = a base forward in every step",
        at_least=0)
    prefix_cache_bytes: int = setting(1 << 30, "bytes of host memory for the output of the layers "
        "below the first adapted one, computed once per row and reused by every step and "
        "evaluation; 0 = recompute", at_least=0)
    checkpoint: str = setting("none", "activation checkpointing: none keeps every layer's "
        "activations for the backward; layers keeps each adapted layer's input and recomputes the "
        "layer in the backward; every:K keeps one input in K layers (less memory, one more forward "
        "of the adapted layers per step)")
    activations: str = setting("fp32", "storage of the activations kept for the backward: fp32, or "
        "fp16 (half the bytes, needs the device's 16-bit storage; arithmetic stays fp32, the "
        "gradients are those at the fp16-rounded activations: BENCHMARKS.md states the difference)",
        one_of=("fp32", "fp16"))
    device_memory: str = setting("", "the device-memory budget the run is planned against "
        "(train.memplan), e.g. 4G; a run over it is refused before its first step with settings "
        "that fit; empty: the device's heap (or $VKDSL_DEVICE_MEMORY_LIMIT)")
    lr: float = setting(0.002, "peak learning rate (AdamW)", above=0)
    warmup: int = setting(2, "linear warm-up steps", at_least=0)
    min_lr_ratio: float = setting(0.1, "cosine decay floor as a fraction of lr",
        at_least=0, at_most=1)
    steps: int = setting(16, "optimizer steps of SFT", at_least=1)
    batch_size: int = setting(4, "rows per micro-batch (with window: windows)", at_least=1)
    grad_accum: int = setting(1, "micro-batches per optimizer step", at_least=1)
    betas: list = setting([0.9, 0.999], "AdamW beta1,beta2")
    eps: float = setting(1e-08, "AdamW epsilon", above=0)
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay", at_least=0)
    clip: float = setting(1.0, "global gradient-norm clip; 0 = none", at_least=0)
    seed: int = setting(0, "adapter initialization seed", at_least=0)
    data_seed: int = setting(0, "data order seed", at_least=0)
    # preference stage (DPO)
    objective: str = setting("sft+dpo", "sft, dpo or sft+dpo (SFT then DPO)",
        one_of=("sft", "dpo", "sft+dpo"))
    dpo_train_file: str = setting(str(DATA / "routing_prefs_train.jsonl"), "preference pairs, "
        "JSONL: prompt/chosen/rejected")
    dpo_heldout_file: str = setting(str(DATA / "routing_prefs_heldout.jsonl"), "held-out "
        "preference pairs")
    dpo_steps: int = setting(6, "optimizer steps of DPO", at_least=1)
    dpo_beta: float = setting(0.1, "DPO beta", above=0)
    dpo_lr: float = setting(0.0001, "DPO learning rate", above=0)
    dpo_batch: int = setting(4, "pairs per DPO step", at_least=1)
    dpo_nll_weight: float = setting(1.0, "weight of an optional NLL on the chosen responses",
        at_least=0)
    reference: str = setting("auto", "DPO reference: auto (the SFT adapter after SFT, else the "
        "base), base, sft or none", one_of=("auto", "base", "sft", "none"))
    # evidence, checkpoints, output
    eval_every: int = setting(0, "steps between held-out evaluations; 0 = only at the end",
        at_least=0)
    eval_batch: int = setting(8, "rows per evaluation batch", at_least=1)
    checkpoint_every: int = setting(10, "steps between checkpoints; 0 = only at the end",
        at_least=0)
    merge_check_rows: int = setting(2, "rows on which merged and separate logits are compared "
        "(0 = skip)", at_least=0)
    format_tokens: int = setting(8, "format surface: tokens generated greedily for each failure "
        "shown", at_least=1)
    format_examples: int = setting(3, "format surface: failures generated verbatim and shown (0 = "
        "none; the share is exact either way, from the teacher-forced pass)", at_least=0)
    stability_rows: int = setting(8, "stability surface: held-out rows decided again with the same "
        "adapter on the base dequantized to fp32 (0 = skip)", at_least=0)
    # gates
    gate_heldout_acc: float = setting(0.5, "gate: held-out label accuracy must exceed this, and "
        "its Wilson 95% lower bound the base model's accuracy", at_least=0, at_most=1)
    gate_dpo_pair_acc: float = setting(0.5, "gate: DPO held-out pair accuracy (chosen above "
        "rejected) must exceed this", at_least=0, at_most=1)
    gate_dpo_task_drop: float = setting(0.0625, "gate: held-out label accuracy after DPO may be "
        "this much below after SFT (2 of 32 rows)", at_least=0, at_most=1)
    gate_preservation: float = setting(0.1, "gate: preservation loss may rise at most this "
        "(nats/token)", at_least=0)
    gate_train_drop: float = setting(0.0, "gate: the final train loss must be below the first by "
        "more than this")
    gate_merge: float = setting(0.01, "gate: merged-vs-separate max logit difference",
        at_least=0)
    gate_format: float = setting(0.9, "gate: share of held-out prompts whose greedy output is "
        "exactly one label then end-of-turn", at_least=0, at_most=1)
    gate_calibration: float = setting(0.25, "gate: expected calibration error of the label "
        "decision (10 bins) at most this", at_least=0, at_most=1)
    gate_slice: float = setting(0.5, "gate: label accuracy of the worst held-out category at least "
        "this", at_least=0, at_most=1)
    gate_stability: float = setting(0.9, "gate: share of decisions unchanged when the base is "
        "dequantized to fp32", at_least=0, at_most=1)
    verify: bool = setting(True, "a short `vkdsl verify` pass over the kernels used, before "
        "training")
    out: str = setting("", "run folder ('' = runs/<date-time>)")
    quiet: bool = setting(False, "print only the summary")
    jsonl: bool = setting(False, "print one JSON object per event instead of progress")

    def validate(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"config: {f.name}={v} is not a finite number")
            broken = _broken_rule(f.name, v, f.metadata)
            if broken:
                raise ConfigError(f"config: {broken}")
        checks = [
            (bool(self.labels) or not self.label_eval,
             "labels is empty: name the labels the held-out completions are scored against, or "
             "turn label evaluation off (--no-label-eval: held-out loss only, no accuracy, "
             "calibration, format, slice or stability gates)"),
            (len(set(self.labels)) == len(self.labels), "labels must not repeat a label"),
            (self.window == 0 or self.window >= self.max_len,
             f"window ({self.window}) must be 0 or at least max_len ({self.max_len}): every row "
             f"must fit one"),
            (self.window == 0 or self.pack, "window needs pack = true (rows share windows)"),
            (self.rehearsal_weight == 0 or self.rehearsal_file,
             "rehearsal_weight > 0 needs a rehearsal_file of general text"),
            (self.checkpoint_layers >= 0, "checkpoint must be none, layers or every:K with K >= 1"),
            (self._device_memory_ok(),
             f"device_memory {self.device_memory!r}: expected bytes with an optional "
             f"K/M/G suffix, e.g. 4G, or empty for the device's own budget"),
            (self.warmup <= self.steps or self.objective == "dpo",
             f"warmup ({self.warmup}) must not exceed steps ({self.steps}): the learning rate "
             f"would never reach lr"),
            (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
             "betas must be two values in [0, 1)"),
            (len(self.targets) > 0, "targets must name at least one module pattern"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"config: {msg}")
        return self

    @property
    def checkpoint_layers(self) -> int:
        """Layers per recomputed group in the backward: 0 (none: every activation kept), 1 (layers),
        K (every:K: one layer input kept in K); -1 for anything else (refused by validate)."""
        c = str(self.checkpoint)
        if c in ("none", "layers"):
            return {"none": 0, "layers": 1}[c]
        k = c.removeprefix("every:")
        return int(k) if c.startswith("every:") and k.isdigit() and int(k) >= 1 else -1

    def _device_memory_ok(self) -> bool:
        from vkdsl.runtime.context import parse_bytes
        try:
            return not self.device_memory or parse_bytes(str(self.device_memory)) > 0
        except ValueError:
            return False

    def to_dict(self):
        return dataclasses.asdict(self)

    def dumps(self):
        return json.dumps(self.to_dict(), indent=1)

    def pretty(self):
        return "\n".join(f"  {k} = {json.dumps(v)}" for k, v in self.to_dict().items())


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}

HELP = {name: f.metadata["help"] for name, f in FIELDS.items()}


def default_of(name):
    f = FIELDS[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _coerce(name, value):
    """A CLI string or TOML value -> the field's type."""
    default = default_of(name)
    try:
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if isinstance(default, list):
            if isinstance(value, list):
                return value
            items = [v.strip() for v in str(value).split(",") if v.strip()]
            return [float(v) for v in items] if name == "betas" else items
        if isinstance(default, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if isinstance(default, float):
            return float(value)
        return str(value)
    except (ValueError, OverflowError, TypeError):
        raise ConfigError(f"config: {name}={value!r} is not a valid "
                          f"{type(default).__name__}") from None


# input files a TOML config may name relative to itself
FILE_FIELDS = ("model", "train_file", "heldout_file", "preservation_file", "rehearsal_file",
               "dpo_train_file", "dpo_heldout_file")


def _unknown(key, where):
    near = [k for k in FIELDS if k.startswith(key[:3])]
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    return ConfigError(f"{where}: unknown setting {key!r}{hint}; known: {', '.join(FIELDS)}")


def load(toml_path=None, overrides: dict | None = None) -> TrainConfig:
    """Defaults <- TOML file <- overrides (already parsed, e.g. from flags)."""
    values = {}
    if toml_path:
        try:
            data = Path(toml_path).read_bytes()
        except OSError as e:
            raise ConfigError(f"{toml_path}: cannot read the config file ({e.strerror})") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise ConfigError(f"{toml_path}:{line}: byte 0x{data[e.start]:02x} is not UTF-8 "
                              f"(TOML files are UTF-8)") from None
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            # tomllib names a line, except for an error at the end ("at end of document"): name the
            # last
            where = f":{len(text.splitlines()) or 1}" if "end of document" in str(e) else ""
            raise ConfigError(f"{toml_path}{where}: {e}") from None
        for k, v in raw.items():
            if k not in FIELDS:
                raise _unknown(k, str(toml_path))
            try:
                values[k] = _coerce(k, v)
            except ConfigError as e:
                raise ConfigError(f"{toml_path}: {str(e).removeprefix('config: ')}") from None
            if k in FILE_FIELDS and values[k] and not Path(values[k]).is_absolute():
                values[k] = str(Path(toml_path).parent / values[k])  # relative to the config file
    for k, v in (overrides or {}).items():
        if k not in FIELDS:
            raise _unknown(k, "command line")
        values[k] = _coerce(k, v)
    return TrainConfig(**values).validate()
