"""CPU smoke test of the acceptance benchmark (``python3 -m benchmarks.acceptance``) on the
real pair: SmolLM2-135M + a DFlash drafter trained here for a few steps
(``python3 -m scripts.train_drafter --tiny``).  Two held-out prompts x 16 greedy tokens, chain
and DDTree at budget 32 (one budget: every fixed budget runs the same code, and each costs an
engine start and a reference run);
the reference loop on one prompt must give the same tau as vLLM (fp32: exact)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    from vllm_ddtree.demo.smollm import SmolLMUnavailable, ensure_smollm

    try:
        ensure_smollm()
    except SmolLMUnavailable as e:  # fail, not skip: setup-cpu.sh installs the wheel
        pytest.fail(f"SmolLM2 GGUF unavailable: {e}", pytrace=False)
    out = tmp_path_factory.mktemp("drafter")
    cmd = [sys.executable, "-m", "scripts.train_drafter", "--out", str(out),
           "--device", "cpu", "--steps", "3", "--tiny", "--threads", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def test_acceptance_benchmark_cpu_smoke(drafter, tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.acceptance", "--cpu", "--drafter", str(drafter),
           "--out", str(tmp_path), "--num-prompts", "2", "--max-tokens", "16", "--budgets", "32",
           "--temps", "0", "--ref-prompts", "1"]
    # One OpenMP thread: on a busy 2-core machine more threads than free cores make the tiny
    # forwards many times slower (10+ min instead of ~1.5).
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "acceptance.json").read_text())

    assert {"command", "versions", "config", "prompts", "vllm", "reference",
            "best_ddtree"} <= set(res)
    assert len(res["prompts"]) == 2 and all(p["kind"] in ("code", "chat") for p in res["prompts"])
    rows = {(r["method"], r["budget"]): r for r in res["vllm"]}
    assert set(rows) == {("dflash", 15), ("ddtree", 32)}
    for r in rows.values():
        assert r["temperature"] == 0.0 and r["drafts"] > 0
        assert 1.0 <= r["tau"] <= 16.0
        assert r["tau"] == pytest.approx(1 + r["accepted"] / r["drafts"])
        assert sum(r["per_pos"]) == r["accepted"]  # steps with >= k accepted, summed over k
        assert sum(r["hist"]) == pytest.approx(1.0)
        assert sum((L + 1) * p for L, p in enumerate(r["hist"])) == pytest.approx(r["tau"])

    ref = {(r["method"], r["budget"]): r for r in res["reference"]}
    assert set(ref) == set(rows)
    for key, r in ref.items():
        assert r["prompts"] == 1 and 1.0 <= r["tau_ref"] <= 16.0
        # Same prompt, same greedy tokens, same steps: vLLM's DDTree is the reference loop.
        assert r["tokens_equal"], key
        assert r["steps_vllm"] == r["steps_ref"], key
        assert r["tau_vllm"] == pytest.approx(r["tau_ref"], rel=0.01), key
        assert r["passed"]
    assert res["all_reference_pass"] is True

    for name in ("tau_vs_budget.png", "accept_hist.png"):
        assert (tmp_path / name).stat().st_size > 1000
    # the table is last
    assert proc.stdout.rstrip().splitlines()[-1].split()[:2] == ["ddtree", "32"]
