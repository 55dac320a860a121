"""Cost of each DDTree-specific part of a decode step at Qwen3-8B shape (no vLLM needed).

    python3 -m benchmarks.gpu_step_parts [--out DIR] [--requests 1,8,32] [--budgets 15,64,256]
                                         [--topk-prune 0,1]

For requests R in {1, 8, 32} and budgets B in {15, 64, 256}: the tree build (+ layout and
store, as in the drafter's CUDA graph), the per-row metadata fill, the fused walk, the
KV compaction over 36 layers, and the Triton tree part of attention merged into a prefix
result (32 query / 8 KV heads of 128, 1024-token prefix) for one layer and for 36.
Median of CUDA-event timings over 30 runs after 5 warm-ups, as eager launches and, in the
"(graph)" columns, replayed from a CUDA graph as vLLM runs them (the tree attention part:
36 layers' launches in one graph). Columns: build (tree build + layout + store), fill
(per-row metadata), topk/g (the tree build's per-depth top-k and log-sum-exp,
``topk_lse_triton`` at k = min(B, the variant's largest k)), walk (fused walk,
``walk_rows_triton``), compact36 (KV compaction over 36 layers, k = D), attn1 / attn36
(the Triton tree part of attention, 1 layer / 36 layers); "/g" = replayed from a CUDA
graph; stop/torch and stop/triton (the T > 0 verify's stop draw,
``draw_stop_tokens_torch`` and ``draw_stop_tokens_triton``, eager as vLLM's sampler runs
it, with a torch Gumbel draw standing in for vLLM's).
Prints a table last; compare with an 8B decode step of ~5.3 ms (batch 1) in vLLM 0.26.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.core_gpu import median_ms
from vllm_ddtree.gpu.compaction import KVCompactor
from vllm_ddtree.gpu.step_rows import StepRows
from vllm_ddtree.gpu.tree_state import TreeStates
from vllm_ddtree.gpu.verify_sampling import (
    NO_CHILD,
    draw_stop_tokens_torch,
    draw_stop_tokens_triton,
)
from vllm_ddtree.gpu.walk import walk_rows_triton
from vllm_ddtree.kernels.topk_lse import topk_lse_max_k, topk_lse_triton
from vllm_ddtree.kernels.tree_attention import tree_attention_triton
from vllm_ddtree.tree import build_tree

V, D, LAYERS, HQ, HKV, HD, PREFIX, BS = 151936, 15, 36, 32, 8, 128, 1024, 16


def timed(fn):
    return median_ms(fn, iters=30)


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def case(R, B, topk_pruned, dev="cuda"):
    W = B + 1
    ts = TreeStates(max(R, 1), B, D, dev)
    rows = StepRows(max(R, 1), R * W, B, dev)
    logits = torch.randn(R, D, V, device=dev, dtype=torch.bfloat16) * 3
    draft_tokens = torch.zeros(R, B, dtype=torch.int64, device=dev)
    idx = torch.arange(R, dtype=torch.int32, device=dev)
    states = idx.long()

    def build():
        tree = build_tree(logits, B, topk_pruned=topk_pruned)
        ts.store_batch(tree, logits, draft_tokens, states)

    res = {"build": timed(build), "build/g": timed(graphed(build))}
    x = logits.view(R * D, V)
    k = min(B, topk_lse_max_k(topk_pruned))
    res["topk/g"] = timed(graphed(lambda: topk_lse_triton(x, k, pruned=topk_pruned)))
    qs = (torch.arange(R + 1, device=dev) * W).to(torch.int32)
    cu = qs.clone()
    T = R * W
    pos = (torch.arange(T, device=dev) % W + PREFIX).long()
    seq_lens = torch.full((R,), PREFIX + W, dtype=torch.int32, device=dev)
    fill = lambda: ts.fill_rows(rows, qs, cu, idx, pos, seq_lens, R, R, T, has_trees=True)
    res["fill"] = timed(fill)
    res["fill/g"] = timed(graphed(fill))
    targets = draft_tokens.new_zeros(T)
    # the arguments TreeStates.walk passes (the kernel walks by parent: depths unread)
    walk = lambda: walk_rows_triton(targets, cu, idx, ts.walk_tokens, ts.parents,
                                    ts._depths, D, R)
    res["walk"] = timed(walk)
    res["walk/g"] = timed(graphed(walk))
    nblocks = R * ((PREFIX + W) // BS + 2)
    caches = [torch.zeros(nblocks, BS, HKV, 2 * HD, device=dev, dtype=torch.bfloat16)
              for _ in range(LAYERS)]
    comp = KVCompactor(caches)
    slots = torch.arange(T, device=dev) + PREFIX
    path = torch.arange(D + 1, device=dev).expand(R, D + 1).contiguous()
    nacc = torch.full((R,), D + 1, device=dev)
    li = torch.arange(T, device=dev)
    compact = lambda: comp(slots, li, cu, path, nacc, R)
    res["compact36"] = timed(compact)
    res["compact36/g"] = timed(graphed(compact))
    processed = torch.randn(T, V, device=dev)  # every walk stops at its root on NO_CHILD
    choices = torch.full((T,), NO_CHILD, dtype=torch.int64, device=dev)
    stopped = torch.zeros(R, W, dtype=torch.int64, device=dev)
    root = torch.ones(R, dtype=torch.int64, device=dev)

    def gumbel(rows, states, positions):
        return (rows - torch.empty_like(rows).exponential_().log()).argmax(dim=-1)

    for impl, stop in (("torch", draw_stop_tokens_torch), ("triton", draw_stop_tokens_triton)):
        res[f"stop/{impl}"] = timed(lambda stop=stop: stop(
            processed, choices, stopped, path, root, cu, idx, pos, ts.walk_tokens,
            ts.parents, gumbel))
    kv = caches[0]
    k_cache, v_cache = kv[..., :HD], kv[..., HD:]
    bt = torch.arange(nblocks, device=dev, dtype=torch.int32).view(R, -1)
    q = torch.randn(T, HQ, HD, device=dev, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    lse = torch.zeros(HQ, T, device=dev)
    prefix = torch.full((R,), PREFIX, dtype=torch.int32, device=dev)

    def attn():
        tree_attention_triton(q, k_cache, v_cache, bt, qs, prefix, rows.bits, None,
                              include_prefix=False, max_rows=W, out=out, prefix_out_lse=lse,
                              return_lse=False)

    one = timed(attn)
    res["attn1"] = one
    res["attn36"] = one * LAYERS
    # in vLLM the tree part runs inside the target's FULL CUDA graph: 36 launches replayed
    res["attn36/g"] = timed(graphed(lambda: [attn() for _ in range(LAYERS)]))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="step-parts")
    ap.add_argument("--requests", default="1,8,32")
    ap.add_argument("--budgets", default="15,64,256")
    ap.add_argument("--topk-prune", default="0", help="comma list of 0/1: the pruned top-k "
                    "(build_tree's topk_pruned); one row set per value")
    args = ap.parse_args()
    rows = []
    for pr in (int(x) for x in args.topk_prune.split(",")):
        mk = topk_lse_max_k(bool(pr))  # the variant's largest k; torch.topk above it
        for R in (int(x) for x in args.requests.split(",")):
            for B in (int(x) for x in args.budgets.split(",")):
                try:
                    r = case(R, B, topk_pruned=bool(pr))
                except Exception as e:  # e.g. a kernel variant that fails to compile:
                    # report it and keep the other rows of this run
                    print(f"prune={pr} maxk={mk} R={R} B={B} failed: {e!r}"[:2000],
                          flush=True)
                    continue
                rows.append(dict(prune=pr, maxk=mk, R=R, B=B, **r))
                print(json.dumps(rows[-1]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(rows, indent=1))
    if not rows:
        return 1
    keys = [k for k in rows[0] if k not in ("prune", "maxk", "R", "B")]
    print("\nprune maxK   R    B  " + "  ".join(f"{k:>11}" for k in keys) + "   (ms)")
    for r in rows:
        print(f"{r['prune']:>5} {r['maxk']:>4} {r['R']:>3} {r['B']:>4}  "
              + "  ".join(f"{r[k]:>11.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
