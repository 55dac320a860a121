"""Statistics shared by the tests, benchmarks and demo: vLLM's spec-decode counters and
engine step count of an ``LLM``, and a two-sample chi-square test (needs scipy)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import NamedTuple

_PREFIX = "vllm:spec_decode_num_"


class SpecCounts(NamedTuple):
    """vLLM's cumulative spec-decode counters (one draft = one request's verify step)."""

    drafts: int
    draft_tokens: int
    accepted: int

    @property
    def tau(self) -> float | None:
        """Mean acceptance length: tokens per verify step (None before any draft)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    def __sub__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(*(a - b for a, b in zip(self, other)))


def spec_counts(llm, strict: bool = False) -> SpecCounts:
    """The counters of an ``LLM`` built with ``disable_log_stats=False``.  ``strict``: a
    missing counter raises ``KeyError`` (a speculative engine must export all three);
    otherwise it counts 0 (an engine without speculation)."""
    m = {x.name: x.value for x in llm.get_metrics()
         if x.name.startswith(_PREFIX) and hasattr(x, "value")}
    names = ("drafts", "draft_tokens", "accepted_tokens")
    if strict:
        return SpecCounts(*(int(m[_PREFIX + n]) for n in names))
    return SpecCounts(*(int(m.get(_PREFIX + n, 0)) for n in names))


def engine_steps(llm) -> int:
    """Engine steps so far: the count of vLLM's per-iteration token histogram (prefill
    steps included; needs ``disable_log_stats=False``)."""
    return sum(int(x.count) for x in llm.get_metrics()
               if x.name == "vllm:iteration_tokens_total" and hasattr(x, "count"))


def two_sample_p_value(xs: Sequence[Hashable], ys: Sequence[Hashable],
                       min_count: int = 20) -> float:
    """Chi-square p-value that two samples of categories come from one distribution.

    Categories seen fewer than ``min_count`` times in both samples together are merged
    into one cell (the chi-square approximation needs populated cells); fewer than two
    cells left means nothing to compare (p = 1).
    """
    from scipy.stats import chi2_contingency

    cx, cy = Counter(xs), Counter(ys)
    table, rare = [], [0, 0]
    for c in sorted(set(cx) | set(cy), key=lambda c: -(cx[c] + cy[c])):
        if cx[c] + cy[c] >= min_count:
            table.append([cx[c], cy[c]])
        else:
            rare[0] += cx[c]
            rare[1] += cy[c]
    if sum(rare):
        table.append(rare)
    if len(table) < 2:
        return 1.0
    return float(chi2_contingency(list(zip(*table)))[1])
