"""vkdsl's GGUF LoRA on Qwen3.5, applied by llama.cpp itself (llama-cpp-python) to the GGUF its
converter made (tests/fixtures/qwen35/qwen35-f16.gguf): adapters on every linear module, set on the
model vkdsl loaded from the Hugging Face folder and from the GGUF (the two orders of the value
heads), saved as GGUF LoRA, loaded by llama.cpp with the base; its logits against vkdsl's.

Needs llama-cpp-python beside vkdsl (not a dependency of vkdsl or its tests), so it is a command:

    python tests/llama_cpp_check.py    # exit 1 unless llama.cpp agrees within its own error
    python tests/llama_cpp_check.py RUN_DIR   # also the adapter.gguf of a vkdsl-train run on
                                              # tests/fixtures/qwen35/hf

llama.cpp computes in lower precision than transformers and vkdsl (its base logits differ from
transformers' by ~0.7% of the largest logit on this model), so the agreement asked for is that
level, 2e-2, while the adapter itself moves the logits by ~100%: an adapter llama.cpp read with
the value heads in the wrong order disagrees by ~100% (checked by hand)."""
import sys
from pathlib import Path

import numpy as np

FILES = Path(__file__).resolve().parent / "fixtures" / "qwen35"


def rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def main() -> int:
    import tempfile

    from llama_cpp import Llama

    import vkdsl
    from vkdsl.models import load_checkpoint
    from vkdsl.models.adapters import save_gguf_adapter
    from vkdsl.models.build import build_model
    from vkdsl.models.llama import LogitsFn
    from vkdsl.ops.lora import LoRA
    ids = np.load(FILES / "transformers_logits.npz")["ids"].tolist()
    ok = True

    def cpp(lora=None):
        m = Llama(model_path=str(FILES / "qwen35-f16.gguf"), lora_path=lora, logits_all=True, n_ctx=256,
                  verbose=False, n_threads=2)
        m.eval(ids)
        return np.array(m.scores[:len(ids)])
    base_cpp = cpp()
    for src in ("hf", "qwen35-f16.gguf"):
        model = build_model(load_checkpoint(FILES / src))
        base = LogitsFn(model)(np.array([ids], np.int32))[0]
        rng = np.random.default_rng(7)
        table = {}
        for j, name in enumerate(model.linear):
            d_out, d_in = model.linear[name].shape
            table[name] = LoRA.init(d_in, d_out, 4, 8.0, seed=j, name=name)
            table[name].B.assign(vkdsl.tensor((0.15 * rng.standard_normal((4, d_out))).astype(np.float32)))
        model.lora = table
        ours = LogitsFn(model)(np.array([ids], np.int32))[0]
        with tempfile.TemporaryDirectory() as tmp:
            save_gguf_adapter(model, Path(tmp) / "lora.gguf", r=4, alpha=8.0)
            theirs = cpp(str(Path(tmp) / "lora.gguf"))
        agree, moved = rel(theirs, ours), rel(ours, base)
        argmax = float((theirs.argmax(-1) == ours.argmax(-1)).mean())
        print(f"adapter set on the model from {src}: llama.cpp with vkdsl's GGUF LoRA vs vkdsl: {agree:.2e} of the "
              f"largest logit, argmax agreement {argmax:.3f}; the adapter moves the logits by {moved:.2f}; "
              f"llama.cpp's base vs vkdsl's: {rel(base_cpp, base):.2e}")
        ok &= agree <= 2e-2 and argmax >= 0.95 and moved > 0.5
    if len(sys.argv) > 1:                       # a trained run's own export
        from vkdsl.models import load_tokenizer
        from vkdsl.models.adapters import load_adapter
        model = build_model(load_checkpoint(FILES / "qwen35-f16.gguf"))
        base = LogitsFn(model)(np.array([ids], np.int32))[0]
        load_adapter(model, Path(sys.argv[1]) / "adapter.gguf", load_tokenizer(FILES / "hf"), force=True)
        ours = LogitsFn(model)(np.array([ids], np.int32))[0]
        theirs = cpp(str(Path(sys.argv[1]) / "adapter.gguf"))
        agree, moved = rel(theirs, ours), rel(ours, base)
        print(f"{sys.argv[1]}/adapter.gguf: llama.cpp vs vkdsl {agree:.2e}, argmax agreement "
              f"{float((theirs.argmax(-1) == ours.argmax(-1)).mean()):.3f}; the trained adapter moves the logits "
              f"by {moved:.2e}")
        ok &= agree <= 2e-2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
