"""Golden cases of the GPU kernels' blocks: each block (128, 64, 32) of the shared-memory matmul on
a ragged shape, in every form. The shape rule (vkdsl.handwritten.gpu_config) alone would pick one
block per row, so verify forces each; the reference is the plain matmul's."""
from __future__ import annotations

from .cases import Case, _mm_inputs


def cases() -> list[Case]:
    out = []
    for form, ta, tb in [("nn", False, False), ("nt", False, True), ("tn", True, False)]:
        for block in (128, 64, 32):
            out.append(Case(f"matmul_block[{form},129x257x95,block={block}]", "matmul_block",
                            {"ta": ta, "tb": tb, "block": block},
                            lambda r, ta=ta, tb=tb: _mm_inputs(r, 129, 257, 95, ta, tb)))
    return out


def every_case() -> list[Case]:
    """Every version-1 case in manifest order: cases.all_cases, the quantized formats', precision
    fp16's, the GPU blocks'."""
    from .cases import all_cases
    from .cases_fp16 import cases as fp16_cases
    from .cases_quant import quant_cases
    return all_cases() + quant_cases() + fp16_cases() + cases()
