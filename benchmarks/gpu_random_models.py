"""Random-weight models on the GPU runner: greedy agreement with no speculation through
64 tokens, where any mismatch sits (the target's top-2 logit gap there, in bf16 ulps),
and DDTree's step cost against vLLM's DFlash chain at equal verify width.

    python3 -m benchmarks.gpu_random_models --out $OUT [--shaped] [--tiny]

``--shaped`` writes a Qwen3-shaped target (``benchmarks.shaped_models``' ``qwen3-2b``:
hidden 2048, 24 layers, 16/8 heads of 128, vocab 151936) and a 2-layer DFlash drafter
with random weights under SHAPED_DIR (default /tmp/qwen3-2b-random); ``--tiny``
uses the project's random tiny fixture.  Random drafts are almost never accepted, so each
step emits ~one token and wall time / tokens ~ step time.

Mismatch rule (stated threshold): a mismatch counts as a bf16 near-tie when the
target's top-2 raw logits at that position differ by at most 4 bf16 ulps of the top
logit (ulp = 2^(floor(log2|x|) - 7)).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

TP = int(os.environ.get("TP", "1"))  # tensor-parallel size of every engine


def engine(target, spec=None, width=16, **kw):
    """An engine of ``target``, shut down when its ``with`` block ends."""
    from vllm_ddtree.testing.engines import llm_engine

    return llm_engine(model=str(target), dtype="bfloat16", max_model_len=1024, seed=0,
                      max_num_seqs=32, max_num_batched_tokens=8192, gpu_memory_utilization=0.22,
                      disable_log_stats=False, speculative_config=spec, tensor_parallel_size=TP,
                      compilation_config={"max_cudagraph_capture_size": min(32 * width, 8192)},
                      **kw)


def drafts(llm):
    from vllm_ddtree.testing.metrics import spec_counts

    return spec_counts(llm).drafts


def generate(llm, prompts, max_tokens):
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res], time.perf_counter() - t


def ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


def top2(llm, prompt):
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
    vals = sorted((lp.logprob for lp in out.outputs[0].logprobs[0].values()), reverse=True)
    return vals[0], vals[1]


def run(name, target, drafter, max_tokens=64, batches=(1, 32), budgets=(15, 60),
        max_id=990, dflash=True):
    rnd = random.Random(0)
    prompts = [[rnd.randrange(3, max_id) for _ in range(rnd.randrange(16, 64))] for _ in range(32)]
    rows = []
    configs = [("dflash", 15)] * dflash + [("ddtree", b) for b in budgets]
    with engine(target, logprobs_mode="raw_logits") as ref_llm:
        ref = {n: generate(ref_llm, prompts[:n], max_tokens) for n in batches}
        for method, k in configs:
            spec = {"method": method, "model": str(drafter), "num_speculative_tokens": k}
            with engine(target, spec, width=k + 1) as llm:
                generate(llm, prompts[:2], 8)  # warm up
                for n in batches:
                    rows.append(compare(name, method, k, n, llm, ref_llm, prompts, ref[n],
                                        max_tokens))
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def compare(name, method, k, n, llm, ref_llm, prompts, ref, max_tokens) -> dict:
    """One row: the first ``n`` prompts on ``llm`` against ``ref`` (the no-speculation
    engine's ``(tokens, seconds)``), each mismatch with the reference's top-2 logit gap."""
    d0 = drafts(llm)
    toks, dt = generate(llm, prompts[:n], max_tokens)
    steps = max(1.0, (drafts(llm) - d0) / n)  # verify steps per request
    same = sum(a == b for a, b in zip(toks, ref[0]))
    gaps = []
    for i, (a, b) in enumerate(zip(toks, ref[0])):
        if a == b:
            continue
        j = next(x for x in range(len(a)) if a[x] != b[x])
        l1, l2 = top2(ref_llm, prompts[i] + b[:j])
        gaps.append(dict(seq=i, pos=j, gap=l1 - l2, ulps=(l1 - l2) / ulp(l1)))
    return dict(model=name, method=method, k=k, batch=n, identical=same, total=n,
                near_ties=sum(g["ulps"] <= 4 for g in gaps), mismatches=gaps,
                tau=n * max_tokens / max(1.0, drafts(llm) - d0),
                ms_per_step=1000 * dt / steps,
                ms_nospec=1000 * ref[1] / max_tokens)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-random")
    ap.add_argument("--shaped", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--budgets", default=None, help="DDTree budgets (default: tiny "
                    "15,60,240; shaped 15,60)")
    ap.add_argument("--no-dflash", action="store_true", help="skip vLLM's DFlash control rows")
    args = ap.parse_args()
    kw = dict(dflash=not args.no_dflash)
    if args.budgets:
        kw["budgets"] = tuple(int(b) for b in args.budgets.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.tiny:
        from vllm_ddtree.testing.fixtures import make_tiny_pair

        t, d = make_tiny_pair(out / "fixtures", "random", "bfloat16")
        rows += run("tiny-random", t, d, max_id=250, **{"budgets": (15, 60, 240), **kw})
    if args.shaped:
        from benchmarks.shaped_models import write_pair

        t, d = write_pair(os.environ.get("SHAPED_DIR", "/tmp/qwen3-2b-random"), "qwen3-2b",
                          "random")
        rows += run("qwen3-2048x24-random", t, d, **kw)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print("\nmodel                 method  k   batch identical near-tie/mismatch  max-ulps  "
          " tau  ms/step  ms/step(no spec)")
    for r in rows:
        mx = max((g["ulps"] for g in r["mismatches"]), default=0.0)
        print(f"{r['model']:<21} {r['method']:<7} {r['k']:<3} {r['batch']:>5} "
              f"{r['identical']:>4}/{r['total']:<4} {r['near_ties']:>8}/{len(r['mismatches']):<8} "
              f"{mx:8.1f} {r['tau']:5.2f} {r['ms_per_step']:8.2f} {r['ms_nospec']:8.2f}")


if __name__ == "__main__":
    main()
