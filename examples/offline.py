"""Offline generation with DDTree through vLLM's ``LLM`` class.

    python examples/offline.py                                   # bundled tiny pair
    python examples/offline.py --target Qwen/Qwen3-4B --drafter z-lab/Qwen3-4B-DFlash-b16

With no ``--target`` / ``--drafter`` the tiny random-weight pair of
``vllm_ddtree.testing.fixtures`` is written to ``$VLLM_DDTREE_CACHE`` (default
``~/.cache/vllm-ddtree/fixtures``) and used: the text is gibberish, but the run shows
the API. Installing vllm-ddtree is all it takes; vLLM loads the plugin by itself.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model (HF id or folder)")
    p.add_argument("--drafter", help="DFlash drafter for the target (HF id or folder)")
    p.add_argument("--budget", type=int, default=15, help="tree nodes verified per step")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt", action="append",
                   help="prompt (repeatable; default: two built-in prompts)")
    args = p.parse_args()

    import torch

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache

    if (args.target is None) != (args.drafter is None):
        p.error("give both --target and --drafter, or neither")
    if args.target is None:
        from vllm_ddtree.testing.fixtures import make_tiny_pair

        cache = os.environ.get("VLLM_DDTREE_CACHE",
                               Path.home() / ".cache" / "vllm-ddtree" / "fixtures")
        target, drafter = map(str, make_tiny_pair(cache, "random"))
        dtype = "float32"
    else:
        target, drafter, dtype = args.target, args.drafter, "auto"

    from vllm import LLM, SamplingParams

    from vllm_ddtree.testing.metrics import spec_counts

    llm = LLM(
        model=target,
        dtype="float32" if on_cpu else dtype,
        max_model_len=2048,
        speculative_config={"method": "ddtree", "model": drafter,
                            "num_speculative_tokens": args.budget},
        disable_log_stats=False,  # keeps the speculative-decoding counters
        **({"enforce_eager": True, "gpu_memory_utilization": 0.2} if on_cpu else {}),
    )
    prompts = args.prompt or ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for out in llm.generate(prompts, params):
        o = out.outputs[0]
        print(f"--- {out.prompt!r} ({len(o.token_ids)} tokens, {o.finish_reason})\n{o.text!r}")

    drafts, _, accepted = spec_counts(llm)  # vLLM's spec-decode counters
    if drafts:
        print(f"\ndrafts: {drafts}, accepted tokens: {accepted}, "
              f"mean acceptance length: {1 + accepted / drafts:.2f}")


if __name__ == "__main__":  # required: vLLM starts worker processes that re-import this file
    main()
