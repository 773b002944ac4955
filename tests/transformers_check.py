"""golden/qwen35_ref.py against transformers' own Qwen3_5ForCausalLM, on the tiny random model of
tests/fixtures/qwen35.py. Needs torch and transformers >= 5 (not dependencies of vkdsl or its
tests: a scratch environment holds them), so it is a command, not part of the suite:

    python tests/transformers_check.py        # prints max |diff| / max |logit|, exit 1 above 1e-5

transformers computes the delta rule and the gated norm in float32 even for a float64 model, so
the two agree to ~1e-6 of the largest logit, not to float64 precision."""
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]


def main() -> int:
    import torch
    from transformers import Qwen3_5ForCausalLM

    from fixtures import qwen35 as fx
    from golden import qwen35_ref
    ids = [5, 17, 200, 33, 9, 1, 2, 250, 44, 45, 46, 7, 8, 9] * 6
    with tempfile.TemporaryDirectory() as tmp:
        folder, w = fx.write(tmp, mtp=False)
        model = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
        with torch.no_grad():
            got = model(torch.tensor([ids])).logits[0].numpy()
    want = qwen35_ref.forward(w, fx.CONFIG, ids)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"transformers Qwen3_5ForCausalLM vs golden/qwen35_ref.py, {len(ids)} tokens: "
          f"max |diff| / max |logit| = {err:.2e}")
    return 0 if err <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
