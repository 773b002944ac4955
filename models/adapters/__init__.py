"""LoRA adapters in formats other tools load, and back: Hugging Face PEFT (peft), llama.cpp's GGUF
LoRA (gguf_lora), and what both share (bundle: the in-memory convention, reading either format,
installing it on a model, a training run's bundle)."""
from ..config import LINEARS  # noqa: F401
from .bundle import (load_adapter, read_adapter, resolve_adapter_path,  # noqa: F401
                     save_adapter_bundle)
from .common import (AdapterWeights, adapter_mismatches, heads,  # noqa: F401
                     model_adapter_arrays, module_shape)
from .gguf_lora import save as save_gguf_adapter  # noqa: F401
from .peft import save as save_peft  # noqa: F401
