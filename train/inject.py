"""Put LoRA adapters on the linear layers whose names match the configured patterns."""
from __future__ import annotations

import re

from vkdsl.ops.lora import LoRA

from vkdsl.models.config import MODULES

HF_ALIASES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
              "in_proj_qkv": "attn_qkv", "in_proj_z": "attn_gate", "in_proj_b": "ssm_beta",
              "in_proj_a": "ssm_alpha", "out_proj": "ssm_out"}


class InjectError(ValueError):
    pass


def parse_layers(spec: str, n_layers: int) -> list[int]:
    if not spec.strip():
        return list(range(n_layers))
    if spec.strip().startswith("last:"):
        n = spec.strip()[5:]
        if not n.isdigit() or int(n) < 1:
            raise InjectError(f"layers: {spec!r} needs a positive count (e.g. last:10)")
        return list(range(max(0, n_layers - int(n)), n_layers))
    out = set()
    for part in spec.split(","):
        a, _, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b or a)
        except ValueError:
            raise InjectError(f"layers: cannot read {part!r} (use e.g. '0-3,7')") from None
        if lo > hi:
            raise InjectError(f"layers: {part!r} is reversed (write {hi}-{lo})")
        if not 0 <= lo <= hi < n_layers:
            raise InjectError(f"layers: {part!r} is outside 0..{n_layers - 1}")
        out |= set(range(lo, hi + 1))
    return sorted(out)


def match_modules(names, patterns, layers) -> list[str]:
    """patterns: 'attn_q', 'q_proj', a full name 'blk.3.attn_q', a regex, or 'all-linear' (every
    linear module of the layers, as PEFT's target_modules says it). Each must match."""
    keep = [n for n in names if int(n.split(".")[1]) in layers]
    chosen = []
    for p in patterns:
        mod = HF_ALIASES.get(p, p)
        if mod == "all-linear":
            hit = keep
        elif mod in MODULES:
            hit = [n for n in keep if n.endswith("." + mod)]
        else:
            try:
                rx = re.compile(mod)
            except re.error as e:
                raise InjectError(f"target pattern {p!r} is not a module name or a valid "
                                  f"regex: {e}") from None
            hit = [n for n in keep if rx.fullmatch(n)]
        if not hit:
            kinds = sorted({n.split(".")[2] for n in names}, key=MODULES.index)
            raise InjectError(f"target pattern {p!r} matched no module in layers "
                              f"{layers[0]}..{layers[-1]}; available: {', '.join(kinds)} "
                              f"(HF: {', '.join(HF_ALIASES)}), "
                              f"or full names like {keep[0] if keep else names[0]}")
        chosen += [n for n in hit if n not in chosen]
    return sorted(chosen, key=lambda n: (int(n.split(".")[1]), MODULES.index(n.split(".")[2])))


def inject(model, cfg) -> list[str]:
    """Attach LoRA to every matched module (seeded per module). Returns the matched names."""
    layers = parse_layers(cfg.layers, model.cfg.n_layers)
    names = match_modules(list(model.linear), cfg.targets, layers)
    for k, n in enumerate(names):
        out_dim, in_dim = model.linear[n].shape
        model.lora[n] = LoRA.init(in_dim, out_dim, cfg.rank, cfg.alpha, cfg.rslora,
                                  seed=cfg.seed * 100003 + k, name=n)
    return names


def params_of(model, names):
    return [p for n in names for p in model.lora[n].params()]


def count_report(model, names) -> tuple[int, int, str]:
    train = sum(p.size for p in params_of(model, names))
    base = sum(w.shape[0] * w.shape[1] for w in model.linear.values())
    c = model.cfg
    base += c.vocab_size * c.dim + sum(t.size for t in model.vector.values())
    lines = [f"LoRA on {len(names)} modules: "
             f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}",
             f"trainable parameters: {train:,} of {base + train:,} "
             f"({100 * train / (base + train):.4f}%)"]
    return train, base, "\n".join(lines)
