"""Statistics shared by the distribution tests and benchmarks (needs scipy)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence


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
