"""docs/architecture.md names code as ``path/module.py:Name`` (or ``:Class.method``) and
as plain ``path/module.py``: every one must exist, read from the source with ``ast``
(no import), so the step flow can be followed file by file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "vllm_ddtree"
DOC = ROOT / "docs" / "architecture.md"
# `tree/build.py:build_tree`, `gpu/tree_state.py:TreeStates.fill_rows`, `version.py`
REF = re.compile(r"`([\w/]+\.py)(?::([\w.]+))?`")


def _refs() -> list[tuple[str, str | None]]:
    return sorted(set(REF.findall(DOC.read_text())), key=str)


def _defines(path: Path, qualname: str) -> bool:
    """Whether ``path`` defines ``qualname`` (a top-level name, or ``Class.member``)."""
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in qualname.split("."):
        found = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        scope = getattr(found, "body", [])
    return True


def test_the_doc_names_code() -> None:
    assert len(_refs()) > 30  # the step flows name their files and functions


@pytest.mark.parametrize(("file", "name"), _refs(), ids=lambda v: v or "")
def test_named_code_exists(file: str, name: str) -> None:
    path = (ROOT if file.startswith("tests/") else PKG) / file
    assert path.is_file(), f"docs/architecture.md names {file}, which does not exist"
    if name:
        assert _defines(path, name), f"docs/architecture.md names {file}:{name}"


def test_a_missing_name_is_caught(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("class A:\n    def f(self): ...\n\nX = 1\n")
    assert _defines(module, "A.f") and _defines(module, "X")
    assert not _defines(module, "A.g") and not _defines(module, "B")
