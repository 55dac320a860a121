"""Equal-acceptance step cost: what a DDTree step costs against a DFlash step when both
accept every draft.

    python3 -m benchmarks.step_cost --out DIR [--shape qwen3-8b] [--models DIR]
        [--methods ar,dflash,ddtree-15,ddtree-31,ddtree-63,ddtree-auto]
        [--batches 1,8,32,64] [--temps 0,1] [--repeats 3] [--max-tokens 256]
    python3 -m benchmarks.step_cost --cpu --out DIR      # smoke run: tiny shape, CPU

The pair is ``benchmarks.shaped_models``' ``accept_all`` edit of ``--shape`` (random
weights at full size, both models always emitting one token), written once under
``--models``.  The DFlash chain (15 drafts) and every tree (which holds the chain) then
accept all drafts at T = 0 and T = 1: tokens per step are equal and the ratio of step
times is the step's own cost, GPU-bound at 8B shape.  The engines run interleaved
through ``benchmarks.throughput`` (CUDA graphs on unless ``--eager``; ``--gpu-mem`` is
shared by the engines alive at once, so at 8B shape give at most four methods per run).

Step time: the median gap between two engine outputs within a run (a decode step;
prefill excluded), the median over the repeats.  ``vs DFlash``: that step time over
DFlash's in the same cell.  ``first / second``: wall times of the cell's first two
16-token calls; a first call well above the second is a first-use stall (a kernel
compiled at first use).  ``equal acc``: every speculative method of the cell reached
DFlash's tokens per step within 2% (else its ratio is not pure step cost).  Prints the
table last; writes ``results.json`` (throughput's rows) and ``step_cost.json``.  vLLM logs
every kernel compiled after its warm-up ("JIT compilation during inference"): grep the
log for the kernels behind a stall.

``--fit FILE...``: no run; the ``STEP_COST`` table of ``vllm_ddtree.adaptive.schedule``
from the fixed-budget rows of earlier runs' ``step_cost.json`` (or files of named runs;
per batch and verify width, the mean over temperatures of DDTree-``B`` / DFlash-15 in
the same run; cells no run measured keep their current value), then the schedule that
table gives and its predicted tokens per second over DFlash (the model's tau over the
chain's, over the step ratio).

``--profile``: each cell also runs once under torch.profiler (throughput's ``--profile``;
the engine core then runs in the engine's process) and a second table says where each
method's GPU time per step differs from DFlash's: GPU-busy ms per step, then the kernels
with the largest difference (ms and launches per step against DFlash's).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

ACCEPT_TOL = 0.02  # relative tau difference under which two cells accept alike


def write_prompts(path: Path, n: int = 64, seed: int = 0) -> Path:
    """``n`` random token-id prompts of 16 to 32 tokens (ids below the shaped models'
    word count), as throughput's token-prompt JSON."""
    from benchmarks.shaped_models import NUM_WORDS

    rnd = random.Random(seed)
    ids = [[rnd.randrange(3, NUM_WORDS) for _ in range(rnd.randrange(16, 33))]
           for _ in range(n)]
    path.write_text(json.dumps(ids))
    return path


def step_rows(rows: list[dict]) -> list[dict]:
    """One summary per throughput row: step ms (median over runs of the median output
    gap), its ratio to DFlash's in the cell, and whether the cell accepts alike."""
    def step_ms(r: dict) -> float:
        return statistics.median(g for g in r["median_gap_ms"] if g is not None)

    by = {(r["method"], r["temperature"], r["batch"]): r for r in rows}
    out = []
    for r in rows:
        cell = (r["temperature"], r["batch"])
        ref = by.get(("dflash", *cell))
        spec = [x for x in rows if (x["temperature"], x["batch"]) == cell and x["method"] != "ar"]
        equal = ref is not None and all(abs(x["tau"] / ref["tau"] - 1) <= ACCEPT_TOL
                                        for x in spec)
        ms = step_ms(r)
        out.append(dict(method=r["method"], temperature=r["temperature"], batch=r["batch"],
                        tau=r["tau"], step_ms=ms,
                        step_ms_runs=r["median_gap_ms"],
                        vs_dflash=ms / step_ms(ref) if ref else None,
                        tok_s=r["tok_s"], req_per_engine_step=r["req_per_engine_step"],
                        first_call_s=(r.get("warm_calls_s") or [None])[0],
                        second_call_s=(r.get("warm_calls_s") or [None, None])[1],
                        equal_acceptance=equal))
    return out


def fit_step_cost(rows: list[dict]) -> dict[int, dict[int, float]]:
    """``{batch: {1 + B: mean over temperatures of DDTree-B's vs_dflash}}`` from
    ``step_rows`` rows (equal-acceptance cells of fixed-budget methods of this checkout
    only: ``@base`` rows ran other code, ``ddtree-auto`` has no single width)."""
    acc: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        method = r["method"]
        if (not method.startswith("ddtree-") or "@" in method or r["vs_dflash"] is None
                or not r["equal_acceptance"]):
            continue
        budget = method.removeprefix("ddtree-")
        if budget.isdigit():
            acc.setdefault((r["batch"], 1 + int(budget)), []).append(r["vs_dflash"])
    table: dict[int, dict[int, float]] = {}
    for (batch, width), ratios in sorted(acc.items()):
        table.setdefault(batch, {})[width] = round(statistics.fmean(ratios), 3)
    return table


def complete_fit(fit: dict[int, dict[int, float]], current: dict[int, dict[int, float]]
                 ) -> tuple[dict[int, dict[int, float]], list[tuple[int, int]]]:
    """``fit`` with every (batch, width) cell of ``current`` that the runs did not measure
    kept from ``current`` (the schedule interpolates within each batch's row, so a row
    needs all its widths), and the list of the kept cells."""
    table: dict[int, dict[int, float]] = {}
    kept: list[tuple[int, int]] = []
    for batch in sorted(set(fit) | set(current)):
        row = dict(fit.get(batch, {}))
        for width, value in current.get(batch, {}).items():
            if width not in row:
                row[width] = value
                kept.append((batch, width))
        table[batch] = dict(sorted(row.items()))
    return table, kept


def load_rows(path: str) -> list[dict]:
    """Every run's rows in a ``step_cost.json``: the file itself, or a file of named runs
    (``{name: {"meta": ..., "rows": ...}}``, as the docs keep them)."""
    data = json.loads(Path(path).read_text())
    runs = [data] if "rows" in data else list(data.values())
    return [r for run in runs for r in run["rows"]]


def fit_files(paths: list[str]) -> dict[int, dict[int, float]]:
    """:func:`fit_step_cost` of each file's runs, a later file's cells replacing an
    earlier one's (the later run measured newer code)."""
    table: dict[int, dict[int, float]] = {}
    for path in paths:
        for batch, row in fit_step_cost(load_rows(path)).items():
            table.setdefault(batch, {}).update(row)
    return {batch: dict(sorted(row.items())) for batch, row in sorted(table.items())}


def print_fit(fit: dict[int, dict[int, float]], max_budget: int = 63) -> None:
    """The fitted table as Python (cells the runs did not measure kept from the current
    ``STEP_COST``), and per batch the budget the schedule built on it picks (drafter
    depth 15, budgets up to ``max_budget``) and that pick's predicted throughput over
    DFlash-15: the paper's tau of the tree over the chain's, over the step ratio."""
    from vllm_ddtree.adaptive import schedule

    table, kept = complete_fit(fit, schedule.STEP_COST)
    if kept:
        print("kept from the current table (batch, width):", kept)
    print("STEP_COST = {")
    for batch, row in table.items():
        print(f"    {batch}: {{" + ", ".join(f"{w}: {v:.3f}" for w, v in row.items()) + "},")
    print("}")
    saved = schedule.STEP_COST
    schedule.STEP_COST = table
    try:
        print(f"\n{'batch':>5} {'pick':>5} {'tau':>6} {'step vs DFlash':>14} {'predicted':>9}")
        for batch in table:
            b = schedule.best_budget(batch, max_budget, 15)
            cost = schedule.step_cost(batch, 1 + b)
            tau = schedule.tau(b, 15)
            print(f"{batch:>5} {b:>5} {tau:>6.2f} {cost:>14.3f} "
                  f"{tau / schedule.CHAIN_TAU / cost:>9.3f}")
        print("schedule:", schedule.budget_schedule(max_budget, 15))
    finally:
        schedule.STEP_COST = saved


def print_table(rows: list[dict]) -> None:
    print(f"\n{'method':<14} {'T':>3} {'batch':>5} {'tau':>6} {'step ms':>8} {'vs DFlash':>9} "
          f"{'reps ms':<24} {'first s':>7} {'second s':>8} {'req/it':>6} {'equal acc':>9}")
    for r in rows:
        f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"
        reps = "/".join(f(g) for g in r["step_ms_runs"])
        print(f"{r['method']:<14} {r['temperature']:>3g} {r['batch']:>5} {r['tau']:>6.2f} "
              f"{r['step_ms']:>8.2f} {f(r['vs_dflash'], 3):>9} {reps:<24} "
              f"{f(r['first_call_s'], 3):>7} {f(r['second_call_s'], 3):>8} "
              f"{r['req_per_engine_step']:>6.1f} {'yes' if r['equal_acceptance'] else 'NO':>9}")


def kernel_diffs(rows: list[dict], top: int = 8) -> list[dict]:
    """Per profiled method and cell: GPU-busy ms per step against DFlash's, and the
    ``top`` kernels whose ms per step differ most from DFlash's (by name)."""
    by = {(r["method"], r["temperature"], r["batch"]): r for r in rows if "kernels" in r}
    out = []
    for (method, temp, n), r in by.items():
        ref = by.get(("dflash", temp, n))
        if method in ("ar", "dflash") or ref is None:
            continue
        mine = {k: (ms, c) for k, ms, c in r["kernels"]}
        base = {k: (ms, c) for k, ms, c in ref["kernels"]}
        diff = [(k, mine.get(k, (0, 0))[0] - base.get(k, (0, 0))[0],
                 mine.get(k, (0, 0))[1] - base.get(k, (0, 0))[1]) for k in {*mine, *base}]
        diff.sort(key=lambda d: abs(d[1]), reverse=True)
        out.append(dict(method=method, temperature=temp, batch=n,
                        gpu_busy_ms=r["gpu_busy_ms"], dflash_gpu_busy_ms=ref["gpu_busy_ms"],
                        kernels=[(k, round(ms, 4), round(c, 2)) for k, ms, c in diff[:top]]))
    return out


def print_kernel_diffs(diffs: list[dict]) -> None:
    print("\nGPU time per step against DFlash (profiled): method, T, batch, busy ms "
          "(DFlash's), then kernel: +ms per step, +launches per step")
    for d in diffs:
        print(f"{d['method']:<14} {d['temperature']:>3g} {d['batch']:>5} "
              f"{d['gpu_busy_ms']:.3f} ({d['dflash_gpu_busy_ms']:.3f})")
        for k, ms, c in d["kernels"]:
            print(f"{'':>6}{ms:+8.4f} {c:+6.1f}  {k[:110]}")


def main(argv: list[str] | None = None) -> int:
    from benchmarks import throughput
    from benchmarks.shaped_models import SHAPES, write_pair

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="step-cost-out")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="default: qwen3-8b (tiny with --cpu)")
    ap.add_argument("--models", default=None,
                    help="where the pair is written (default: OUT/models-<shape>)")
    ap.add_argument("--methods", default="ar,dflash,ddtree-15,ddtree-31,ddtree-63,ddtree-auto")
    ap.add_argument("--auto-budget", type=int, default=63,
                    help="largest budget of ddtree-auto")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--gpu-mem", type=float, default=0.9)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--base-src", default=None,
                    help="another copy of the package, run by methods ending in @base "
                         "(e.g. ddtree-15@base: the same cell before a change)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile each cell once and compare kernels with DFlash's")
    ap.add_argument("--cpu", action="store_true", help="smoke settings: tiny shape on CPU")
    ap.add_argument("--fit", nargs="+", default=None, metavar="STEP_COST_JSON",
                    help="no run: fit the schedule's step-cost table to these runs' rows "
                         "(a later file's cells replace an earlier one's)")
    args = ap.parse_args(argv)
    if args.fit:
        print_fit(fit_files(args.fit))
        return 0
    shape = args.shape or ("tiny" if args.cpu else "qwen3-8b")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, drafter = write_pair(args.models or out / f"models-{shape}", shape,
                                 "accept_all", "cpu" if args.cpu else "cuda")
    prompts = write_prompts(out / "prompts.json")
    cmd = ["--target", str(target), "--drafter", str(drafter), "--out", str(out),
           "--methods", args.methods, "--budgets", str(args.auto_budget),
           "--batches", args.batches, "--temps", args.temps, "--repeats", str(args.repeats),
           "--max-tokens", str(args.max_tokens), "--prompts", str(prompts),
           "--max-model-len", "1024"]
    cmd += ["--cpu"] if args.cpu else ["--gpu-mem", str(args.gpu_mem)]
    cmd += ["--eager"] if args.eager else []
    cmd += ["--profile"] if args.profile else []
    cmd += ["--base-src", args.base_src] if args.base_src else []
    cmd += ["--jit-verbose"]  # every compilation mid-serving is logged: a first-use stall
    rc = throughput.main(cmd)
    if rc:
        return rc
    res = json.loads((out / "results.json").read_text())
    rows = step_rows(res["rows"])
    diffs = kernel_diffs(res["rows"])
    (out / "step_cost.json").write_text(json.dumps(
        {"meta": dict(res["meta"], shape=shape), "rows": rows, "kernel_diffs": diffs},
        indent=1))
    if diffs:
        print_kernel_diffs(diffs)
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
