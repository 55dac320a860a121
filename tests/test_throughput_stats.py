"""The benchmark harness's statistics (benchmarks/throughput.py), without vLLM: which
prompts a repeat takes, how a cell totals its runs, and the paired ratio."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from throughput import Run, _cell, add_ratios, cell_row  # noqa: E402


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
