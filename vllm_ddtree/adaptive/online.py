"""Scheduler side of ``ddtree_adaptive_budget: "online"``: the budget per batch size
re-tuned from the drafter's published expectations (worker side:
:mod:`vllm_ddtree.adaptive.publisher`).  Pure Python."""

from __future__ import annotations

from vllm_ddtree.adaptive.channel import StatsChannel
from vllm_ddtree.adaptive.schedule import batch_buckets, candidates, step_cost


class OnlineSchedule:
    """Per-batch-size budget maximizing ``(1 + E_n) / step_cost(batch, 1 + n)`` over the
    candidate budgets, with ``E_n`` an exponential moving average (``half_life`` steps) of
    the published per-request expectations.  Before the first observation it keeps
    whatever lookup it is given (the static schedule).  Budget ``D`` verifies as many
    rows as the chain and holds at least the chain's expectation, so the pick is never
    worse than the chain under the model."""

    def __init__(self, max_budget: int, depth: int, max_batch: int, half_life: float = 64):
        self.budgets = candidates(max_budget, depth)
        self.decay = 0.5 ** (1.0 / half_life)
        self.expected: list[float] | None = None
        # the static schedule's buckets and representatives, cut at the largest batch
        self.ranges = [(lo, min(hi, max_batch), [step_cost(mid, 1 + n) for n in self.budgets])
                       for lo, hi, mid in batch_buckets() if lo <= max_batch]

    def observe(self, steps: float, requests: float, sums: list[float]) -> None:
        """``steps`` steps with ``requests`` request-trees in all, ``sums[c]``: the sum of
        their ``E_n`` for budget ``budgets[c]``."""
        if requests <= 0 or steps <= 0:
            return
        mean = [s / requests for s in sums]
        if self.expected is None:
            self.expected = mean
            return
        w = 1.0 - self.decay ** steps
        self.expected = [e + w * (m - e) for e, m in zip(self.expected, mean)]

    def pick(self, costs: list[float]) -> int:
        assert self.expected is not None
        best = max(range(len(self.budgets)),
                   key=lambda c: ((1.0 + self.expected[c]) / costs[c], -c))
        return self.budgets[best]

    def apply(self, lookup: list[int]) -> None:
        """Re-fill vLLM's dense ``batch size -> budget`` list (index 0 unused) in place."""
        if self.expected is None:
            return
        for lo, hi, costs in self.ranges:
            hi = min(hi, len(lookup) - 1)
            if lo <= hi:
                lookup[lo:hi + 1] = [self.pick(costs)] * (hi - lo + 1)


class OnlineTuner:
    """Scheduler side: every ``every`` calls, fold the channel's new sums into the
    policy and re-fill the lookup, and remove the channel's file once the worker has
    attached.  Pure Python, a few microseconds per call."""

    def __init__(self, schedule: OnlineSchedule, channel: StatsChannel, every: int = 16):
        self.schedule, self.channel, self.every = schedule, channel, every
        self._calls = 0
        self._last = (0.0, 0.0, [0.0] * channel.width)

    def tick(self, lookup: list[int]) -> None:
        self._calls += 1
        if self._calls % self.every:
            return
        self.channel.remove_once_attached()
        steps, reqs, sums = self.channel.read()
        s0, r0, u0 = self._last
        if steps > s0:
            self.schedule.observe(steps - s0, reqs - r0, [a - b for a, b in zip(sums, u0)])
            self.schedule.apply(lookup)
            self._last = (steps, reqs, sums)
