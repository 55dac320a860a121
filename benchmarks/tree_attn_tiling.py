"""Tree-attention tilings on one GPU: time per launch of each tiling of the Triton kernel.

    python3 -m benchmarks.tree_attn_tiling --out DIR [--batches 1,8,32] [--budgets 15,63]

Qwen3-8B's attention shape (32 query / 8 KV heads of 128, bf16, paged cache of block
16, 512 context tokens per request) in the mode a CUDA-graph tree step runs: tree keys
merged into a prefix result (``include_prefix=False`` with ``prefix_out_lse``), causal
ancestor bits.  Each tiling (query heads a program, rows a program, warps) is checked
against the default tiling's output, then timed as a CUDA graph of 36 launches (one per
layer) replayed 50 times: launch gaps count as they do in a served step.  Prints, per
batch and budget, the default tiling's µs per launch and the fastest one's; writes every
timing to ``DIR/tree_attn_tiling.json``.  No vLLM needed.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from benchmarks.core_gpu import graph_us
from vllm_ddtree.kernels.tree_attention import tree_attention_triton, tree_attn_tiling

HQ, HKV, HD, BS, PREFIX, LAYERS, REPLAYS = 32, 8, 128, 16, 512, 36, 50


def case(R: int, budget: int, dev: str = "cuda") -> dict:
    """Random inputs of one launch: R requests of ``budget + 1`` verify rows."""
    g = torch.Generator(device=dev).manual_seed(R * 1000 + budget)
    n = budget + 1
    blocks = (PREFIX + n + BS - 1) // BS
    cache = lambda: torch.randn(R * blocks, BS, HKV, HD, generator=g, device=dev,
                                dtype=torch.bfloat16)
    # causal ancestor bits: row i sees rows 0..i (the low i + 1 - 32 w bits of word w)
    low = [[min(32, max(0, i + 1 - 32 * w)) for w in range((n + 31) // 32)] for i in range(n)]
    words = [[((1 << k) - 1) - (2**32 if k == 32 else 0) for k in row] for row in low]
    bits = torch.tensor(words, dtype=torch.int32, device=dev).repeat(R, 1)  # [T, words]
    T = R * n
    return dict(
        q=torch.randn(T, HQ, HD, generator=g, device=dev, dtype=torch.bfloat16),
        k_cache=cache(), v_cache=cache(),
        block_table=torch.arange(R * blocks, device=dev, dtype=torch.int32).view(R, blocks),
        query_start=torch.arange(R + 1, device=dev, dtype=torch.int32) * n,
        prefix_lens=torch.full((R,), PREFIX, device=dev, dtype=torch.int32),
        ancestor_bits=bits,
        prefix_out=torch.randn(T, HQ, HD, generator=g, device=dev, dtype=torch.bfloat16),
        prefix_lse=torch.randn(HQ, T, generator=g, device=dev) + 5.0)


def launch(args: dict, budget: int, out: torch.Tensor, **tiling) -> None:
    tree_attention_triton(args["q"], args["k_cache"], args["v_cache"], args["block_table"],
                          args["query_start"], args["prefix_lens"], args["ancestor_bits"],
                          include_prefix=False, max_rows=budget + 1, out=out,
                          prefix_out_lse=args["prefix_lse"], return_lse=False, **tiling)


def time_us(args: dict, budget: int, **tiling) -> tuple[float, float]:
    """(µs per launch in a replayed graph of LAYERS launches, max |diff| to default)."""
    ref = args["prefix_out"].clone()
    launch(args, budget, ref)
    got = args["prefix_out"].clone()
    launch(args, budget, got, **tiling)
    err = (got.float() - ref.float()).abs().max().item()
    outs = [args["prefix_out"].clone() for _ in range(LAYERS)]
    us = graph_us(lambda: [launch(args, budget, o, **tiling) for o in outs], LAYERS, REPLAYS)
    return us, err


def tilings(budget: int):
    """Every (heads, block_m, num_warps) whose tile fits (<= 128 rows)."""
    for heads, block_m, warps in itertools.product((1, 2, 4), (2, 4, 8, 16, 32, 64), (2, 4, 8)):
        if block_m > budget + 1 or block_m * heads > 128 or block_m * heads < 8:
            continue
        yield dict(heads=heads, block_m=block_m, num_warps=warps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tree-attn-tiling")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--budgets", default="15,31,63")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, table = [], []
    for budget in [int(b) for b in args.budgets.split(",")]:
        for R in [int(b) for b in args.batches.split(",")]:
            inputs = case(R, budget)
            default = tree_attn_tiling(budget + 1, HQ // HKV, HD, False)
            t_def, _ = time_us(inputs, budget)
            best = (t_def, dict(heads=default.heads, block_m=default.block_m,
                                num_warps=default.num_warps))
            for tiling in tilings(budget):
                t, err = time_us(inputs, budget, **tiling)
                rows.append(dict(R=R, budget=budget, us=t, err=err, **tiling))
                print(json.dumps(rows[-1]), flush=True)
                if err > 0.05:
                    raise AssertionError(f"tiling {tiling} differs from the default by {err}")
                if t < best[0]:
                    best = (t, tiling)
            table.append((R, budget, default, t_def, best))
    (out / "tree_attn_tiling.json").write_text(json.dumps(rows, indent=1))
    print(f"\nµs per launch, graph of {LAYERS} launches; default = (heads, block_m, warps)")
    print("batch budget default            us    best               us    best/default")
    for R, budget, d, t_def, (t, b) in table:
        print(f"{R:>5} {budget:>6} ({d.heads}, {d.block_m:>2}, {d.num_warps}) {t_def:9.2f}   "
              f"({b['heads']}, {b['block_m']:>2}, {b['num_warps']}) {t:9.2f}   {t / t_def:.3f}")


if __name__ == "__main__":
    main()
