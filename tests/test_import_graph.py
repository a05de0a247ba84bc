"""The package's import graph: no circles between modules, and no import against the flow of the
layers (a module may import from its own sub-package or from any layer below it).

Every `import` / `from ... import` in the source counts, wherever it sits: module level, inside a
function, or under `if TYPE_CHECKING:` (a circle through a type-only import is still a circle a
reader has to follow). The graph is read from the AST, so nothing is imported to check it.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "swiftspec_mpi"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# top to bottom: a module imports from its own sub-package and from rows below its own, never
# from a row above nor from another sub-package of its row
LAYERS = [
    {"__main__"},
    {"cli"},
    {"serve"},
    {"engine", "bench"},
    {"checkpoints"},
    {"network"},
    {"trace"},            # trace.analyze names the GPU sharing mode (gpu.sharing)
    {"gpu"},              # gpu.w4a16 repacks the int4 format (packed.int4)
    {"packed"},
    {"core"},
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {_module_name(p): p for p in ROOT.rglob("*.py")}
    found.update({_module_name(p): p for p in ROOT.rglob("*.pyx")
                  if _module_name(p) not in found})
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that module `name` imports (resolving relative imports and
    `from pkg import submodule`)."""
    if path.suffix == ".pyx":
        return set()
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")
                up = up[:len(up) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            if not t.startswith(PACKAGE):
                continue
            while t and t not in known:           # `from pkg.mod import func` -> pkg.mod
                t = t.rpartition(".")[0]
            if t and t != name and t != PACKAGE:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    for i, row in enumerate(LAYERS):
        if parts[1] in row:
            return i
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        ls = _layer(src)
        for dst in sorted(targets):
            ld = _layer(dst)
            if ls is None or ld is None:
                continue
            same_pkg = src.split(".")[1] == dst.split(".")[1]
            if ld < ls or (ld == ls and not same_pkg):
                bad.append(f"{src} -> {dst}")
    return bad


def test_every_subpackage_has_a_layer():
    subs = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    placed = set().union(*LAYERS)
    assert subs <= placed, f"sub-packages without a layer in LAYERS: {sorted(subs - placed)}"


def test_graph_sees_function_level_imports():
    graph = import_graph()
    # network.transformer imports gpu kernels inside methods only
    assert f"{PACKAGE}.gpu.fused_ops" in graph[f"{PACKAGE}.network.transformer"]


def test_no_import_circles():
    circles = find_circles(import_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_upward_imports():
    bad = upward_imports(import_graph())
    assert not bad, "imports against the layers " + " -> ".join(
        "/".join(sorted(r)) for r in LAYERS) + ":\n" + "\n".join(bad)


def test_checker_catches_a_circle_and_an_upward_import():
    graph = {f"{PACKAGE}.core.a": {f"{PACKAGE}.core.b"}, f"{PACKAGE}.core.b": {f"{PACKAGE}.core.a"},
             f"{PACKAGE}.gpu.c": {f"{PACKAGE}.engine.d"}, f"{PACKAGE}.engine.d": set()}
    assert find_circles(graph) == [[f"{PACKAGE}.core.a", f"{PACKAGE}.core.b"]]
    assert upward_imports(graph) == [f"{PACKAGE}.gpu.c -> {PACKAGE}.engine.d"]
