"""DDTree on vLLM's GPU runner (Model Runner V2): greedy exactness against no
speculation, and acceptance, on the project's tiny fixtures (bf16).

    python3 -m benchmarks.gpu_correctness --out $OUT [--fixtures F,...] [--budgets B,...]

For every fixture, budget and CUDA-graph mode, one engine serves batches of 1, 4 and
32 prompts; outputs are compared token by token with a no-speculation engine of the
same fixture and graph mode (``--ref-eager``: an eager one).  Fixtures are the DFlash
pairs of :func:`vllm_ddtree.testing.fixtures.make_tiny_pair` by variant name, and DSpark
drafters as ``dspark:VARIANT[:V_DRAFT]`` (:mod:`vllm_ddtree.testing.dspark_fixture`, with
its paired target; ``V_DRAFT`` a reduced draft vocabulary).  ``--chain`` also serves the
drafter's own chain (method ``dflash`` or ``dspark``, one drafter block of drafts).
Prints a table last, with a digest of each batch's speculative outputs (equal digests:
equal tokens, e.g. TP = 1 against TP = 2); writes ``results.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

PROMPTS = [
    "hello world", "the quick brown fox jumps over", "def f(x):\n    return", "a",
    "import os\nimport sys\n\n", "12345", "Once upon a time, in a land far away,", "zz",
]


def prompts(n):
    return [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(n)]


def engine(target, spec, graphs, budget=None, tp=1):
    """An engine of the fixture ``target``, shut down when its ``with`` block ends."""
    from vllm_ddtree.testing.engines import llm_engine

    kw = {"tensor_parallel_size": tp}
    if graphs:
        width = 1 + (budget or 0)
        kw["compilation_config"] = {"max_cudagraph_capture_size": min(32 * width, 8192)}
    return llm_engine(model=str(target), dtype="bfloat16", max_model_len=512, seed=0,
                      max_num_seqs=32, max_num_batched_tokens=8192, gpu_memory_utilization=0.3,
                      enforce_eager=not graphs, disable_log_stats=False,
                      speculative_config=spec, **kw)


def counters(llm):
    from vllm_ddtree.testing.metrics import spec_counts

    c = spec_counts(llm)
    return c.drafts, c.accepted


def run_batches(llm, batches, max_tokens):
    from vllm import SamplingParams

    out = {}
    for n in batches:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        d0, a0 = counters(llm)
        t = time.perf_counter()
        res = llm.generate(prompts(n), sp, use_tqdm=False)
        dt = time.perf_counter() - t
        d1, a1 = counters(llm)
        tau = 1 + (a1 - a0) / (d1 - d0) if d1 > d0 else float("nan")
        out[n] = ([list(r.outputs[0].token_ids) for r in res], tau, dt)
    return out


def digest(token_ids) -> str:
    """Short hash of a batch's outputs: compares runs (TP = 1 against TP = 2) by value."""
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:12]


def fixture(root: Path, name: str) -> tuple[Path, Path, tuple[str, int]]:
    """``(target, drafter, (chain method, its drafts))`` of a fixture name (module
    docstring), bf16, written under ``root``."""
    from vllm_ddtree.testing import dspark_fixture
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    if not name.startswith("dspark:"):
        target, drafter = make_tiny_pair(root, name, "bfloat16")
        return target, drafter, ("dflash", 15)  # block 16: the bonus slot + 15 masks
    variant, _, vd = name.removeprefix("dspark:").partition(":")
    target, _ = make_tiny_pair(root, dspark_fixture.PAIRED_TARGET[variant], "bfloat16")
    drafter = dspark_fixture.write_dspark_drafter(root, variant, "bfloat16",
                                                  draft_vocab_size=int(vd) if vd else None)
    return target, drafter, ("dspark", 16)  # block 16: every slot predicts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-correctness")
    ap.add_argument("--fixtures", default="accept_all,tree_beats_chain,random")
    ap.add_argument("--budgets", default="15,60,240")
    ap.add_argument("--graphs", default="0,1")
    ap.add_argument("--batches", default="1,4,32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ref-eager", action="store_true", help="the no-speculation reference "
                    "runs eager (faster start; the margin fixtures' tokens do not depend on it)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (8 needs "
                    "VLLM_DDTREE_FIXTURE_HEADS=8)")
    ap.add_argument("--chain", action="store_true", help="also serve the drafter's chain")
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(x) for x in args.batches.split(",")]
    rows = []
    for fx in args.fixtures.split(","):
        target, drafter, chain = fixture(out / "fixtures", fx)
        runs = [("ddtree", int(b)) for b in args.budgets.split(",")]
        if args.chain:
            runs.append(chain)
        for graphs in [bool(int(x)) for x in args.graphs.split(",")]:
            with engine(target, None, graphs and not args.ref_eager, tp=args.tp) as llm:
                ref = run_batches(llm, batches, args.max_tokens)
            for method, budget in runs:
                spec = {"method": method, "model": str(drafter),
                        "num_speculative_tokens": budget}
                with engine(target, spec, graphs, budget, tp=args.tp) as llm:
                    got = run_batches(llm, batches, args.max_tokens)
                for n in batches:
                    same = sum(a == b for a, b in zip(got[n][0], ref[n][0]))
                    rows.append(dict(fixture=fx, method=method, graphs=graphs,
                                     budget=budget, batch=n,
                                     identical=same, total=n, tau=got[n][1],
                                     digest=digest(got[n][0]), ref_digest=digest(ref[n][0]),
                                     t_ddtree=got[n][2], t_ref=ref[n][2]))
                    print(json.dumps(rows[-1]), flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print("\nfixture              method graphs budget batch identical  tau    t_spec "
          "t_nospec digest")
    for r in rows:
        print(f"{r['fixture']:<20} {r['method']:<6} {int(r['graphs']):>6} {r['budget']:>6} "
              f"{r['batch']:>5} "
              f"{r['identical']:>4}/{r['total']:<4} {r['tau']:6.2f} {r['t_ddtree']:8.2f} "
              f"{r['t_ref']:8.2f} {r['digest']}")


if __name__ == "__main__":
    main()
