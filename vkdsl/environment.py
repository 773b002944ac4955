"""The VKDSL_* environment variables a user sets, checked together before any command works: a
misspelled value is one line naming the variable, never a silent default (issue 31: a bad
$VKDSL_PROFILE listed devices as if unset; a bad $VKDSL_PRECISION trained at fp32)."""
from __future__ import annotations

import os

COMPILERS = ("libshaderc", "glslc", "glslangValidator", "none")


def check_environment() -> None:
    """Raise ValueError (one line) for the first VKDSL_* variable whose value cannot be meant."""
    from .precision import current
    from .runtime.context import parse_bytes
    from .runtime.profiles import named
    named()                                          # $VKDSL_PROFILE
    current()                                        # $VKDSL_PRECISION
    limit = os.environ.get("VKDSL_DEVICE_MEMORY_LIMIT")
    if limit:
        parse_bytes(limit)
    choices = {"VKDSL_VALIDATION": ("", "0", "1", "sync"), "VKDSL_COMPILER": ("",) + COMPILERS,
               "VKDSL_DEBUG": ("", "0", "1"), "VKDSL_SPIRV_SHIPPED": ("", "0", "1"),
               "VKDSL_TUNING": ("", "0", "1")}
    for var, allowed in choices.items():
        v = os.environ.get(var, "")
        # VKDSL_VALIDATION is read case-blind; the others as written
        if (v.strip().lower() if var == "VKDSL_VALIDATION" else v) not in allowed:
            values = [a for a in allowed if a]
            raise ValueError(f"{var}={v!r}: expected {', '.join(values[:-1])} or {values[-1]}")
