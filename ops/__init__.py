"""vkdsl.ops: training ops composed from vkdsl primitives, plus their verify rows."""
from . import checks, losses, nn, optim  # noqa: F401  (checks registers verify rows)
from .lora import LoRA, lora_linear, lora_scale  # noqa: F401
from . import quant_checks  # noqa: F401
