"""Where two greedy runs of one target part, how close the target's top two logits were.

    python3 -m benchmarks.greedy_ties TARGET RUN_A.json RUN_B.json

``RUN_*.json``: the token ids of the quick-start completions (``CASES``, in order), as
``benchmarks/gpu_quickstart.sh`` writes them for DDTree and for no speculation.  For each
completion that differs, the target (Hugging Face ``transformers``, CPU) scores run B's
prefix up to the first different token, in float32 and in bfloat16, and prints the two
tokens, the top-3 logits and each run's token's logit.  A gap of a few hundredths in
float32 that bfloat16 rounds to a tie is a near-tie: two correct greedy decoders in
bfloat16 may take either token there (different kernels, batch shapes, or a tree verify
instead of one row).  A large gap would point at a bug.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (prompt or prompts of one request, max_tokens): one single request, one batch of four
CASES = [("def fibonacci(n):", 64),
         (["The capital of France is", "Write a haiku about trees.", "1, 1, 2, 3, 5, 8,",
           "Explain speculative decoding."], 96)]


def prompts() -> list[str]:
    """Every completion's prompt, in the order the runs list their token ids."""
    return [p for prompt, _ in CASES for p in ([prompt] if isinstance(prompt, str) else prompt)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (or where the shorter ends)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    args = ap.parse_args(argv)
    runs = [json.loads(Path(p).read_text()) for p in (args.run_a, args.run_b)]
    tok = AutoTokenizer.from_pretrained(args.target)
    print(f"{'':>2} {'dtype':<9} {'at':>3} {'A':>6} {'B':>6}  top-3 logits (token: logit)"
          f"{'':>16} gap A-B")
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
        for i, (prompt, a, b) in enumerate(zip(prompts(), *runs)):
            k = first_difference(a, b)
            if k is None:
                print(f"{i:>2} {str(dtype)[6:]:<9} identical")
                continue
            with torch.no_grad():
                ids = torch.tensor([tok(prompt).input_ids + b[:k]])
                logits = model(ids).logits[0, -1].float()
            top = torch.topk(logits, 3)
            tops = ", ".join(f"{t}: {v:.3f}" for t, v in zip(top.indices.tolist(),
                                                               top.values.tolist()))
            gap = (logits[a[k]] - logits[b[k]]).item()
            print(f"{i:>2} {str(dtype)[6:]:<9} {k:>3} {a[k]:>6} {b[k]:>6}  {tops:<40} {gap:+.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
