"""The package's import rules (docs/architecture.md), read from the source with ``ast``:
no import cycle between modules, a core that imports neither vLLM nor the adapters,
kernels that import nothing from the tree module, and a runtime that never imports the
tooling (``testing/``, ``demo/``).  Imports inside functions count: a lazy import still
ties two modules together."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "vllm_ddtree"
TOOLING = ("vllm_ddtree.testing", "vllm_ddtree.demo")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module ``name`` imports (absolute names; ``from pkg import sub`` counts as
    importing ``pkg.sub`` when that is a module)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = {f"{mod}.{a.name}" for a in node.names} & known
            out.update(subs or {mod})
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {n: _imports(n, p, known) for n, p in mods.items()}


def _internal(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {n: {m for m in deps if m in graph and m != n} for n, deps in graph.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def _strip_parents(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Drop edges from a module to the packages that contain it (importing
    ``vllm_ddtree.tree.build`` runs ``vllm_ddtree/tree/__init__.py`` first: Python's own
    order, not a dependency of the module on its package)."""
    return {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}


def test_no_import_cycle() -> None:
    cycle = _find_cycle(_strip_parents(_internal(_graph())))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_detector_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("core", ["vllm_ddtree.tree", "vllm_ddtree.kernels"])
def test_core_imports_no_vllm_and_no_adapter(core: str) -> None:
    graph = _graph()
    for name, deps in graph.items():
        if name != core and not name.startswith(core + "."):
            continue
        bad = {d for d in deps if d == "vllm" or d.startswith("vllm.")
               or d.startswith(("vllm_ddtree.gpu", "vllm_ddtree.cpu", "vllm_ddtree._patch",
                                *TOOLING))}
        assert not bad, f"{name} imports {sorted(bad)}"


def test_kernels_import_nothing_from_tree() -> None:
    for name, deps in _graph().items():
        if name.startswith("vllm_ddtree.kernels"):
            bad = {d for d in deps if d.startswith("vllm_ddtree.tree")}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_runtime_never_imports_tooling() -> None:
    for name, deps in _graph().items():
        if name.startswith(TOOLING):
            continue
        bad = {d for d in deps if d.startswith(TOOLING)}
        assert not bad, f"{name} imports the tooling {sorted(bad)}"
