"""Every setting of a training run in one dataclass: TOML file, then CLI overrides.

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


@dataclass
class TrainConfig:
    # model and data
    model: str = ""                     # "" = the default SmolLM2 GGUF
    quant: str = "keep"                 # the frozen base on the device: keep, none, int4, nf4
    # matmuls: fp32, or fp16 inputs with fp32 sums (vkdsl.precision)
    precision: str = "fp32"
    train_file: str = str(DATA / "routing_train.jsonl")
    heldout_file: str = str(DATA / "routing_heldout.jsonl")
    preservation_file: str = str(DATA / "preservation.jsonl")
    labels: list = field(default_factory=lambda: ["payment", "account", "tech", "product"])
    label_eval: bool = True             # held-out rows scored as label decisions (gates)
    chat_template: bool = True          # wrap prompt/completion as user/assistant turns
    max_len: int = 96
    truncation_side: str = "left"       # left: drop the prompt's start; right: the completion's end
    bucket: int = 16                    # pad lengths to multiples: few compiled programs
    pack: bool = True                   # short rows share a sequence (train.packing)
    window: int = 0                     # >0: rows packed first-fit into windows of this many tokens
    loss_on: str = "completion"         # completion (prompt masked) or all (negative control)
    rehearsal_file: str = ""            # general text mixed into SFT (its own loss term)
    rehearsal_weight: float = 0.0       # w: objective = task mean + w * general-text mean
    rehearsal_batch: int = 4            # general-text passages per step
    # adapter
    # the top third of SmolLM2's 30 layers, every projection but k: layers below the first adapter
    # run once per row (prefix cache), so a step costs a third of the model (BENCHMARKS.md)
    targets: list = field(default_factory=lambda: ["attn_q", "attn_v", "attn_output", "ffn_gate",
                                                   "ffn_up", "ffn_down"])
    layers: str = "last:10"             # "" = all; "0-3,7"; "last:N" = the top N
    rank: int = 8
    alpha: float = 16.0
    rslora: bool = False
    # objective and optimizer
    tmkl: float = 0.3                   # lambda; 0 = plain SFT (no base forward at all)
    tmkl_cache_bytes: int = 1 << 30     # base logits kept for TMKL; 0 = a base forward every step
    prefix_cache_bytes: int = 1 << 30   # outputs of the layers below the first adapter; 0 = off
    checkpoint: str = "none"            # activations in the backward: none (kept), layers, every:K
    activations: str = "fp32"           # what the backward keeps: fp32, or fp16 (16-bit storage)
    device_memory: str = ""             # the plan's budget, e.g. 4G ("": the device's own)
    lr: float = 2e-3
    warmup: int = 2
    min_lr_ratio: float = 0.1
    steps: int = 16
    batch_size: int = 4                 # rows (with window: windows) per micro-batch
    grad_accum: int = 1                 # micro-batches per optimizer step
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip: float = 1.0                   # 0 = no clipping
    seed: int = 0                       # adapter init
    data_seed: int = 0                  # data order
    # preference stage (DPO); objective sft = SFT only, dpo = DPO only, sft+dpo = SFT then DPO
    objective: str = "sft+dpo"
    dpo_train_file: str = str(DATA / "routing_prefs_train.jsonl")
    dpo_heldout_file: str = str(DATA / "routing_prefs_heldout.jsonl")
    dpo_steps: int = 6
    dpo_beta: float = 0.1
    dpo_lr: float = 1e-4
    dpo_batch: int = 4
    dpo_nll_weight: float = 1.0         # NLL on the chosen responses (0: plain DPO)
    reference: str = "auto"             # auto: the SFT adapter after SFT, else the base; base; none
    # evidence, checkpoints, output
    eval_every: int = 0
    eval_batch: int = 8
    checkpoint_every: int = 10
    merge_check_rows: int = 2
    format_tokens: int = 8              # greedy tokens generated for a format failure shown
    format_examples: int = 3            # format failures generated verbatim and shown
    stability_rows: int = 8             # held-out rows re-decided on the fp32-dequantized base
    gate_heldout_acc: float = 0.5       # held-out label accuracy must exceed this (and its
                                                     # Wilson lower bound the base's accuracy)
    gate_dpo_pair_acc: float = 0.5      # DPO: held-out pair accuracy must exceed this
    gate_dpo_task_drop: float = 0.0625  # DPO: held-out accuracy may fall this much below SFT's
    gate_preservation: float = 0.10     # preservation loss may rise at most this (nats/token)
    gate_train_drop: float = 0.0        # final train loss must be below the first by more
    gate_merge: float = 1e-2            # merged-vs-separate max logit difference
    gate_format: float = 0.9            # greedy output = exactly one label + end-of-turn, share
    gate_calibration: float = 0.25      # expected calibration error of the label decision, at most
    gate_slice: float = 0.5             # accuracy of the worst category, at least
    gate_stability: float = 0.9         # decisions equal on the fp32-dequantized base, share
    verify: bool = True                 # short `vkdsl verify` pass over the kernels used
    out: str = ""
    quiet: bool = False
    jsonl: bool = False
    def validate(self):
        checks = [
            (self.quant in ("keep", "none", "int4", "nf4"),
             "quant must be keep, none, int4 or nf4"),
            (self.precision in ("fp32", "fp16"), "precision must be fp32 or fp16"),
            (self.max_len >= 8, "max_len must be >= 8"),
            (bool(self.labels) or not self.label_eval,
             "labels is empty: name the labels the held-out completions are scored against, or "
             "turn label evaluation off (--no-label-eval: held-out loss only, no accuracy, "
             "calibration, format, slice or stability gates)"),
            (len(set(self.labels)) == len(self.labels), "labels must not repeat a label"),
            (self.truncation_side in ("left", "right"),
             "truncation_side must be 'left' or 'right'"),
            (self.loss_on in ("completion", "all"), "loss_on must be completion or all"),
            (self.bucket >= 1, "bucket must be >= 1"),
            (self.window == 0 or self.window >= self.max_len,
             f"window ({self.window}) must be 0 or at least max_len ({self.max_len}): every row "
             f"must fit one"),
            (self.window == 0 or self.pack, "window needs pack = true (rows share windows)"),
            (self.rank >= 1, "rank must be >= 1"),
            (self.alpha > 0, "alpha must be > 0"),
            (self.tmkl >= 0, "tmkl (lambda) must be >= 0"),
            (self.rehearsal_weight >= 0 and self.rehearsal_batch >= 1,
             "rehearsal_weight must be >= 0 and rehearsal_batch >= 1"),
            (self.rehearsal_weight == 0 or self.rehearsal_file,
             "rehearsal_weight > 0 needs a rehearsal_file of general text"),
            (self.tmkl_cache_bytes >= 0, "tmkl_cache_bytes must be >= 0"),
            (self.prefix_cache_bytes >= 0, "prefix_cache_bytes must be >= 0"),
            (self.checkpoint_layers >= 0, "checkpoint must be none, layers or every:K with K >= 1"),
            (self.activations in ("fp32", "fp16"),
             f"activations {self.activations!r}: expected fp32 or fp16"),
            (self._device_memory_ok(),
             f"device_memory {self.device_memory!r}: expected bytes with an optional "
             f"K/M/G suffix, e.g. 4G, or empty for the device's own budget"),
            (self.lr > 0, "lr must be > 0"),
            (self.warmup >= 0, "warmup must be >= 0"),
            (self.warmup <= self.steps or self.objective == "dpo",
             f"warmup ({self.warmup}) must not exceed steps ({self.steps}): the learning rate "
             f"would never reach lr"),
            (0 <= self.min_lr_ratio <= 1, "min_lr_ratio must be in [0, 1]"),
            (self.steps >= 1, "steps must be >= 1"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.grad_accum >= 1, "grad_accum must be >= 1"),
            (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
             "betas must be two values in [0, 1)"),
            (self.eps > 0, "eps must be > 0"),
            (self.weight_decay >= 0, "weight_decay must be >= 0"),
            (self.clip >= 0, "clip must be >= 0"),
            (self.eval_every >= 0 and self.checkpoint_every >= 0,
             "eval_every/checkpoint_every must be >= 0"),
            (self.format_tokens >= 1 and self.format_examples >= 0 and self.stability_rows >= 0,
             "format_tokens must be >= 1, format_examples and stability_rows >= 0"),
            (all(0 <= getattr(self, g) <= 1
                 for g in ("gate_format", "gate_calibration", "gate_slice", "gate_stability",
                                                       "gate_dpo_task_drop")),
             "gate_format, gate_calibration, gate_slice, gate_stability and gate_dpo_task_drop "
             "must be in [0, 1]"),
            (len(self.targets) > 0, "targets must name at least one module pattern"),
            (self.objective in ("sft", "dpo", "sft+dpo"), "objective must be sft, dpo or sft+dpo"),
            (self.reference in ("auto", "base", "sft", "none"),
             "reference must be auto, base, sft or none"),
            (self.dpo_steps >= 1 and self.dpo_batch >= 1, "dpo_steps and dpo_batch must be >= 1"),
            (self.dpo_beta > 0 and self.dpo_lr > 0 and self.dpo_nll_weight >= 0,
             "dpo_beta and dpo_lr must be > 0, dpo_nll_weight >= 0"),
        ]
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"config: {f.name}={v} is not a finite number")
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

# One line of help per setting: `vkdsl-train --help` is generated from FIELDS and this table.
HELP = {
    "model": "GGUF file or Hugging Face folder ('' = the installed SmolLM2-135M-Instruct)",
    "quant": "how the frozen base is stored on the device: keep (the file's own blocks, e.g. "
             "Q4_1), none (fp32), int4 or nf4 (packed on load, group 64)",
    "precision": "fp32 matmuls, or fp16: every matmul (adapters, fp32 and quantized bases) takes "
                 "fp16 inputs with fp32 sums, on cooperative matrices where the device has them "
                 "(vkdsl doctor says which)",
    "train_file": "SFT rows, JSONL: prompt/completion (optionally system) or messages",
    "heldout_file": "held-out rows (same format) for accuracy and loss evidence",
    "preservation_file": "JSONL rows of plain text whose loss must not rise (preservation)",
    "labels": "comma-separated label set the completions are scored against",
    "label_eval": "score every held-out row as a decision among the labels (its completion must be "
                  "one) with the accuracy, calibration, format, slice and stability surfaces and "
                  "gates; off: held-out loss only",
    "chat_template": "wrap prompt/completion as user/assistant turns",
    "max_len": "tokens per row after truncation",
    "truncation_side": "left: drop the prompt's start; right: the completion's end",
    "bucket": "pad lengths to multiples of this (few compiled programs)",
    "pack": "SFT: several short rows share one sequence (block-diagonal attention, positions "
            "restart per row) instead of padding",
    "window": "SFT on long data: each epoch's rows packed first-fit (longest first) into windows "
              "of this many tokens, batch_size windows per micro-batch; 0: each micro-batch's rows "
              "share sequences of its longest row",
    "rehearsal_file": "general text (plain lines or JSONL {text}) mixed into SFT as its own loss "
                      "term; keep it disjoint from preservation_file, which measures",
    "rehearsal_weight": "w: SFT objective = task mean + w * mean next-token loss on the "
                        "rehearsal text",
    "rehearsal_batch": "rehearsal passages per optimizer step (taken in order, cycling)",
    "loss_on": "SFT tokens scored: completion (the prompt masked) or all (prompt and template "
               "too: the negative control of `vkdsl probe prompt-mask`); evaluation always scores "
               "completions",
    "targets": "comma-separated module patterns the adapters go on (attn_q, q_proj, "
               "in_proj_qkv, ..., or all-linear)",
    "layers": "layers to adapt: '' = all, e.g. 0-3,7, or last:N for the top N layers",
    "rank": "LoRA rank r",
    "alpha": "LoRA alpha (scale alpha/r, or alpha/sqrt(r) with rslora)",
    "rslora": "rank-stabilized scale alpha/sqrt(r)",
    "tmkl": "lambda of the target-masked KL to the base; 0 = plain SFT (no base forward)",
    "checkpoint": "activation checkpointing: none keeps every layer's activations for the "
                  "backward; layers keeps each adapted layer's input and recomputes the layer in "
                  "the backward; every:K keeps one input in K layers (less memory, one more "
                  "forward of the adapted layers per step)",
    "activations": "storage of the activations kept for the backward: fp32, or fp16 (half the "
                   "bytes, needs the device's 16-bit storage; arithmetic stays fp32, the gradients "
                   "are those at the fp16-rounded activations: BENCHMARKS.md states the "
                   "difference)",
    "device_memory": "the device-memory budget the run is planned against (train.memplan), e.g. "
                     "4G; a run over it is refused before its first step with settings that fit; "
                     "empty: the device's heap (or $VKDSL_DEVICE_MEMORY_LIMIT)",
    "tmkl_cache_bytes": "bytes of host memory for the base model's logits at supervised positions, "
                        "computed once per training row; 0 = a base forward in every step",
    "prefix_cache_bytes": "bytes of host memory for the output of the layers below the first "
                          "adapted one, computed once per row and reused by every step and "
                          "evaluation; 0 = recompute",
    "lr": "peak learning rate (AdamW)",
    "warmup": "linear warm-up steps",
    "min_lr_ratio": "cosine decay floor as a fraction of lr",
    "steps": "optimizer steps of SFT",
    "batch_size": "rows per micro-batch (with window: windows)",
    "grad_accum": "micro-batches per optimizer step",
    "betas": "AdamW beta1,beta2",
    "eps": "AdamW epsilon",
    "weight_decay": "AdamW decoupled weight decay",
    "clip": "global gradient-norm clip; 0 = none",
    "seed": "adapter initialization seed",
    "data_seed": "data order seed",
    "objective": "sft, dpo or sft+dpo (SFT then DPO)",
    "dpo_train_file": "preference pairs, JSONL: prompt/chosen/rejected",
    "dpo_heldout_file": "held-out preference pairs",
    "dpo_steps": "optimizer steps of DPO",
    "dpo_beta": "DPO beta",
    "dpo_lr": "DPO learning rate",
    "dpo_batch": "pairs per DPO step",
    "dpo_nll_weight": "weight of an optional NLL on the chosen responses",
    "reference": "DPO reference: auto (the SFT adapter after SFT, else the base), base, "
                 "sft or none",
    "eval_every": "steps between held-out evaluations; 0 = only at the end",
    "eval_batch": "rows per evaluation batch",
    "checkpoint_every": "steps between checkpoints; 0 = only at the end",
    "merge_check_rows": "rows on which merged and separate logits are compared",
    "format_tokens": "format surface: tokens generated greedily for each failure shown",
    "format_examples": "format surface: failures generated verbatim and shown (0 = none; the share "
                       "is exact either way, from the teacher-forced pass)",
    "stability_rows": "stability surface: held-out rows decided again with the same adapter on "
                      "the base dequantized to fp32 (0 = skip)",
    "gate_heldout_acc": "gate: held-out label accuracy must exceed this, and its Wilson 95% lower "
                        "bound the base model's accuracy",
    "gate_dpo_pair_acc": "gate: DPO held-out pair accuracy (chosen above rejected) must "
                         "exceed this",
    "gate_dpo_task_drop": "gate: held-out label accuracy after DPO may be this much below after "
                          "SFT (2 of 32 rows)",
    "gate_preservation": "gate: preservation loss may rise at most this (nats/token)",
    "gate_train_drop": "gate: the final train loss must be below the first by more than this",
    "gate_merge": "gate: merged-vs-separate max logit difference",
    "gate_format": "gate: share of held-out prompts whose greedy output is exactly one label then "
                   "end-of-turn",
    "gate_calibration": "gate: expected calibration error of the label decision (10 bins) at "
                        "most this",
    "gate_slice": "gate: label accuracy of the worst held-out category at least this",
    "gate_stability": "gate: share of decisions unchanged when the base is dequantized to fp32",
    "verify": "a short `vkdsl verify` pass over the kernels used, before training",
    "out": "run folder ('' = runs/<date-time>)",
    "quiet": "print only the summary",
    "jsonl": "print one JSON object per event instead of progress",
}
assert set(HELP) == set(FIELDS), f"settings without help: {sorted(set(FIELDS) ^ set(HELP))}"


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
