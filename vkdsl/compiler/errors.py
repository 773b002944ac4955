"""Compile errors that show the compiler's message next to the offending GLSL lines."""
import re


class CompileError(RuntimeError):
    def __init__(self, name: str, log: str, source: str, compiler: str):
        self.name, self.log, self.source = name, log, source
        lines = source.splitlines()
        bad = sorted({int(m) for m in re.findall(r":(\d+):", log) if 0 < int(m) <= len(lines)})
        show = sorted({j for i in bad for j in range(max(1, i - 2), min(len(lines), i + 2) + 1)}) \
            or range(1, len(lines) + 1)
        listing = "\n".join(f"{'>>' if i in bad else '  '} {i:4d} | {lines[i - 1]}" for i in show)
        super().__init__(f"GLSL compile of kernel '{name}' failed "
                         f"({compiler}):\n{log.strip()}\n{listing}")


class NoCompiler(RuntimeError):
    """No shader compiler on this machine and the kernel is not in the SPIR-V bundle."""
