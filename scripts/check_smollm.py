"""Check the converted SmolLM2-135M folder in vLLM (and, optionally, with a drafter).

    python3 -m scripts.check_smollm                     # vLLM greedy == transformers greedy
    python3 -m scripts.check_smollm --drafter DIR       # also dflash + ddtree engines

Converts the GGUF first if needed (``vllm_ddtree.demo.smollm``).  Greedy output of vLLM
(float32 by default, so both sides compute in the same precision) must equal
transformers' greedy output token for token; with ``--drafter`` the script also runs
the drafter as ``{"method": "dflash"}`` and ``{"method": "ddtree"}`` and prints the
acceptance counters (greedy output must stay identical to no speculation).

On CPU: ``VLLM_CPU_KVCACHE_SPACE=1`` is set unless already set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    \"\"\"A simple LIFO stack.\"\"\"\n\n    def __init__(self):",
    "The capital of France is",
]
CHAT = "Write a Python function that checks whether a string is a palindrome."


def _counters(llm) -> tuple[int, int, int]:
    from vllm_ddtree.testing.metrics import spec_counts

    return tuple(spec_counts(llm))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="converted folder (default: vllm_ddtree.demo.smollm's)")
    p.add_argument("--drafter", help="a DFlash drafter folder to run as dflash and ddtree")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--budget", type=int, default=32, help="DDTree budget")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers comparison")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch
    from vllm import SamplingParams

    from vllm_ddtree.demo.smollm import ensure_smollm
    from vllm_ddtree.testing.engines import llm_engine

    model = args.model or str(ensure_smollm())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT}], tokenize=False,
                                   add_generation_prompt=True)
    prompts = PROMPTS + [chat]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def engine(spec=None):
        return llm_engine(model=model, dtype=args.dtype, max_model_len=1024, enforce_eager=True,
                          seed=0, max_num_seqs=8, gpu_memory_utilization=0.2,
                          disable_log_stats=False, speculative_config=spec)

    runs = {}
    specs = [("none", None)]
    if args.drafter:
        specs += [("dflash", {"method": "dflash", "model": args.drafter,
                              "num_speculative_tokens": 15}),
                  ("ddtree", {"method": "ddtree", "model": args.drafter,
                              "num_speculative_tokens": args.budget})]
    ok = True
    for name, spec in specs:
        with engine(spec) as llm:
            t0 = time.perf_counter()
            outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
            dt = time.perf_counter() - t0
            counts = _counters(llm) if spec else None
        runs[name] = outs
        line = f"[{name}] {sum(map(len, outs))} tokens in {dt:.1f} s"
        if spec:
            d, n, a = counts
            line += f"; drafts {d}, drafted {n}, accepted {a}"
            if d:
                line += f", mean acceptance length {1 + a / d:.2f}"
            same = outs == runs["none"]
            ok &= same
            line += f"; greedy identical to no speculation: {same}"
        print(line, flush=True)
    print("--- vLLM greedy, code prompt ---")
    print(PROMPTS[0] + tok.decode(runs["none"][0]))
    print("--- vLLM greedy, chat prompt ---")
    print(tok.decode(runs["none"][-1]))

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, args.dtype))
        for i, prompt in enumerate(prompts):
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                gen = hf.generate(ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=args.max_tokens, do_sample=False,
                                  min_new_tokens=args.max_tokens, eos_token_id=None,
                                  pad_token_id=tok.pad_token_id)
            ref = gen[0, ids.shape[1]:].tolist()
            same = ref == runs["none"][i]
            ok &= same
            first = next((j for j, (a, b) in enumerate(zip(ref, runs["none"][i])) if a != b), None)
            print(f"prompt {i}: transformers == vLLM greedy: {same}"
                  + ("" if same else f" (first difference at token {first})"))
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
