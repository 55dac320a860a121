"""Runs ``tests/v034`` (the vLLM 0.34 adapter against vLLM 0.34's modules) and the patch
ledger's surface tests in a subprocess whose vLLM is 0.34: the wheel that
``scripts/setup-cpu.sh`` installs under ``.cache/vllm-0.34`` (or the folder named by
``VLLM_DDTREE_VLLM034``), first on ``PYTHONPATH``.  Fails when that folder is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SITE_ENV = "VLLM_DDTREE_VLLM034"


def _site() -> Path:
    return Path(os.environ.get(SITE_ENV, REPO / ".cache" / "vllm-0.34"))


@pytest.mark.vllm
def test_vllm034_adapter_suite() -> None:
    import vllm

    if str(vllm.__version__).startswith("0.34."):
        pytest.skip("this process's vLLM is 0.34: tests/v034 runs directly")
    site = _site()
    assert (site / "vllm" / "__init__.py").is_file(), (
        f"no vLLM 0.34 under {site}: run scripts/setup-cpu.sh (or set {SITE_ENV})")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/v034", "tests/plugin/test_patch_surface.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-12000:] + result.stderr[-4000:]
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-2000:]
