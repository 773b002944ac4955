"""vkdsl.ops: training ops composed from vkdsl primitives, the hand-written kernels that earn
their place (attention, quant), and their verify rows."""
# checks registers the verify rows
from . import attention, checks, losses, nn, optim, quant  # noqa: F401
from .lora import LoRA, lora_linear, lora_scale            # noqa: F401
from .quant import checks as quant_checks                  # noqa: F401
