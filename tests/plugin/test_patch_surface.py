"""The patch ledger against the installed vLLM: API surface, completeness, undo.

Driven by ``vllm_ddtree._patch.LEDGER``: a new ledger entry is checked here
without editing this file.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import vllm_ddtree
from vllm_ddtree import _patch, version
from vllm_ddtree._patch import ALIAS, LEDGER, REGISTRY, PatchEntry, entries_for, resolve
from vllm_ddtree._patch.helper import PatchSet, check_signature

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm", reason="needs vLLM")
#: the installed vLLM's adapter and its ledger entries (tests/test_vllm034.py runs this
#: file again with vLLM 0.34, for the registry adapter's)
ADAPTER = version.adapter()
ENTRIES = entries_for(ADAPTER)

_SYMBOLS = [
    pytest.param(entry, symbol, id=f"{entry.name}:{symbol}")
    for entry in ENTRIES
    for symbol in (*entry.replaces, *entry.reads)
]


@pytest.mark.parametrize(("entry", "symbol"), _SYMBOLS)
def test_symbol_exists_in_installed_vllm(entry: PatchEntry, symbol: str) -> None:
    resolve(symbol)  # raises ImportError / AttributeError on API drift


_CUDA_SYMBOLS = [
    pytest.param(entry, symbol, id=f"{entry.name}:{symbol}")
    for entry in ENTRIES
    for symbol in entry.reads_cuda_only
]


@pytest.mark.parametrize(("entry", "symbol"), _CUDA_SYMBOLS)
def test_cuda_only_symbol_exists_on_cuda_builds(entry: PatchEntry, symbol: str) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip(f"{symbol} is imported by vLLM only where CUDA runs; checked on the "
                    "GPU machine")
    resolve(symbol)


@pytest.mark.parametrize("entry", LEDGER, ids=lambda e: e.name)
def test_ledger_entry_complete(entry: PatchEntry) -> None:
    for name in ("why", "how", "removal_plan"):
        assert len(getattr(entry, name).strip()) > 20, f"{entry.name}.{name} is empty"
    assert entry.vllm_versions_checked
    assert entry.replaces
    assert entry.adapter in (REGISTRY, ALIAS, (REGISTRY, ALIAS))
    if entry.apply is not None:
        assert callable(resolve(entry.apply))
    else:  # changes a component makes to its own engine's objects, at run time
        assert "register" not in entry.stage


def test_ledger_names_unique_and_all_applied() -> None:
    names = [e.name for e in LEDGER]
    assert len(names) == len(set(names))
    vllm_ddtree.register()
    assert _patch.applied_names() == tuple(e.name for e in ENTRIES if e.apply is not None)


def _snapshot(cls: type) -> dict[str, Any]:
    return {
        "__init__": cls.__dict__["__init__"],
        "__post_init__": cls.__dict__["__post_init__"],
        "fields": dict(cls.__dataclass_fields__),
        "annotations": dict(cls.__annotations__),
        "pydantic_fields": list(cls.__pydantic_fields__),
        "attrs": {k for k in cls.__dict__ if k.startswith("ddtree")},
    }


@pytest.mark.skipif(ADAPTER != ALIAS, reason="the alias adapter's patch (vLLM 0.32)")
def test_undo_restores_originals() -> None:
    from vllm.config.speculative import SpeculativeConfig as cls

    vllm_ddtree._unregister()
    try:
        before = _snapshot(cls)
        assert not before["attrs"]
        with pytest.raises(ValueError, match="Input should be"):
            cls(method="ddtree", num_speculative_tokens=2)

        vllm_ddtree.register()
        patched = _snapshot(cls)
        assert patched["__post_init__"] is not before["__post_init__"]
        assert patched["__init__"] is not before["__init__"]
        added = {name for name in patched["fields"] if name.startswith("ddtree")}
        assert added == {"ddtree_max_depth", "ddtree_adaptive_budget"}

        vllm_ddtree._unregister()
        after = _snapshot(cls)
        assert after["__init__"] is before["__init__"]
        assert after["__post_init__"] is before["__post_init__"]
        assert after["fields"].keys() == before["fields"].keys()
        assert all(after["fields"][k] is before["fields"][k] for k in before["fields"])
        assert after["annotations"] == before["annotations"]
        assert after["pydantic_fields"] == before["pydantic_fields"]
        assert not after["attrs"]
        with pytest.raises(ValueError, match="Input should be"):
            cls(method="ddtree", num_speculative_tokens=2)
        assert cls(method="ngram", num_speculative_tokens=2).method == "ngram"
    finally:
        vllm_ddtree.register()


def _static(symbol: str) -> Any:
    """The raw object behind ``symbol`` (``cls.__dict__`` entry for class attributes)."""
    module, _, qualname = symbol.partition(":")
    owner_path, _, attr = qualname.rpartition(".")
    owner = resolve(f"{module}:{owner_path}") if owner_path else None
    if isinstance(owner, type):
        raw = owner.__dict__.get(attr, _MISSING)
    else:
        raw = resolve(symbol)
    return dict(raw) if isinstance(raw, dict) else raw


_MISSING = object()


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.apply is not None],
                         ids=lambda e: e.name)
def test_undo_restores_every_replaced_symbol(entry: PatchEntry) -> None:
    vllm_ddtree._unregister()
    try:
        before = {symbol: _static(symbol) for symbol in entry.replaces}
        vllm_ddtree.register()
        vllm_ddtree._unregister()
        for symbol, original in before.items():
            now = _static(symbol)
            if isinstance(original, dict):
                assert now.keys() == original.keys(), symbol
                assert all(now[k] is original[k] for k in original), symbol
            else:
                assert now is original, symbol
    finally:
        vllm_ddtree.register()


class _Probe:
    def __init__(self) -> None:
        self.buffer: list[int] = []


def test_resolve_instance_attribute_and_missing() -> None:
    from vllm_ddtree._patch import InstanceAttribute

    assert resolve(f"{__name__}:_Probe.buffer") == InstanceAttribute(_Probe, "buffer")
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        resolve(f"{__name__}:_Probe.nothing")


def _failing_apply(patches: PatchSet) -> None:
    from vllm.config.speculative import SpeculativeConfig

    patches.setattr(SpeculativeConfig, "_ddtree_probe", 1)
    raise RuntimeError("boom")


def test_failed_apply_rolls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config.speculative import SpeculativeConfig

    bad = PatchEntry(
        name="failing", replaces=("x",), adapter=(REGISTRY, ALIAS), reads=(), why="w",
        how="h", vllm_versions_checked=("t",), removal_plan="r",
        apply=f"{__name__}:_failing_apply",
    )
    monkeypatch.setattr(_patch, "LEDGER", (*LEDGER, bad))
    vllm_ddtree.register()
    with pytest.raises(RuntimeError, match="boom"):
        _patch.apply_all(ADAPTER)
    assert "_ddtree_probe" not in SpeculativeConfig.__dict__
    assert "failing" not in _patch.applied_names()


def test_patchset_records_and_undoes() -> None:
    class Target:
        kept = "old"

    mapping = {"a": 1}
    patches = PatchSet("t")
    patches.setattr(Target, "kept", "new")
    patches.setattr(Target, "added", 2)
    patches.setitem(mapping, "a", 10, "mapping['a']")
    patches.setitem(mapping, "b", 20, "mapping['b']")
    order: list[str] = []
    patches.on_undo("hook", lambda: order.append("hook"))
    with pytest.raises(RuntimeError, match="twice"):
        patches.setattr(Target, "kept", "again")
    assert (Target.kept, Target.added, mapping) == ("new", 2, {"a": 10, "b": 20})
    patches.undo()
    assert Target.kept == "old" and not hasattr(Target, "added")
    assert mapping == {"a": 1} and order == ["hook"] and not patches.active
    patches.undo()  # idempotent


def test_check_signature() -> None:
    def post_init(self: Any) -> None: ...

    check_signature(post_init, ("self",), "T.__post_init__", "0.32")
    with pytest.raises(RuntimeError, match=r"T.__post_init__: its signature is \(self, extra\)"):
        check_signature(lambda self, extra: None, ("self",), "T.__post_init__", "0.32")


@pytest.mark.skipif(ADAPTER != ALIAS, reason="the alias adapter's fields (vLLM 0.32)")
def test_added_fields_are_real_dataclass_fields() -> None:
    """`dataclasses.fields` / vLLM's `replace()` see the options; they are the only
    fields added (what the plugin derives is an attribute users cannot set)."""
    from vllm.config.speculative import SpeculativeConfig
    from vllm.config.utils import is_init_field

    vllm_ddtree.register()
    names = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    for extra in ("ddtree_max_depth", "ddtree_adaptive_budget"):
        assert extra in names and is_init_field(SpeculativeConfig, extra)
    assert not {"ddtree_enabled", "ddtree_depth", "ddtree_online_channel"} & names
