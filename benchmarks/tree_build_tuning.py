"""Tree-build launch settings on one GPU: time per call of each setting of the build's
kernels, at the draft shape of a Qwen3-8B DFlash drafter.

    python3 -m benchmarks.tree_build_tuning --out DIR [--cases 1x63,2x31,1x15,8x15,...]

A case ``RxB`` is R requests at budget B: ``R * 15`` rows of bf16 draft logits over a
151936-token vocabulary (normal, standard deviation 2), top-``B`` per row
(:func:`topk_lse_triton`, pruned, log-probabilities), then the tree of ``B`` nodes
(:func:`tree_build_triton`).  Each of :class:`TopkTuning`'s fields and the build's warps
is varied alone from the default; every setting's output is checked against the
default's (token ids and trees bit for bit; log-sum-exp and log-probabilities, whose
rounding follows the warps of a reduction, to 1e-5), then timed as a CUDA graph of 20 calls replayed
20 times, as the drafter's graph runs them.  Prints per case the default's µs per call,
the fastest value of each field and the combination of them; writes every timing to
``DIR/tree_build_tuning.json``.  ``live`` is the median over rows of the keys the merge
receives (what ``merge_small`` is compared with).  No vLLM needed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.core_gpu import graph_us
from vllm_ddtree.kernels.topk_lse import TopkTuning, _prune_chunk, topk_lse_triton, topk_tuning
from vllm_ddtree.kernels.tree_build import build_warps, tree_build_triton

V, D, CALLS, REPLAYS, DEV = 151936, 15, 20, 20, "cuda"
CHOICES = dict(stats_warps=(4, 8, 16), bound_warps=(1, 2, 4, 8), topk_warps=(4, 8, 16),
               merge_warps=(1, 2, 4, 8, 16), bound_sort=(False, True),
               merge_small=(0, 128, 256, 512, 1024))


def timed_us(fn) -> float:
    """µs per call of ``fn`` in a replayed CUDA graph of CALLS calls."""
    return graph_us(lambda: [fn() for _ in range(CALLS)], CALLS, REPLAYS)


def live_keys(x: torch.Tensor, k: int) -> float:
    """Median over rows of the keys the pruned merge receives: per chunk, its entries at
    or above the row's k-th largest chunk maximum, at most k."""
    chunk = _prune_chunk(V, k)
    pad = torch.nn.functional.pad(x.float(), (0, -V % chunk), value=float("-inf"))
    pad = pad.view(x.shape[0], -1, chunk)
    maxima = pad.max(dim=-1).values
    if maxima.shape[1] < k:
        return float(min(chunk, k) * maxima.shape[1])
    t = maxima.topk(k, dim=-1).values[:, -1:]
    n = (pad >= t.unsqueeze(-1)).sum(dim=-1).clamp(max=k).sum(dim=-1)
    return float(n.float().median())


def run_case(R: int, budget: int, rows: list[dict]) -> dict:
    g = torch.Generator(device=DEV).manual_seed(R * 1000 + budget)
    x = (2 * torch.randn(R * D, V, generator=g, device=DEV)).to(torch.bfloat16)
    k = budget
    default = topk_tuning(k, R * D)
    ref = topk_lse_triton(x, k, logprobs=True)
    budgets = torch.full((R,), budget, dtype=torch.int64, device=DEV)

    def topk_us(tuning: TopkTuning) -> float:
        got = topk_lse_triton(x, k, logprobs=True, tuning=tuning)
        # ids bit for bit; the log-sum-exp (and so the log-probabilities) may round
        # differently under other warps
        if not (torch.equal(got[1], ref[1])
                and torch.allclose(got[0], ref[0], rtol=0, atol=1e-5)
                and torch.allclose(got[2], ref[2], rtol=0, atol=1e-5)):
            raise AssertionError(f"{tuning} differs from the default at {R}x{budget}")
        return timed_us(lambda: topk_lse_triton(x, k, logprobs=True, tuning=tuning))

    res = dict(R=R, budget=budget, live=live_keys(x, k), default=default._asdict(),
               topk_us=topk_us(default), best={})
    for field, values in CHOICES.items():
        timings = {}
        for value in values:
            try:
                t, error = topk_us(default._replace(**{field: value})), None
            except Exception as e:  # a failing setting is reported, the others still run
                t, error = float("inf"), repr(e)[:200]
            timings[value] = t
            rows.append(dict(R=R, budget=budget, kernel="topk", field=field, value=value,
                             us=t, error=error))
            print(json.dumps(rows[-1]), flush=True)
        res["best"][field] = min(timings, key=timings.get)
    best = default._replace(**res["best"])
    res["topk_best_us"] = topk_us(best)

    lp, tok = ref[0].view(R, D, k), ref[1].view(R, D, k)
    tree = tree_build_triton(lp, tok, budget, budgets)
    timings = {}
    for warps in (1, 2, 4, 8):
        got = tree_build_triton(lp, tok, budget, budgets, num_warps=warps)
        if not all(torch.equal(a, b) for a, b in zip(got, tree)):
            raise AssertionError(f"build with {warps} warps differs at {R}x{budget}")
        timings[warps] = timed_us(lambda w=warps: tree_build_triton(lp, tok, budget, budgets,
                                                                    num_warps=w))
        rows.append(dict(R=R, budget=budget, kernel="build", field="num_warps",
                         value=warps, us=timings[warps]))
        print(json.dumps(rows[-1]), flush=True)
    res["build_us"] = timed_us(lambda: tree_build_triton(lp, tok, budget, budgets))
    res["build_best"] = min(timings, key=timings.get)
    res["build_best_us"] = timings[res["build_best"]]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tree-build-tuning")
    ap.add_argument("--cases", default="1x63,2x31,1x15,8x15,32x15,64x15")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, table = [], []
    for case in args.cases.split(","):
        R, budget = (int(v) for v in case.split("x"))
        table.append(run_case(R, budget, rows))
    (out / "tree_build_tuning.json").write_text(json.dumps(dict(rows=rows, cases=table),
                                                           indent=1))
    print(f"\nµs per call, graph of {CALLS} calls; build default = "
          f"{build_warps.__name__}; live = median live keys a row")
    print("case   live  topk def  topk best  best fields (changed)"
          "                     build def  build best (warps)")
    for c in table:
        changed = {f: v for f, v in c["best"].items() if v != c["default"][f]}
        print(f"{c['R']:>2}x{c['budget']:<3} {c['live']:>5.0f} {c['topk_us']:9.1f} "
              f"{c['topk_best_us']:10.1f}  {json.dumps(changed):44s} {c['build_us']:9.1f} "
              f"{c['build_best_us']:10.1f} ({c['build_best']})")


if __name__ == "__main__":
    main()
