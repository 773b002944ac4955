"""vkdsl-train: LoRA SFT (+ target-masked KL to the base), then DPO, with preflight, evidence and gates.

    vkdsl-train                       # the bundled default run on SmolLM2-135M-Instruct
    vkdsl-train --out runs/x --steps 20 --tmkl 0.05 --targets attn_q,attn_v,ffn_up
    vkdsl-train --config my.toml      # any setting of train/config.py, TOML keys = flag names
    vkdsl-train --resume runs/x       # continue a stopped run from its last checkpoint
    vkdsl-train --objective dpo --reference none   # DPO only, reference-free control
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from . import config as C


def _verify(rep):
    import vkdsl.ops  # noqa: F401  (registers the op library's verify rows)
    from vkdsl.verify import verify
    t0 = time.perf_counter()
    rows = []
    for m in ("matmul", "dequant", "rmsnorm", "rope", "attention", "gather", "swiglu", "cross", "tmkl", "lora"):
        try:
            rows += verify(match=m, repeat_warm=False)[0]
        except Exception as e:     # noqa: BLE001 - a missing golden set is reported, not fatal
            rep.say(f"verify {m}: could not run ({type(e).__name__}: {e})")
    bad = [r for r in rows if not r.passed]
    rep.say(f"verify: {len(rows) - len(bad)}/{len(rows)} kernel checks pass on this device "
            f"({time.perf_counter() - t0:.1f}s)")
    if bad:
        raise SystemExit("verify failed: " + "; ".join(f"{r.op} {r.name}: {r.note or r.error}" for r in bad[:5]))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        print("settings (--name value):", ", ".join(C.FIELDS))
        return 0
    from .progress import Reporter
    from .trainer import TrainingStopped, run
    try:
        cfg_path, resume, over = C.parse_flags(argv)
        if resume:
            saved = Path(resume) / "config.json"
            if not saved.is_file():
                raise C.ConfigError(f"--resume {resume}: no config.json there")
            base = json.loads(saved.read_text())
            base.update({k: v for k, v in over.items()})
            cfg = C.load(None, base)
            out = resume
        else:
            cfg = C.load(cfg_path, over)
            out = cfg.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
            cfg.out = out
        if cfg.verify:
            _verify(Reporter(None, cfg.quiet, cfg.jsonl))
        t0 = time.perf_counter()
        r = run(cfg, out, resume=resume)
        from .stages import dpo_stage, export
        dpo_ev = dpo_stage(r) if "dpo" in cfg.objective else None
        export(r, dpo_ev)
        r.r.say(f"run folder: {out}  (total {time.perf_counter() - t0:.0f}s, training {r.train_seconds:.0f}s)")
        return 0 if all(ok for _, ok, _ in r.gates) else 2
    except (C.ConfigError, ValueError, FileNotFoundError, TrainingStopped) as e:
        print(f"vkdsl-train: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
