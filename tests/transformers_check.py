"""Qwen3.5 against transformers and PEFT themselves, on the tiny random model of
tests/fixtures/qwen35.py:

1. golden/qwen35_ref.py (the suite's float64 reference) against transformers' Qwen3_5ForCausalLM;
2. vkdsl's device logits with LoRA on every linear module (the DeltaNet projections included),
   saved as a PEFT adapter by vkdsl, against PeftModel.from_pretrained on transformers' model.

Needs torch, transformers >= 5 and peft beside vkdsl (not dependencies of vkdsl or its tests: a
scratch environment holds them), so it is a command, not part of the suite:

    python tests/transformers_check.py        # prints both errors; exit 1 if either is above 1e-5
    python tests/transformers_check.py RUN    # also the PEFT adapter of a vkdsl-train run (RUN/adapter)
                                              # made on tests/fixtures/qwen35/hf, against PEFT there

transformers computes the delta rule and the gated norm in float32 even for a float64 model, so
the agreement is ~1e-6 of the largest logit, not float64's."""
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]
IDS = [5, 17, 200, 33, 9, 1, 2, 250, 44, 45, 46, 7, 8, 9] * 6


def rel(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def vkdsl_with_peft_adapter(folder: Path, out: Path) -> np.ndarray:
    """Logits of the device model with random adapters on every linear module; the adapter saved
    as PEFT into `out`."""
    import vkdsl
    from vkdsl.models import load_checkpoint
    from vkdsl.models.adapters import save_peft
    from vkdsl.models.llama import LogitsFn
    from vkdsl.models.qwen35 import Qwen35
    from vkdsl.ops.lora import LoRA
    model = Qwen35(load_checkpoint(folder), quant="none")
    rng = np.random.default_rng(7)
    table = {}
    for j, name in enumerate(model.linear):
        d_out, d_in = model.linear[name].shape
        table[name] = LoRA.init(d_in, d_out, 4, 8.0, seed=j, name=name)
        table[name].B.assign(vkdsl.tensor((0.2 * rng.standard_normal((4, d_out))).astype(np.float32)))
    model.lora = table
    save_peft(model, out, r=4, alpha=8.0)
    return LogitsFn(model)(np.array([IDS], np.int32))[0]


def main() -> int:
    import torch
    from peft import PeftModel
    from transformers import Qwen3_5ForCausalLM

    from fixtures import qwen35 as fx
    from golden import qwen35_ref
    with tempfile.TemporaryDirectory() as tmp:
        folder, w = fx.write(Path(tmp) / "model", mtp=False)
        model = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
        with torch.no_grad():
            base = model(torch.tensor([IDS])).logits[0].numpy()
        e1 = rel(base, qwen35_ref.forward(w, fx.CONFIG, IDS))
        print(f"transformers Qwen3_5ForCausalLM vs golden/qwen35_ref.py, {len(IDS)} tokens: "
              f"max |diff| / max |logit| = {e1:.2e}")
        ours = vkdsl_with_peft_adapter(folder, Path(tmp) / "adapter")
        peft_model = PeftModel.from_pretrained(model, Path(tmp) / "adapter").eval()
        with torch.no_grad():
            theirs = peft_model(torch.tensor([IDS])).logits[0].numpy()
        e2 = rel(ours, theirs)
        print(f"vkdsl (device, fp32) with its PEFT export vs PEFT on transformers, LoRA on "
              f"{len(peft_model.peft_config['default'].target_modules)} module kinds: max |diff| / max |logit| = {e2:.2e}")
        moved = rel(theirs, base)
        print(f"  (the adapter moves transformers' logits by {moved:.2e} of the largest: not a no-op)")
    ok = e1 <= 1e-5 and e2 <= 1e-5 and moved > 1e-2
    if len(sys.argv) > 1:                       # a trained run's own PEFT export, on the committed fixture
        from vkdsl.models import load_checkpoint, load_tokenizer
        from vkdsl.models.adapters import load_adapter
        from vkdsl.models.build import build_model
        from vkdsl.models.llama import LogitsFn
        hf = Path(__file__).parent / "fixtures" / "qwen35" / "hf"
        run = Path(sys.argv[1]) / "adapter"
        model = build_model(load_checkpoint(hf))
        load_adapter(model, run, load_tokenizer(hf), force=True)
        ours = LogitsFn(model)(np.array([IDS], np.int32))[0]
        base = Qwen3_5ForCausalLM.from_pretrained(hf, dtype=torch.float64).eval()
        with torch.no_grad():
            theirs = PeftModel.from_pretrained(base, run).eval()(torch.tensor([IDS])).logits[0].numpy()
        e3 = rel(ours, theirs)
        print(f"{run}: vkdsl vs PEFT on transformers: {e3:.2e} of the largest logit")
        ok &= e3 <= 1e-4
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
