"""Fixtures shared by the CPU engine tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_ddtree.adaptive.channel import StatsChannel


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private stand-in for /dev/shm (world-writable and sticky, like the real one)."""
    parent = tmp_path / "shm"
    parent.mkdir()
    os.chmod(parent, 0o1777)
    monkeypatch.setattr(StatsChannel, "DIR", str(parent))
    return parent
