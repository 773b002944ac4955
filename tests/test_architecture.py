"""The shape of the code, checked: no import cycle among product modules (imports inside
functions count), imports flow one way between the layers, no product file grows past 400 lines
or holds a line over 100 characters, and the README's layout table names what is in the tree."""
import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# source folder -> the package it ships as (pyproject.toml's package-dir)
PACKAGES = {"vkdsl": "vkdsl", "ops": "vkdsl.ops", "models": "vkdsl.models", "train": "vkdsl.train",
            "cli": "vkdsl.cli", "golden": "vkdsl_golden"}
# layer -> module prefixes it must never import
FORBIDDEN = {
    "core": ("vkdsl.ops", "vkdsl.models", "vkdsl.train", "vkdsl.cli"),
    "vkdsl.ops": ("vkdsl.models", "vkdsl.train", "vkdsl.cli"),
    "vkdsl.models": ("vkdsl.train", "vkdsl.cli"),
    "vkdsl.train": ("vkdsl.cli",),
    "vkdsl_golden": ("vkdsl",),
}
MAX_LINES = 400
MAX_WIDTH = 100


def product_modules() -> dict[str, Path]:
    mods = {}
    for folder, pkg in PACKAGES.items():
        for py in sorted((REPO / folder).rglob("*.py")):
            rel = py.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if folder == "vkdsl" and parts and parts[0] in ("ops", "models", "train", "cli"):
                continue
            mods[".".join([pkg, *parts])] = py
    return mods


def _resolve(name: str, mods) -> str | None:
    """The deepest product module a dotted name refers to (a module, else its package)."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(mod: str, path: Path, mods) -> set[str]:
    """Product modules that `mod` imports anywhere in its file (top level or inside functions)."""
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")
                up = up[:len(up) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import x`: the submodule pkg.x where there is one, else pkg itself
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for n in names:
            target = _resolve(n, mods)
            if target and target != mod:
                out.add(target)
    return out


def graph():
    mods = product_modules()
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def _layer(mod: str) -> str:
    for prefix in ("vkdsl.ops", "vkdsl.models", "vkdsl.train", "vkdsl.cli", "vkdsl_golden"):
        if mod == prefix or mod.startswith(prefix + "."):
            return prefix
    return "core"


def cycles(g) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_lazy_imports():
    # the walk must find imports inside functions, or the cycle check proves nothing
    g = graph()
    assert "vkdsl.realize" in g["vkdsl.tensor"]
    assert "vkdsl.ops.quant.kernels" in g["vkdsl.ops.quant.linear"]
    assert len(g) > 60


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_flow_one_way():
    bad = [(m, t) for m, ts in graph().items() for t in ts
           if any(t == f or t.startswith(f + ".") for f in FORBIDDEN.get(_layer(m), ()))]
    assert bad == []


@pytest.mark.parametrize("mod", sorted(product_modules()))
def test_product_files_stay_small(mod):
    lines = product_modules()[mod].read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"{mod}: {len(lines)} lines; split it by role"
    wide = [i + 1 for i, line in enumerate(lines) if len(line) > MAX_WIDTH]
    assert wide == [], f"{mod}: lines {wide[:5]} are over {MAX_WIDTH} characters"


def test_readme_layout_table_matches_the_tree():
    text = (REPO / "README.md").read_text()
    table = text[text.index("## Layout"):]
    listed = set(re.findall(r"^\| `([^`]+)`", table, re.M))
    for path in listed:
        for p in re.split(r"`, `", path):
            assert (REPO / p.rstrip("/")).exists(), f"README lists {p}, not in the tree"
    top = {p.name + "/" for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")
           and (p / "__init__.py").exists() or p.name == "tests"}
    named = " ".join(listed)
    for d in sorted(top):
        assert d in named, f"{d} is in the tree but not in README's layout table"
