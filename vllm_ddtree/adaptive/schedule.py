"""Tree budget per batch size (``ddtree_adaptive_budget``): a static schedule for vLLM's
dynamic speculative decoding (``num_speculative_tokens_per_batch_size``).

Why this works with no new mechanism: vLLM's scheduler picks the number of draft tokens
per step from the batch size, Model Runner V2 captures one FULL CUDA graph per resulting
verify width, and DDTree's drafts are in best-first order, so the first ``n`` nodes of
the budget-``B`` tree are exactly the best ``n``-node tree.  Cutting the tree is free.

The schedule maximizes ``tau(B) / step_cost(batch, 1 + B)`` per batch size over a small
set of budgets (``D``, ``2**k - 1`` and the largest ``16 m - 1`` up to the configured
maximum: whole tree-attention row blocks, see ``candidates``), using

* ``step_cost``: a whole DDTree step (drafter, tree, verify of ``1 + B`` rows per request)
  relative to a DFlash-15 step at the same batch size, measured at equal acceptance
  (``benchmarks.step_cost`` at Qwen3-8B shape, CUDA graphs; the mean of T = 0 and T = 1:
  ``STEP_COST``, docs/benchmarks/step-cost-h200.md) for widths 16, 32 and 64; wider
  trees grow from the width-64 value as a plain verify of the target grows
  (``VERIFY_GROWTH``); interpolated log-linearly in the batch and the width;
* ``tau``: DDTree's acceptance length against budget from the paper (Qwen3-8B,
  MATH-500, T = 0).

Budget ``D`` verifies as many rows as the DFlash chain and its tree holds the ``D`` most
probable prefixes (expected acceptance at least the chain's), so the schedule is never
worse than the chain under the model.  It is a model: other GPUs, targets and drafters
have other curves (pass an explicit ``num_speculative_tokens_per_batch_size`` then).
Pure Python.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

# batch -> {verify rows per request: DDTree step time / DFlash-15 step time}, measured
# at equal acceptance, mean of T = 0 and T = 1; fitted with ``benchmarks.step_cost --fit``
# (docs/benchmarks/step-cost-h200.md, "Every budget by batch size, the policy and the targets")
STEP_COST: dict[int, dict[int, float]] = {
    1: {16: 1.001, 32: 1.047, 64: 1.071},
    2: {16: 1.008, 32: 1.030, 64: 1.128},
    4: {16: 1.011, 32: 1.091, 64: 1.342},
    8: {16: 1.006, 32: 1.230, 64: 1.913},
    32: {16: 1.013, 32: 1.872, 64: 3.399},
    64: {16: 1.018, 32: 1.888, 64: 3.652},
}
# batch -> {verify tokens per request n: target forward time relative to n = 1} at
# Qwen3-8B shape: how a step grows past the widest measured tree
# (docs/benchmarks/step-cost-h200.md, "Every budget by batch size, the policy and the targets")
VERIFY_GROWTH: dict[int, dict[int, float]] = {
    1: {1: 1.00, 16: 1.23, 32: 1.25, 64: 1.27, 128: 1.35, 256: 1.69, 512: 2.76},
    4: {1: 1.00, 16: 1.10, 32: 1.15, 64: 1.38, 128: 2.03, 256: 3.73, 512: 7.31},
    16: {1: 1.00, 16: 1.31, 32: 1.67, 64: 2.52, 128: 4.34, 256: 8.20, 512: 16.5},
    64: {1: 1.00, 16: 1.66, 32: 2.26, 64: 3.56, 128: 6.25, 256: 12.0},
}
# budget -> acceptance length (paper, Qwen3-8B, MATH-500, T = 0), and the DFlash chain's
# (D = 15) on the same data
TAU: dict[int, float] = {16: 8.6, 32: 9.25, 64: 9.75, 128: 10.2, 256: 10.43, 512: 10.73,
                         1024: 10.97}
CHAIN_TAU = 7.79
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _interp(points: dict[int, float], x: float) -> float:
    """Log-linear interpolation in x, clamped (extrapolated linearly past the last)."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        a, b = xs[-2], xs[-1]
        slope = (points[b] - points[a]) / (b - a)
        return points[b] + slope * (x - b)
    i = bisect.bisect_right(xs, x)
    a, b = xs[i - 1], xs[i]
    t = (math.log(x) - math.log(a)) / (math.log(b) - math.log(a))
    return points[a] + t * (points[b] - points[a])


def _table(table: dict[int, dict[int, float]], batch: float, width: float) -> float:
    return _interp({b: _interp(row, width) for b, row in table.items()}, batch)


def step_cost(batch: int, width: int) -> float:
    """Relative time of one DDTree step (drafter + verify of ``width`` rows/request)."""
    widest = max(STEP_COST[1])
    cost = _table(STEP_COST, batch, min(width, widest))
    if width > widest:
        cost *= _table(VERIFY_GROWTH, batch, width) / _table(VERIFY_GROWTH, batch, widest)
    return cost


def tau(budget: int, depth: int) -> float:
    """Modelled acceptance length of a budget-``budget`` tree (depth ``depth``)."""
    return _interp(TAU, max(budget, depth))


def candidates(max_budget: int, depth: int) -> list[int]:
    """``D``, the budgets ``2**k - 1`` above ``D`` up to the maximum, and the largest
    ``16 m - 1`` up to the maximum.  ``16 m - 1`` nodes verify ``16 m`` rows per request,
    whole row blocks of the Triton tree attention (16 rows; 32 over the tree keys of
    trees wider than 32 rows, which ``2**k - 1`` budgets fill): one node more opens a
    block for one row, and a block costs about the same however few rows it holds
    (docs/benchmarks/core-gpu.md, "Tree build and tree attention at Qwen3-8B shape").
    A maximum with no such budget above ``D`` is kept."""
    out = {min(depth, max_budget)}
    b = 15
    while b <= max_budget:
        if b > depth:
            out.add(b)
        b = 2 * b + 1
    top = (max_budget + 1) // 16 * 16 - 1
    if top > depth:
        out.add(top)
    elif max_budget > depth and len(out) == 1:
        out.add(max_budget)
    return sorted(out)


def best_budget(batch: int, max_budget: int, depth: int) -> int:
    cands = candidates(max_budget, depth)
    return max(cands, key=lambda b: (tau(b, depth) / step_cost(batch, 1 + b), -b))


def budget_schedule(max_budget: int, depth: int) -> list[tuple[int, int, int]]:
    """``[(first_batch, last_batch, budget), ...]`` for vLLM's
    ``num_speculative_tokens_per_batch_size`` (budgets never increase with the batch)."""
    if max_budget < 1 or depth < 1:
        raise ValueError("max_budget and depth must be >= 1")
    sched: list[tuple[int, int, int]] = []
    prev = max_budget
    for lo, hi, mid in batch_buckets():
        pick = min(prev, best_budget(mid, max_budget, depth))
        prev = pick
        if sched and sched[-1][2] == pick:
            sched[-1] = (sched[-1][0], hi, pick)
        else:
            sched.append((lo, hi, pick))
    return sched


def batch_buckets() -> list[tuple[int, int, int]]:
    """``(first, last, representative)`` batch sizes of each bucket of ``BATCH_BUCKETS``;
    the bucket's geometric middle stands for it (the last one runs to ``1 << 20``)."""
    out = []
    for i, b in enumerate(BATCH_BUCKETS):
        hi = BATCH_BUCKETS[i + 1] - 1 if i + 1 < len(BATCH_BUCKETS) else 1 << 20
        out.append((b, hi, round(math.sqrt(b * max(b, hi if hi < 1 << 20 else b)))))
    return out


# ------------------------------------------------------------ online re-tuning -------
# ``ddtree_adaptive_budget: "online"``: the same cost model, with the trees' own expected
# acceptance in place of the paper's tau curve.  The worker publishes, per step, the sum
# over requests of E_n = sum of the first n nodes' path probabilities (the drafter's
# expected accepted draft tokens of the best n-node tree) for every candidate n; the
# scheduler re-fills vLLM's batch-size -> budget lookup from their moving average.


def capture_schedule(max_budget: int, depth: int) -> list[tuple[int, int, int]]:
    """The static schedule, plus one range past any real batch size for each candidate
    budget it does not use: vLLM captures a CUDA graph for every budget in the schedule,
    so every width the online policy may pick has one."""
    sched = budget_schedule(max_budget, depth)
    used = {b for _, _, b in sched}
    start = sched[-1][1] + 1
    for i, b in enumerate(c for c in candidates(max_budget, depth) if c not in used):
        sched.append((start + i, start + i, b))
    return sched


def drafter_budgets(step_budget: Sequence[int], graph_sizes: Iterable[int]) -> list[int]:
    """The tree budget of a drafter pass of ``n`` requests, for every ``n`` (index 0
    unused), given ``step_budget[n]``, the draft tokens vLLM's scheduler gives a step of
    ``n`` requests (vLLM's dense lookup, index 0 unused), and the request counts of the
    drafter's CUDA graphs.

    A pass of ``n`` requests replays the graph of the smallest size ``N >= n``, whose
    tree build was fixed at capture, so that graph builds the largest budget among the
    batch sizes it serves (``N' < m <= N``, ``N'`` the next smaller size): no step
    verifies more rows than its tree has nodes, and no pass builds a wider tree than a
    step it serves verifies.  A pass of more requests than the largest graph runs
    eagerly: it builds its step's budget, or the largest graph's where that is more
    (a width compiled at capture, not at first use while serving)."""
    sizes = sorted({s for s in graph_sizes if s > 0})
    out = list(step_budget)
    for n in range(1, min(len(step_budget), sizes[-1] + 1) if sizes else 1):
        i = bisect.bisect_left(sizes, n)
        lo = sizes[i - 1] + 1 if i > 0 else 1
        out[n] = max(step_budget[lo:sizes[i] + 1])
    if sizes and sizes[-1] < len(step_budget):
        widest = out[sizes[-1]]
        out[sizes[-1] + 1:] = [max(b, widest) for b in step_budget[sizes[-1] + 1:]]
    return out
