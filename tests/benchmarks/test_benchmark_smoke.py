"""CPU smoke test of the benchmark harness (``python3 -m benchmarks.throughput``): it runs
vLLM's DFlash chain and DDTree on the tree-beats-chain fixture, writes JSON and a PNG, and
the numbers it reports are the engines' own (DDTree accepts one token per step there, the
chain none)."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def run_harness(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """throughput.py on CPU, fixture tree_beats_chain, budget 30, T = 0, plus ``args``."""
    cmd = [sys.executable, "-m", "benchmarks.throughput", "--cpu",
           "--fixture", "tree_beats_chain", "--out", str(tmp_path), "--budgets", "30",
           "--temps", "0", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_throughput_harness_cpu_smoke(tmp_path):
    """Interleaved engines, three repeats a cell: DFlash, DDTree, and DDTree with the
    suffix @base, which runs the package copy in --base-src (its engine process checks
    that every loaded vllm_ddtree module came from there and fails otherwise) side by side
    with the installed package, also combined with @inproc; without --base-src the harness
    refuses it.  (The @base engines join this run: a run of their own would start one more
    DFlash engine.)"""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(ROOT / "vllm_ddtree", base / "vllm_ddtree",
                    ignore=shutil.ignore_patterns("assets", "__pycache__"))
    out = tmp_path / "out"
    proc = run_harness(out, "--methods", "dflash,ddtree,ddtree-30@base,ddtree-30@base@inproc",
                       "--batches", "1,2", "--max-tokens", "10", "--repeats", "3",
                       "--base-src", str(base))
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["interleaved"] and res["meta"]["repeats"] == 3
    rows = {(r["method"], r["batch"]): r for r in res["rows"]}
    based = ("ddtree-30@base", "ddtree-30@base@inproc")
    assert set(rows) == {(m, n) for m in ("dflash", "ddtree-30", *based) for n in (1, 2)}
    for n in (1, 2):
        assert rows[("dflash", n)]["tau"] == pytest.approx(1.0)
        assert rows[("ddtree-30", n)]["tau"] == pytest.approx(2.0, abs=0.15)
        assert rows[("ddtree-30", n)]["vs_dflash"] > 0 and rows[("ddtree-30", n)]["vs_ar"] is None
        for m in ("dflash", "ddtree-30"):  # the cell totals its three runs
            r = rows[(m, n)]
            assert len(r["walls_s"]) == 3 and r["output_tokens"] == 30 * n
            assert r["wall_s"] == pytest.approx(sum(r["walls_s"]), abs=1e-3)
            # every request advances in every decode step (prefill steps pull it below n)
            assert n / 2 < r["req_per_engine_step"] <= n
            # every run's engine outputs were timed: a median gap per run, and trimming
            # stalls can only shorten the wall time
            assert len(r["median_gap_ms"]) == 3 and all(g > 0 for g in r["median_gap_ms"])
            assert r["tok_s_trimmed"] >= r["tok_s"] and r["stalls"] >= 0
        # paired ratio: the median over repeats of the ratio within one repeat
        d, t = rows[("dflash", n)], rows[("ddtree-30", n)]
        pairs = sorted(a / b for a, b in zip(t["tok_s_runs"], d["tok_s_runs"]))
        assert t["paired_vs_dflash"] == pytest.approx(pairs[1])
        assert d["paired_vs_dflash"] == pytest.approx(1.0)
        # the package copy's tree accepts one draft per step too
        for name in based:
            assert rows[(name, n)]["tau"] == pytest.approx(2.0, abs=0.15)
            assert rows[(name, n)]["vs_dflash"] > 0
    packages = res["meta"]["engine_package"]
    for name in ("dflash", "ddtree-30"):
        assert packages[name] == str((ROOT / "vllm_ddtree").resolve())
    for name in based:
        assert packages[name] == str((base / "vllm_ddtree").resolve())
    assert (out / "throughput.png").stat().st_size > 1000
    # the table is printed last
    assert proc.stdout.splitlines()[-1].startswith("ddtree-30@base@inproc")
    bad = subprocess.run([sys.executable, "-m", "benchmarks.throughput", "--cpu",
                          "--fixture", "tree_beats_chain", "--out", str(tmp_path / "x"),
                          "--methods", "ddtree-30@base"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and "--base-src" in bad.stderr


def test_throughput_sequential_and_aa_cpu_smoke(tmp_path):
    """--sequential (one engine at a time, as the profile and TP stages of gpu_stages.sh
    and gpu_tp.sh run it) and the A/A engine (dflash2) and the same engine with its core in-process
    (dflash@inproc): same configuration, so the same tokens and the same tau; no paired
    ratio for runs that were not interleaved."""
    proc = run_harness(tmp_path, "--methods", "dflash,dflash2,dflash@inproc", "--batches",
                       "2", "--max-tokens", "6", "--repeats", "2", "--sequential")
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["meta"]["interleaved"] is False
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"dflash", "dflash-b", "dflash@inproc"}
    core = res["meta"]["engine_core"]  # the engine core client of each engine
    assert core["dflash@inproc"] == "InprocClient" and core["dflash"] == core["dflash-b"]
    assert core["dflash"] != "InprocClient"
    for r in rows.values():
        assert r["output_tokens"] == 2 * 2 * 6 and r["paired_vs_dflash"] is None
        assert r["tau"] == pytest.approx(1.0) and r["vs_dflash"] > 0
        # both requests advance in every decode step (engine step counts themselves vary
        # by one between identical engines: when the prefill lands is a scheduling race)
        assert 1 < r["req_per_engine_step"] <= 2
    assert "dflash@inproc" in proc.stdout.splitlines()[-1]


def test_throughput_host_timing_cpu_smoke(tmp_path):
    """--host-timing: in-process engines, host ms per step by runner method; the DDTree
    engine is compared with the in-process DFlash engine."""
    proc = run_harness(tmp_path, "--methods", "dflash@inproc,ddtree@inproc", "--batches", "1",
                       "--max-tokens", "8", "--repeats", "2", "--host-timing")
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["meta"]["engine_core"] == {"dflash@inproc": "InprocClient",
                                          "ddtree-30@inproc": "InprocClient"}
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["ddtree-30@inproc"]["vs_dflash"] > 0  # against dflash@inproc
    for r in rows.values():
        host = {k: (ms, calls) for k, ms, calls in r["host_ms_per_step"]}
        ms, calls = host["runner.execute_model"]
        assert calls == pytest.approx(1.0) and ms > 0  # one call per engine step
        # inclusive times (vLLM 0.32's CPU runner): the forward inside execute_model, the
        # drafter inside the runner's propose step
        assert 0 < host["runner._model_forward"][0] <= ms
        assert 0 < host["drafter.propose"][0] <= host["runner.propose_draft_token_ids"][0]
        # the engine core's scheduler, once per step, outside the runner's time
        assert host["scheduler.schedule"][1] == pytest.approx(1.0, abs=0.1)
    assert "runner.execute_model" in proc.stdout.splitlines()[-1]
    # every method must be in-process, or the harness refuses before starting anything
    bad = subprocess.run([sys.executable, "-m", "benchmarks.throughput", "--cpu",
                          "--fixture", "tree_beats_chain", "--methods", "dflash,ddtree@inproc",
                          "--host-timing", "--out", str(tmp_path / "bad")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "@inproc" in bad.stderr


def test_throughput_profile_cpu_smoke(tmp_path):
    """--profile --trace: the host ops with the most self time per step and a gzipped
    Chrome trace per cell (on CPU there are no GPU kernels: GPU busy is 0)."""
    proc = run_harness(tmp_path, "--methods", "ddtree", "--batches", "1", "--max-tokens", "8",
                       "--profile", "--trace")
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["gpu_busy_ms"] == 0 and row["top_kernels"] == []
    assert row["prof_wall_ms"] > 0 and len(row["top_host"]) >= 4
    assert all(ms > 0 and calls > 0 for _, ms, calls in row["top_host"])
    trace = tmp_path / "trace-ddtree-30-T0-b1.json.gz"
    with gzip.open(trace, "rt") as f:
        assert json.load(f)["traceEvents"]
    # benchmarks.trace_summary: per step, the plugin's functions by host time; the
    # proposer runs once per step, and what it calls cannot take longer than it
    from benchmarks.trace_summary import load, summarize

    summ = summarize(load(str(trace)), None, "vllm_ddtree/", 40)
    ours = {name.rsplit(": ", 1)[-1]: (ms, calls) for name, ms, calls in summ["ours"]}
    # steps = propose calls in the trace; vLLM's counters saw as many drafts (batch 1)
    assert summ["steps"] >= 3 and abs(summ["steps"] - row["prof_steps"]) <= 1
    assert summ["gpu_idle_ms"] is None  # no kernels on CPU
    assert ours["build_tree"][1] == pytest.approx(1.0, abs=0.5)  # one tree per step
    assert 0 < ours["build_tree"][0] <= ours["propose"][0] <= summ["wall_ms"]
    assert proc.stdout.rstrip().splitlines()[-1].lstrip().startswith("host:")
