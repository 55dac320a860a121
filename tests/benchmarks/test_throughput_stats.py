"""The benchmark harness's statistics (benchmarks/throughput.py), without vLLM: which
prompts a repeat takes, how a cell totals its runs, and the paired ratio."""

import json

import pytest

from benchmarks.throughput import (
    Run,
    _cell,
    add_ratios,
    build_methods,
    cell_row,
    check_base_modules,
    cpu_sets,
    graph_tokens,
    has_suffix,
    pin_process_tree,
    rotated,
    trim_stalls,
)


def test_each_repeat_takes_the_next_prompts():
    prompts = list("abcde")
    assert _cell(prompts, 2, 0) == ["a", "b"] and _cell(prompts, 2, 1) == ["c", "d"]
    assert _cell(prompts, 2, 2) == ["e", "a"]  # wraps around
    assert _cell(prompts, 1, 3) == ["d"]


def test_cell_totals_its_runs():
    # two repeats of batch 2: 10 tokens each; 4 and 6 drafts (verify steps x requests)
    runs = [Run(wall=1.0, tokens=10, drafts=4, accepted=6, iterations=3),
            Run(wall=3.0, tokens=10, drafts=6, accepted=4, iterations=4)]
    r = cell_row("ddtree-15", {"method": "ddtree"}, 0.0, 2, runs)
    assert r["tau"] == pytest.approx(1 + 10 / 10)  # accepted / drafts over both runs
    assert r["tok_s"] == pytest.approx(20 / 4.0)  # not the faster run's 10 tok/s
    assert r["step_ms"] == pytest.approx(1000 * 4.0 / (10 / 2))
    assert r["req_per_engine_step"] == pytest.approx(10 / 7)
    assert r["walls_s"] == [1.0, 3.0] and r["tok_s_runs"] == [10.0, 10 / 3]
    ar = cell_row("ar", None, 0.0, 2, runs)  # no speculation: steps = tokens / batch
    assert ar["tau"] == 1.0 and ar["step_ms"] == pytest.approx(1000 * 4.0 / 10)


def _row(method, runs_tok_s):
    return dict(method=method, temperature=0.0, batch=1, tok_s=sum(runs_tok_s) / 2,
                tok_s_runs=runs_tok_s)


def test_paired_ratio_is_the_median_of_within_repeat_ratios():
    rows = [_row("dflash", [100.0, 50.0]), _row("ddtree-15", [120.0, 80.0])]
    add_ratios(rows)
    # ratios 1.2 and 1.6: the median of two is their mean (not the lower one)
    assert rows[1]["paired_vs_dflash"] == pytest.approx(1.4)
    assert rows[1]["vs_dflash"] == pytest.approx(100.0 / 75.0)
    assert rows[1]["vs_ar"] is None and rows[0]["paired_vs_dflash"] == pytest.approx(1.0)
    rows = [_row("dflash", [100.0, 50.0]), _row("ddtree-15", [120.0, 80.0])]
    add_ratios(rows, paired=False)  # sequential runs: repeats are not paired in time
    assert rows[1]["paired_vs_dflash"] is None and rows[1]["vs_dflash"] is not None


def test_cpu_sets_are_disjoint_contiguous_and_cover_every_cpu():
    cpus = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
    sets = cpu_sets(cpus, 3)
    assert sets == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    assert cpu_sets([9, 3, 5, 7], 2) == [[3, 5], [7, 9]]  # sorted, not assumed 0..n-1
    # fewer than two CPUs per engine: no pinning rather than engines squeezed onto one
    assert cpu_sets(range(5), 3) == [None, None, None]


def test_methods_static_budgets_and_adaptive_maximum():
    names = lambda ms: [(n, w) for n, _, w in ms]
    ms = build_methods(["dflash", "dflash2", "ddtree-15", "ddtree-auto"], [63], "D", 15)
    assert names(ms) == [("dflash", 16), ("dflash-b", 16), ("ddtree-15", 16),
                         ("ddtree-auto", 64)]
    assert ms[3][1]["num_speculative_tokens"] == 63 and ms[3][1]["ddtree_adaptive_budget"]
    assert "ddtree_adaptive_budget" not in ms[2][1]
    # "ddtree" = one engine per --budgets, merged with ddtree-N without duplicates
    ms = build_methods(["ar", "ddtree", "ddtree-31"], [15, 31], "D", 15)
    assert names(ms) == [("ar", 1), ("ddtree-15", 16), ("ddtree-31", 32)]
    # @inproc: the same engines again, named with the suffix (engine core in-process)
    ms = build_methods(["dflash", "ddtree-15", "dflash@inproc", "ddtree-15@inproc"],
                       [63], "D", 15)
    assert names(ms) == [("dflash", 16), ("ddtree-15", 16), ("dflash@inproc", 16),
                         ("ddtree-15@inproc", 16)]
    assert ms[3][1] == ms[1][1]
    for bad in (["ddtree-0"], ["ddtree-x"], ["eagle"], ["eagle@inproc"], ["dspark-ddtree-0"]):
        with pytest.raises(ValueError, match="unknown --methods"):
            build_methods(bad, [15], "D", 15)


def test_graph_tokens_cover_the_widest_step(tmp_path):
    """CUDA graphs up to the widest verify step: batch x width for a fixed budget, the
    widest step of the adaptive schedule (64 rows at batch 1, 16 from batch 4 up) for
    ``ddtree-auto``."""
    (tmp_path / "config.json").write_text('{"block_size": 16}')
    fixed, auto = (build_methods([m], [63], str(tmp_path), 15)[0]
                   for m in ("ddtree-15", "ddtree-auto"))
    assert graph_tokens(fixed[1], fixed[2], 64) == 1024
    assert graph_tokens(None, 1, 64) == 64
    assert [graph_tokens(auto[1], auto[2], b) for b in (1, 2, 8, 64)] == [64, 64, 128, 1024]


def test_methods_over_a_dspark_drafter():
    ms = build_methods(["dflash", "ddtree-15", "dspark", "dspark-ddtree-15"], [15], "D", 15,
                       ("S", 16))
    assert [(n, w) for n, _, w in ms] == [("dflash", 16), ("ddtree-15", 16), ("dspark", 17),
                                          ("dspark-ddtree-15", 16)]
    assert ms[2][1] == {"method": "dspark", "model": "S", "num_speculative_tokens": 16}
    assert ms[3][1] == {"method": "ddtree", "model": "S", "num_speculative_tokens": 15}
    assert ms[1][1]["model"] == "D"
    with pytest.raises(ValueError, match="need --dspark-drafter"):
        build_methods(["dspark-ddtree-15"], [15], "D", 15)


def test_stalls_are_gaps_over_five_medians_and_never_the_prefill():
    # prefill 0.5 s (first gap: never a stall), steady 4 ms steps, one 0.404 s stall
    gaps = (0.5,) + (0.004,) * 20 + (0.404,) + (0.004,) * 20
    cut, n = trim_stalls(gaps)
    assert n == 1 and cut == pytest.approx(0.404 - 0.02)  # cap: max(5 x 4 ms, 20 ms)
    gaps = (0.01,) + (0.010,) * 10 + (0.049, 0.051)  # cap 5 x 10 ms: only 0.051 is over
    assert trim_stalls(gaps) == (pytest.approx(0.001), 1)
    assert trim_stalls((0.004,) * 30) == (0.0, 0) and trim_stalls(()) == (0.0, 0)
    assert trim_stalls((1.0,)) == (0.0, 0)


def test_cell_reports_stalls_and_trimmed_throughput():
    steady = (0.1,) + (0.004,) * 50
    runs = [Run(1.0, 100, 50, 50, 51, steady + (0.5,)), Run(0.3, 100, 50, 50, 51, steady)]
    r = cell_row("dflash", {"method": "dflash"}, 0.0, 1, runs)
    assert r["stalls"] == 1 and r["stall_s"] == pytest.approx(0.48)
    assert r["tok_s"] == pytest.approx(200 / 1.3)  # the raw numbers keep the stall
    assert r["tok_s_trimmed"] == pytest.approx(200 / (1.3 - 0.48))
    assert r["tok_s_runs_trimmed"] == pytest.approx([100 / 0.52, 100 / 0.3])
    assert r["median_gap_ms"] == [4.0, 4.0]
    other = cell_row("ddtree-15", {"method": "ddtree"}, 0.0, 1, [runs[1], runs[1]])
    add_ratios(rows := [r, other])
    assert rows[1]["vs_dflash_trimmed"] == pytest.approx((200 / 0.6) / (200 / 0.82))
    assert rows[1]["paired_trimmed"] == pytest.approx(((0.52 / 0.3) + 1.0) / 2)


def test_pooled_ratios_are_within_repeat_and_can_show_no_difference():
    from benchmarks.pooled import merge, paired, summarize

    def rows(ddtree_runs, gaps=None):
        r = [dict(method="dflash", temperature=0.0, batch=b, tok_s_runs=[100.0, 200.0],
                  median_gap_ms=[4.0, 2.0]) for b in (1, 2)]
        r += [dict(method="ddtree-15", temperature=0.0, batch=b, tok_s_runs=ddtree_runs,
                   median_gap_ms=gaps) for b in (1, 2)]
        return r

    # within-repeat: 110/100 and 220/200 are both 1.1, though the repeats differ 2x
    ratios = paired(rows([110.0, 220.0], gaps=[5.0, 2.5]))
    assert ratios[("ddtree-15", 0.0, 1)] == pytest.approx([1.1, 1.1])
    (s,) = summarize(merge([ratios, paired(rows([110.0, 220.0]))]))
    assert s["n"] == 8 and s["geomean"] == pytest.approx(1.1)
    assert s["ci95"] == (pytest.approx(1.1), pytest.approx(1.1))
    assert s["per_batch"] == {1: (pytest.approx(1.1), 4), 2: (pytest.approx(1.1), 4)}
    # times: dflash / method, so 0.8 = a step 1.25x as long; runs without gaps drop out
    steps = paired(rows([1.0, 1.0], gaps=[5.0, 2.5]), "median_gap_ms", invert=True)
    assert steps[("ddtree-15", 0.0, 2)] == pytest.approx([0.8, 0.8])
    assert paired(rows([1.0, 1.0]), "median_gap_ms", invert=True) == {}
    # ratios scattered around 1: the interval holds 1 (the check can fail: above it did not)
    (s,) = summarize(paired(rows([80.0, 250.0])))
    assert s["ci95"][0] < 1.0 < s["ci95"][1]


def test_inproc_engines_are_compared_with_the_inproc_reference():
    from benchmarks.pooled import paired, reference

    names = {"dflash", "ddtree-15", "dflash@inproc", "ddtree-15@inproc"}
    assert reference("ddtree-15@inproc", "dflash", names) == "dflash@inproc"
    assert reference("ddtree-15", "dflash", names) == "dflash"
    assert reference("ddtree-15@inproc", "dflash", {"dflash"}) == "dflash"  # none in-process
    row = lambda m, x: dict(method=m, temperature=0.0, batch=1, tok_s_runs=[x])
    ratios = paired([row("dflash", 100.0), row("dflash@inproc", 50.0),
                     row("ddtree-15", 120.0), row("ddtree-15@inproc", 80.0)])
    assert ratios[("ddtree-15@inproc", 0.0, 1)] == pytest.approx([1.6])
    assert ratios[("ddtree-15", 0.0, 1)] == pytest.approx([1.2])
    assert ("dflash@inproc", 0.0, 1) not in ratios  # its own reference


def test_pooled_cli_compares_with_the_named_engine(tmp_path, capsys):
    """``--ref dspark``: every engine against the DSpark chain, DFlash included."""
    import json

    from benchmarks.pooled import main

    row = lambda m, x: dict(method=m, temperature=0.0, batch=1, tok_s_runs=[x],
                            median_gap_ms=[100.0 / x])
    res = tmp_path / "results.json"
    res.write_text(json.dumps({"meta": {"interleaved": True}, "rows": [
        row("dflash", 100.0), row("dspark", 125.0), row("dspark-ddtree-15", 150.0)]}))
    assert main([str(res), "--ref", "dspark", "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "throughput against dspark" in out
    got = {s["method"]: s["geomean"]
           for s in json.loads((tmp_path / "s.json").read_text())["throughput"]}
    assert got == {"dflash": pytest.approx(0.8), "dspark-ddtree-15": pytest.approx(1.2)}


class _Part:
    def step(self, n):
        return self.inner(n) + 1

    def inner(self, n):
        return n * 2

    @property
    def width(self):
        return 3

    @staticmethod
    def helper():
        return "static"


def test_host_timer_counts_calls_and_inclusive_time_per_method():
    from benchmarks.hosttime import HostTimer, per_step

    part = _Part()
    timer = HostTimer({"runner": part}, modules=(__name__,))
    assert sorted(timer.acc) == ["runner.inner", "runner.step"]  # no property/staticmethod
    assert part.step(4) == 9 and part.width == 3 and part.helper() == "static"
    snap = timer.snapshot()
    assert snap["runner.step"][1] == 1 and snap["runner.inner"][1] == 1
    assert snap["runner.step"][0] >= snap["runner.inner"][0] > 0  # inclusive
    timer.reset()
    assert timer.snapshot() == {}
    for _ in range(3):
        part.step(1)
    rows = per_step([timer.snapshot(), timer.snapshot()], steps=3)
    assert [k for k, _, _ in rows] == ["runner.step", "runner.inner"]
    assert rows[0][2] == pytest.approx(2.0)  # 2 snapshots x 3 calls over 3 steps
    assert _Part().step(1) == 3 and "step" not in vars(_Part())  # other instances untouched
    # a list of objects shares its role's counters (e.g. one builder per attention group)
    a, b = _Part(), _Part()
    shared = HostTimer({"builder": [a, b]}, modules=(__name__,))
    a.step(1), b.step(2)
    assert shared.snapshot()["builder.step"][1] == 2


def test_cpu_sets_rotate_so_every_engine_runs_on_every_set():
    sets = [[0, 1], [2, 3], [4, 5]]
    seen = {i: [] for i in range(3)}
    for rep in range(3):
        for i, cpus in enumerate(rotated(sets, rep)):
            seen[i].append(cpus)
    assert rotated(sets, 0) == sets
    assert all(sorted(v) == sets for v in seen.values())  # each engine: each set once
    assert all(len({tuple(c) for c in rotated(sets, rep)}) == 3 for rep in range(3))


def test_pin_process_tree_moves_this_process_and_its_children():
    import os
    import subprocess
    import sys
    import threading

    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs Linux with two CPUs")
    start = sorted(os.sched_getaffinity(0))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        pin_process_tree(start[:1])
        assert os.sched_getaffinity(0) == {start[0]}
        assert os.sched_getaffinity(thread.native_id) == {start[0]}
        assert os.sched_getaffinity(child.pid) == {start[0]}
    finally:
        stop.set()
        thread.join()
        child.kill()
        child.wait()
        pin_process_tree(start)
    assert os.sched_getaffinity(0) == set(start)


def test_interleaved_cells_run_every_engine_on_every_cpu_set():
    """run_cells: with pinned engines, repeat r runs engine i on set (i + r) mod n; the
    warm-up runs on the starting sets."""
    from types import SimpleNamespace

    from benchmarks.throughput import run_cells

    log = []

    class FakeEngine:
        def __init__(self, name):
            self.name, self.spec, self.cpus = name, {"method": "x"}, None

        def pin(self, cpus):
            self.cpus = cpus

        def __call__(self, what, temp, n, rep=0):
            log.append((what, self.name, rep, self.cpus))
            if what == "warm":
                return [0.1, 0.1]
            return Run(wall=1.0, tokens=8, drafts=4, accepted=4, iterations=4, gaps=(0.1,))

    sets = [[0, 1], [2, 3], [4, 5]]
    args = SimpleNamespace(temps=[0.0], batches=[1], repeats=3, cpu_sets=sets,
                           profile=False)
    bar = SimpleNamespace(write=lambda *_: None, update=lambda *_: None)
    rows = run_cells(args, [FakeEngine(m) for m in "abc"], bar)
    assert len(rows) == 3
    assert [c for w, _, _, c in log if w == "warm"] == sets
    for name in "abc":
        ran_on = [c for w, e, _, c in log if w == "run" and e == name]
        assert sorted(ran_on) == sets  # every set once
    assert [(e, c) for w, e, r, c in log if w == "run" and r == 1][0] == ("c", [0, 1])


def test_method_suffixes_combine_in_any_order():
    assert has_suffix("ddtree-15@base@inproc", "@base")
    assert has_suffix("ddtree-15@base@inproc", "@inproc")
    assert has_suffix("ddtree-15@inproc@base", "@base")
    assert not has_suffix("ddtree-15@inproc", "@base")
    assert not has_suffix("base", "@base") and not has_suffix("ddtree-15", "@inproc")


def test_base_engine_refuses_modules_from_elsewhere(tmp_path):
    """This test process has the checkout's vllm_ddtree loaded: a base directory that
    does not hold it is refused, the checkout's own directory is accepted."""
    from pathlib import Path

    import vllm_ddtree

    with pytest.raises(RuntimeError, match="not from the copy"):
        check_base_modules("ddtree-15@base", tmp_path)
    check_base_modules("ddtree-15@base", Path(vllm_ddtree.__file__).parent.parent)


def test_hosttime_compares_each_cell_with_the_reference(tmp_path, capsys):
    """``python3 -m benchmarks.hosttime``: per cell, the step's host time (the runner's
    two calls) against the reference engine's, and the methods that differ most, with
    a method only one engine calls counted as 0 in the other."""
    from benchmarks.hosttime import differences, main, step_host_ms

    def row(method, batch, ms):
        return {"method": method, "temperature": 0.0, "batch": batch, "tau": 2.0,
                "host_ms_per_step": [[k, v, 1.0] for k, v in ms.items()]}

    ref = row("dflash@inproc", 1, {"runner.execute_model": 1.0, "runner.sample_tokens": 1.5,
                                   "rejection_sampler._verify": 0.4})
    new = row("ddtree@inproc", 1, {"runner.execute_model": 1.2, "runner.sample_tokens": 1.4,
                                   "trees.walk": 0.06})
    lone = row("ddtree@inproc", 8, {"runner.execute_model": 9.0})  # no reference cell
    assert step_host_ms(new) == pytest.approx(2.6) and step_host_ms(ref) == 2.5
    diffs = differences(new, ref, top=3)
    assert [k for k, *_ in diffs] == ["rejection_sampler._verify", "runner.execute_model",
                                      "runner.sample_tokens"]
    assert diffs[0][1:] == (0.0, 0.4, -0.4)
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": {}, "rows": [ref, new, lone]}))
    main([str(path), "--top", "2"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("ddtree@inproc T=0 batch=1: 2.600 ms host per step, dflash@inproc "
                      "2.500 (+0.100); tau 2.00 / 2.00")
    assert len(out) == 3 and out[1].split()[0] == "rejection_sampler._verify"
    assert out[1].split()[1:] == ["0.000", "0.400", "-0.400"]
