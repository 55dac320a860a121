"""Pool the paired ratios of interleaved ``throughput.py`` runs (their ``results.json``).

In an interleaved run every engine ran the same prompts once per repeat within seconds,
so each repeat gives one within-repeat ratio per engine against ``dflash``
(``tok_s_runs``) and, where the run timed its engine outputs, one ratio of median output
gaps (``median_gap_ms``: the step time, stalls aside).  This prints, per method and
temperature:

* per batch: the median of the cell's ratios over all files (and how many);
* over all batches: the geometric mean of every ratio with a 95% bootstrap interval
  (resampling the ratios, seeded).  A second DFlash engine (``dflash-b``) gives the
  same numbers for two identical engines: the noise floor the others are read against.

``--ref`` compares with another engine of the runs instead (e.g. ``dspark``).

    python3 -m benchmarks.pooled docs/benchmarks/smollm-pair-h200-t*.json

Pure Python; no vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys

INPROC = "@inproc"  # throughput.py's method suffix: engine core in-process


def reference(method: str, ref: str, methods) -> str:
    """The engine ``method`` is compared with: ``ref``, or ``ref@inproc`` for an
    in-process engine when the run has one (like against like)."""
    if method.endswith(INPROC) and ref + INPROC in methods:
        return ref + INPROC
    return ref


def paired(rows: list[dict], key: str = "tok_s_runs", ref: str = "dflash",
           invert: bool = False) -> dict:
    """``{(method, T, batch): [ratio per repeat]}`` of one run's rows against ``ref``
    (:func:`reference`); ``invert``: ref / method (for times, so that > 1 still means
    faster)."""
    by = {(r["method"], r["temperature"], r["batch"]): r for r in rows}
    names = {r["method"] for r in rows}
    out: dict = {}
    for (m, t, b), r in by.items():
        base = reference(m, ref, names)
        d = by.get((base, t, b))
        if m == base or d is None or r.get(key) is None or d.get(key) is None:
            continue
        xs = [(y / x if invert else x / y) for x, y in zip(r[key], d[key])
              if x is not None and y is not None and x > 0 and y > 0]
        if xs:
            out.setdefault((m, t, b), []).extend(xs)
    return out


def merge(parts: list[dict]) -> dict:
    out: dict = {}
    for p in parts:
        for k, xs in p.items():
            out.setdefault(k, []).extend(xs)
    return out


def geomean(xs) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def bootstrap(xs, n: int = 4000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the geometric mean over ``n`` resamples of ``xs``."""
    rng = random.Random(seed)
    means = sorted(geomean(rng.choices(xs, k=len(xs))) for _ in range(n))
    lo = int((1 - level) / 2 * n)
    return means[lo], means[n - 1 - lo]


def summarize(ratios: dict) -> list[dict]:
    """One row per (method, T): per-batch medians and the pooled geometric mean."""
    rows = []
    for m, t in sorted({(m, t) for m, t, _ in ratios}, key=lambda k: (k[1], k[0])):
        cells = {b: xs for (mm, tt, b), xs in ratios.items() if (mm, tt) == (m, t)}
        every = [x for b in sorted(cells) for x in cells[b]]
        lo, hi = bootstrap(every)
        rows.append(dict(method=m, temperature=t, n=len(every), geomean=geomean(every),
                         ci95=(lo, hi),
                         per_batch={b: (statistics.median(cells[b]), len(cells[b]))
                                    for b in sorted(cells)}))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results.json files of interleaved runs")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--ref", default="dflash",
                    help="the engine every other is compared with (default: dflash)")
    args = ap.parse_args(argv)
    runs = []
    for path in args.results:
        with open(path) as f:
            res = json.load(f)
        if not res["meta"].get("interleaved"):
            print(f"{path}: not an interleaved run, skipped", file=sys.stderr)
            continue
        runs.append(res["rows"])
    out = {}
    for what, key, invert in (("throughput", "tok_s_runs", False),
                              (f"step (median output gap, {args.ref} / method)",
                               "median_gap_ms", True)):
        summary = summarize(merge([paired(rows, key, args.ref, invert) for rows in runs]))
        out[what] = summary
        if not summary:
            continue
        print(f"\n{what} against {args.ref}: pooled geometric mean [95% bootstrap], n; "
              "per batch: median (n)")
        for s in summary:
            cells = "  ".join(f"b{b} {med:.2f} ({k})" for b, (med, k) in s["per_batch"].items())
            print(f"{s['method']:<12} T={s['temperature']:g}  {s['geomean']:.3f} "
                  f"[{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}] n={s['n']:<3}  {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
