"""Where a decode step's time goes, from a ``throughput.py --profile --trace`` trace.

    python3 -m benchmarks.trace_summary TRACE.json.gz [--steps N] [--match vllm_ddtree/]
                                        [--top 25]

Reads the gzipped Chrome trace (recorded with Python stacks) and prints, per step (the
trace's ``--steps``, default: the number of DDTree ``propose`` calls, else of the model
runner's ``execute_model`` calls):

* wall time, GPU-busy time (union of kernel intervals) and GPU-idle time;
* the Python functions whose path contains ``--match`` (default ``vllm_ddtree/``), by
  inclusive host time per step, with calls per step; an entry nested in another one of
  the list is counted in both (inclusive);
* the same for every function outside the match with the most time, for context.

Pure Python; no torch needed.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (µs)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def count_steps(events: list[dict]) -> int:
    """DDTree propose calls, else the model runner's execute_model calls.  Neither in
    the trace (e.g. the workers of a TP > 1 engine ran in other processes): ask for
    ``--steps``."""
    names = [e["name"] for e in events if e.get("cat") == "python_function"]
    for where, func in (("vllm_ddtree", ": propose"), ("model_runner", ": execute_model")):
        n = sum(1 for name in names if where in name and name.endswith(func))
        if n:
            return n
    raise SystemExit("no propose/execute_model frames in this trace (workers in other "
                     "processes?): give --steps")


def summarize(events: list[dict], steps: int | None, match: str, top: int) -> dict:
    pys = [e for e in events if e.get("cat") == "python_function" and "dur" in e]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    timed = [e for e in events if "dur" in e and "ts" in e and e.get("ph") == "X"]
    t0 = min(e["ts"] for e in timed)
    t1 = max(e["ts"] + e["dur"] for e in timed)
    steps = steps or count_steps(events)
    busy = busy_union(kernels)
    # inclusive time per function: the union of its frames per thread (recursive frames
    # of the same function are not counted twice), and its calls
    by_name: dict[str, dict[object, list[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(list))
    for e in pys:
        by_name[e["name"]][e.get("tid")].append((e["ts"], e["ts"] + e["dur"]))
    incl = {name: (sum(busy_union(v) for v in per_tid.values()),
                   sum(len(v) for v in per_tid.values()))
            for name, per_tid in by_name.items()}
    rows = sorted(incl.items(), key=lambda kv: kv[1][0], reverse=True)
    ours = [(n, t / steps / 1000, c / steps) for n, (t, c) in rows if match in n][:top]
    other = [(n, t / steps / 1000, c / steps) for n, (t, c) in rows if match not in n][:top]
    return dict(steps=steps, wall_ms=(t1 - t0) / steps / 1000, gpu_busy_ms=busy / steps / 1000,
                gpu_idle_ms=((t1 - t0) - busy) / steps / 1000 if kernels else None,
                ours=ours, other=other)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--match", default="vllm_ddtree/")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args(argv)
    s = summarize(load(args.trace), args.steps, args.match, args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    idle = "-" if s["gpu_idle_ms"] is None else f"{s['gpu_idle_ms']:.3f}"
    print(f"steps {s['steps']}: wall {s['wall_ms']:.3f} ms/step (profiled), GPU busy "
          f"{s['gpu_busy_ms']:.3f}, GPU idle {idle}")
    for title, rows in ((f"functions matching {args.match!r}", s["ours"]),
                        ("other functions", s["other"])):
        print(f"\n{title}: inclusive host ms/step, calls/step")
        for name, ms, calls in rows:
            print(f"  {ms:8.3f}  {calls:6.2f}  {name[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
