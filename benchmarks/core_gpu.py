"""GPU evidence for the tree core: exactness on the device and time per step.

Usage (one H200, no vLLM needed):  python3 -m benchmarks.core_gpu [--out DIR]

1. build_tree on CUDA equals build_tree on CPU (itself checked against the Python heap
   in CI) on random, peaked and tie-heavy logits; walk_tree likewise.
2. Median time (CUDA events) of build + walk + layout for R in {1, 8, 64}, D = 15,
   V = 151936, budgets {16, 64, 256, 1024}, eager and replayed as one CUDA graph.
3. The Triton tree-attention kernel against the torch reference (error and time).

``--conditioned`` instead: the tree with parent-conditioned children (a DSpark drafter's
Markov head, :func:`vllm_ddtree.tree.build_conditioned_tree`) on CUDA against the heap
oracle (ties included); its time at the SmolLM2 DSpark drafter's shape (D = 16,
V = 49152, bf16 factors) against the DFlash tree of the same budget, built in torch
(``build_conditioned_tree_torch``) and in Triton (``build_conditioned_tree_triton``);
and the Triton build's per-depth candidates under several launch settings
(:class:`~vllm_ddtree.kernels.conditioned_candidates.ConditionedTuning`).
``--conditioned --profile``: only the Triton build's device time by kernel.
``--conditioned --builds REPS``: only the Triton build's time, and digests of its trees'
nodes and of their scores (the same command on a copy of another version of the package
compares the two).
``--conditioned --depth-costs``: only one depth's candidates (both launches) with every
parent below the threshold (the chain's row alone), every parent above it, and without
the threshold; and the chunk kernel's registers and shared memory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
from collections.abc import Callable, Iterator

import torch

from vllm_ddtree.kernels.tree_attention import tree_attention_torch, tree_attention_triton
from vllm_ddtree.tree import build_tree, tree_layout, walk_tree
from vllm_ddtree.tree.build import build_tree_torch

STEP_MS_8B = 5.3  # Qwen3-8B-shaped decode step, batch 1, vLLM 0.26 on this H200


def _same_tree(a, b):
    return all(torch.equal(getattr(a, f).cpu(), getattr(b, f).cpu())
               for f in ("token_ids", "parents", "depths", "num_nodes"))


def check_exact():
    rows = []
    g = torch.Generator().manual_seed(0)
    for kind in ("normal", "peaked", "ties"):
        for (R, D, V, B) in [(8, 15, 151936, 256), (64, 15, 4096, 64), (4, 15, 32000, 1024)]:
            if kind == "ties":
                x = torch.randint(0, 4, (R, D, V), generator=g).float()
            else:
                x = torch.randn(R, D, V, generator=g)
                if kind == "peaked":
                    x.scatter_(2, torch.randint(0, V, (R, D, 1), generator=g), 15.0)
            x_bf = x.bfloat16().float()  # realistic precision (many exact ties)
            cpu = build_tree(x_bf, B)
            gpu = build_tree(x_bf.cuda(), B)
            ok = _same_tree(cpu, gpu)
            tgt = torch.randint(0, V, (R, B + 1), generator=g)
            tgt[:, 0] = cpu.token_ids[:, 0]
            w_cpu = walk_tree(cpu, tgt)
            w_gpu = walk_tree(gpu, tgt.cuda())
            ok_w = all(torch.equal(a, b.cpu()) for a, b in zip(w_cpu, w_gpu))
            from vllm_ddtree.tree.build import depth_candidates
            lp_c, tok_c = depth_candidates(x_bf, min(B, V))
            lp_g, tok_g = depth_candidates(x_bf.cuda(), min(B, V))
            ok_c = torch.equal(tok_c, tok_g.cpu()) and torch.allclose(lp_c, lp_g.cpu(), atol=1e-5)
            rows.append((kind, R, D, V, B, ok_c, ok, ok_w))
    return rows


def median_ms(fn: Callable[[], object], iters: int = 30) -> float:
    """Median milliseconds of ``iters`` calls of ``fn`` (CUDA events, after 3 warm-ups)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def graph_us(calls: Callable[[], object], n_calls: int, replays: int) -> float:
    """µs per call of ``calls`` (which makes ``n_calls`` calls: launch gaps count as in a
    served step's graph), run once, captured as one CUDA graph and replayed ``replays``
    times between two CUDA events."""
    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * n_calls)


def _graph_ms(step: Callable[[], object]) -> float:
    """Median ms of ``step`` replayed as one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return median_ms(graph.replay)


def time_core(dtype):
    rows = []
    V, D = 151936, 15
    for R in (1, 8, 64):
        logits = torch.randn(R, D, V, device="cuda").to(dtype)
        root = torch.arange(R, device="cuda") * 100
        for B in (16, 64, 256, 1024):
            tgt = torch.randint(0, V, (R, B + 1), device="cuda")
            res = []
            for build in (build_tree_torch, build_tree):  # the torch selection, the pick
                def step():
                    tree = build(logits, B)
                    acc, num, bonus = walk_tree(tree, tgt)
                    lay = tree_layout(tree, root)
                    return tree, acc, lay

                # eager, then the whole step as one CUDA graph (as inside vLLM's
                # captured decode step)
                res += [median_ms(step), _graph_ms(step)]
            # candidates only (log-softmax + per-depth top-k): the part left outside Triton
            from vllm_ddtree.tree.build import depth_candidates
            cand = median_ms(lambda: depth_candidates(logits, min(B, V)))
            rows.append((str(dtype).replace("torch.", ""), R, B, *res, cand,
                         100 * min(res[1], res[3]) / STEP_MS_8B))
    return rows


def check_attention():
    rows = []
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for hd in (64, 128):
            R, Hq, Hkv, B, bs = 8, 32, 8, 64, 16
            n = B + 1
            prefix = torch.randint(512, 1024, (R,), generator=g)
            nb = (1024 + n + bs - 1) // bs
            bt = torch.randperm(R * nb + 5, generator=g)[: R * nb].view(R, nb).int()
            kc = torch.randn(R * nb + 5, bs, Hkv, hd, generator=g).to(dtype)
            vc = torch.randn(R * nb + 5, bs, Hkv, hd, generator=g).to(dtype)
            q = torch.randn(R * n, Hq, hd, generator=g).to(dtype)
            tree = build_tree(torch.randn(R, 15, 1000, generator=g), B)
            anc = tree_layout(tree, torch.zeros(R, dtype=torch.long)).ancestor_bits
            args = dict(q=q, k_cache=kc, v_cache=vc, block_table=bt,
                        query_start=(torch.arange(R + 1) * n).int(),
                        prefix_lens=prefix.int(), ancestor_bits=anc.reshape(R * n, -1))
            args = {k: v.cuda() for k, v in args.items()}
            ref, ref_lse = tree_attention_torch(**args)
            out, lse = tree_attention_triton(**args, max_rows=n)
            err = (out.float() - ref.float()).abs().max().item()
            lerr = (lse - ref_lse).abs().max().item()
            t_tri = median_ms(lambda: tree_attention_triton(**args, max_rows=n))
            t_ref = median_ms(lambda: tree_attention_torch(**args), iters=5)
            rows.append((str(dtype).replace("torch.", ""), hd, err, lerr, t_tri, t_ref))
    return rows


def check_conditioned() -> list[tuple]:
    """CUDA build against the heap oracle: half-integer inputs, so every bias is exact
    whatever the summation order (``spread`` 1: ties everywhere; ``peak``: one token per
    depth at that logit, for deep trees)."""
    from vllm_ddtree.tree.conditioned import (
        MarkovHead,
        build_conditioned_tree_torch,
        build_conditioned_tree_triton,
    )
    from vllm_ddtree.tree.reference import build_conditioned_tree_heap

    rows = []
    for seed, (R, D, V, B, spread, peak) in enumerate([
            (3, 5, 3000, 15, 1, 0), (3, 6, 3000, 31, 8, 0), (2, 4, 40, 63, 1, 0),
            (2, 4, 3000, 80, 1, 0), (4, 16, 49152, 15, 8, 0), (8, 16, 49152, 15, 4, 12),
            (8, 16, 3000, 63, 4, 10)]):
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(-spread, spread + 1, (R, D, V), generator=g).float() / 2
        if peak:  # one likely token per depth: deep trees
            base.scatter_(2, torch.randint(0, V, (R, D, 1), generator=g), float(peak))
        w1, w2 = (torch.randint(-2, 3, (V, 4), generator=g).float() / 2 for _ in range(2))
        roots = torch.randint(0, V, (R,), generator=g)
        head = MarkovHead(w1.cuda(), w2.cuda())
        oks = []
        for build in (build_conditioned_tree_torch, build_conditioned_tree_triton):
            tree = build(base.cuda(), roots.cuda(), head, B)
            ok = True
            for r in range(R):
                want = build_conditioned_tree_heap(base[r], int(roots[r]), w1, w2, B)
                n = int(tree.num_nodes[r])
                got = list(zip(tree.token_ids[r, :n].tolist(), tree.parents[r, :n].tolist(),
                               tree.depths[r, :n].tolist()))
                ok &= got == want
            oks.append(ok)
        rows.append((R, D, V, B, spread, peak, *oks))
    return rows


def conditioned_base(R: int, D: int, V: int, peaked: bool) -> torch.Tensor:
    """[R, D, V] bf16 base logits on the GPU: ``2 * randn``, flat over the vocabulary
    (best-first trees of depth 1-2: nothing deeper can beat the first depth's nodes);
    ``peaked``: plus one token per depth at a logit drawn from U(10, 18), a trained
    drafter's confident drafts, whose trees go deep (their live parents per depth are a
    little more than the shipped SmolLM2 DSpark drafter's: docs/benchmarks/core-gpu.md)."""
    base = 2 * torch.randn(R, D, V, device="cuda")
    if peaked:
        hot = torch.randint(0, V, (R, D, 1), device="cuda")
        base.scatter_(2, hot, 10 + 8 * torch.rand(R, D, 1, device="cuda"))
    return base.bfloat16()


def _conditioned_cases() -> Iterator[tuple]:
    """The timed conditioned builds' inputs, seeded (one seed per Markov rank, so a run
    before and after a change builds the same trees): ``(logits, rank, R, base, roots,
    head)`` at the SmolLM2 DSpark drafter's shape (D = 16, V = 49152), flat and peaked
    logits (:func:`conditioned_base`), 1 / 8 / 32 requests."""
    from vllm_ddtree.tree.conditioned import MarkovHead

    D, V = 16, 49152
    for logits, rank in (("peaked", 16), ("flat", 16), ("flat", 64)):
        torch.manual_seed(rank)
        head = MarkovHead((torch.randn(V, rank, device="cuda") / rank ** 0.5).bfloat16(),
                          torch.randn(V, rank, device="cuda").bfloat16())
        for R in (1, 8, 32):
            base = conditioned_base(R, D, V, logits == "peaked")
            roots = torch.randint(0, V, (R,), device="cuda")
            yield logits, rank, R, base, roots, head


def time_conditioned() -> list[tuple]:
    """ms per build in a CUDA graph, budget 15: the DFlash tree, the conditioned tree in
    torch (each depth's sum inside the top-k kernels, torch selection) and in Triton
    (each depth's candidates straight from the Markov factors, Triton selection), over
    :func:`_conditioned_cases`; and whether the two conditioned trees agree (bf16
    factors: the torch side sums them in another order, so a near-tie may rank
    differently)."""
    from vllm_ddtree.tree.conditioned import (
        build_conditioned_tree_torch,
        build_conditioned_tree_triton,
    )

    rows, B = [], 15
    for logits, rank, R, base, roots, head in _conditioned_cases():
        dflash = _graph_ms(lambda: build_tree(base, B, inplace=True))
        ref = _graph_ms(lambda: build_conditioned_tree_torch(base, roots, head, B))
        fused = _graph_ms(lambda: build_conditioned_tree_triton(base, roots, head, B))
        a = build_conditioned_tree_torch(base, roots, head, B)
        b = build_conditioned_tree_triton(base, roots, head, B)
        same = sum(torch.equal(a.token_ids[r], b.token_ids[r]) for r in range(R))
        depth = float(a.depths.max(dim=1).values.float().mean())
        rows.append((logits, rank, R, round(depth, 1), dflash, ref, fused, f"{same}/{R}"))
    return rows


def time_triton_builds(reps: int) -> list[tuple]:
    """The Triton build alone over :func:`_conditioned_cases`, budget 15: median ms of
    ``reps`` CUDA-graph timings (each itself a median of replays), the trees' depth and
    digests of the trees' nodes (every field but the scores) and of their scores (a
    build that chunks the vocabulary otherwise may round a log-sum-exp, and so the
    scores, differently: equal node digests are equal trees)."""
    from vllm_ddtree.tree.conditioned import build_conditioned_tree_triton

    rows, B = [], 15
    for logits, rank, R, base, roots, head in _conditioned_cases():
        ms = statistics.median(
            _graph_ms(lambda: build_conditioned_tree_triton(base, roots, head, B))
            for _ in range(reps))
        tree = build_conditioned_tree_triton(base, roots, head, B)
        nodes, scores = hashlib.sha256(), hashlib.sha256()
        for field in (tree.token_ids, tree.parents, tree.depths, tree.num_nodes, tree.top1,
                      tree.nonfinite):
            nodes.update(field.cpu().numpy().tobytes())
        scores.update(tree.scores.cpu().numpy().tobytes())
        depth = float(tree.depths.max(dim=1).values.float().mean())
        rows.append((logits, rank, R, round(depth, 1), ms, nodes.hexdigest()[:12],
                     scores.hexdigest()[:12]))
    return rows


ONE_DEPTH_V, ONE_DEPTH_RANK, ONE_DEPTH_K = 49152, 16, 15  # the SmolLM2 DSpark shape


def _one_depth_factors(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """The one-depth benchmarks' Markov factors ``w1``, ``w2`` (bf16) and each of the 16
    parents' need (a budget-15 tree), drawn from ``g``."""
    from vllm_ddtree.tree.conditioned import parent_needs

    V, rank, K = ONE_DEPTH_V, ONE_DEPTH_RANK, ONE_DEPTH_K
    w1 = (torch.randn(V, rank, device="cuda", generator=g) / rank ** 0.5).bfloat16()
    w2 = torch.randn(V, rank, device="cuda", generator=g).bfloat16()
    return w1, w2, torch.tensor(parent_needs(K, K, K), device="cuda")


def _one_depth_requests(g: torch.Generator, R: int) -> tuple[torch.Tensor, ...]:
    """``R`` requests' base logits (bf16), their 16 parents and the bound's tokens (the
    best base tokens), drawn from ``g``."""
    from vllm_ddtree.kernels.conditioned_candidates import BOUND_TOKENS

    V, K = ONE_DEPTH_V, ONE_DEPTH_K
    base = (2 * torch.randn(R, V, device="cuda", generator=g)).bfloat16()
    parents = torch.randint(0, V, (R, K + 1), device="cuda", generator=g)
    top_ids = torch.topk(base.float(), BOUND_TOKENS, dim=1).indices.contiguous()
    return base, parents, top_ids


def sweep_conditioned() -> list[tuple]:
    """µs per depth's candidates (:func:`~vllm_ddtree.kernels.conditioned_candidates.
    conditioned_candidates_triton`, both launches, replayed in a CUDA graph) at the SmolLM2
    DSpark shape (16 parents of a budget-15 tree, K = 15, V = 49152, rank 16, bf16) for
    several launch settings; and whether each gives the default's candidates."""
    from vllm_ddtree.kernels.conditioned_candidates import (
        ConditionedTuning,
        conditioned_candidates_triton,
    )

    K = ONE_DEPTH_K
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w2, need = _one_depth_factors(g)
    settings = [None] + [ConditionedTuning(tile, warps, group, bsort, True)
                         for tile, warps, group, bsort in [
                             (8192, 8, 1, False), (8192, 8, 1, True), (8192, 8, 4, True),
                             (8192, 8, 8, True), (4096, 4, 1, True), (4096, 4, 8, True),
                             (4096, 8, 1, True), (16384, 8, 4, True)]]
    rows = []
    for R in (1, 8, 32):
        base, parents, top_ids = _one_depth_requests(g, R)
        want = None
        for tuning in settings:
            def call(tuning=tuning):
                return conditioned_candidates_triton(base, parents, need, top_ids, w1, w2,
                                                     1.0, K, tuning)
            try:
                got = call()[1]
                us = graph_us(call, 1, 200)
            except Exception as e:  # a setting this GPU cannot launch (registers)
                rows.append((R, str(tuning), f"failed: {type(e).__name__}", ""))
                continue
            want = got if want is None else want
            same = all(torch.equal(got[:, p, :n], want[:, p, :n])
                       for p, n in enumerate(need.tolist()))
            rows.append((R, "default" if tuning is None else
                         f"tile {tuning.tile}, {tuning.warps} warps, group {tuning.group}, "
                         f"bound {'sort' if tuning.bound_sort else 'reductions'}",
                         round(us, 1), same))
    return rows


def profile_conditioned() -> list[tuple]:
    """Device µs per build of each kernel of the Triton conditioned build (torch profiler,
    eager builds, so launch gaps are not counted) at rank 16, 1 and 32 requests, peaked
    logits, shape as :func:`time_conditioned`: where the build's GPU time goes."""
    from torch.profiler import ProfilerActivity, profile

    from vllm_ddtree.tree.conditioned import MarkovHead, build_conditioned_tree_triton

    D, V, B, rank, builds = 16, 49152, 15, 16, 10
    head = MarkovHead((torch.randn(V, rank, device="cuda") / rank ** 0.5).bfloat16(),
                      torch.randn(V, rank, device="cuda").bfloat16())
    rows = []
    for R in (1, 32):
        base = conditioned_base(R, D, V, peaked=True)
        roots = torch.randint(0, V, (R,), device="cuda")
        build_conditioned_tree_triton(base, roots, head, B)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(builds):
                build_conditioned_tree_triton(base, roots, head, B)
            torch.cuda.synchronize()
        per_kernel = [(e.key, e.self_device_time_total / builds, e.count / builds)
                      for e in prof.key_averages() if e.self_device_time_total > 0]
        for name, us, n in sorted(per_kernel, key=lambda t: -t[1]):
            rows.append((R, name[:48], round(us, 1), round(n, 1)))
    return rows


def depth_costs() -> tuple[list[tuple], list[tuple]]:
    """µs of one depth's candidates (:func:`~vllm_ddtree.kernels.conditioned_candidates.
    conditioned_candidates_triton`, replayed in a CUDA graph, and each launch's device
    time by the torch profiler) at the SmolLM2 DSpark shape (16 parents of a budget-15
    tree, V = 49152, rank 16, bf16) for 1, 8 and 32 requests: every kept parent below
    its request's threshold (``dead``: the chain's row alone, a depth past the tree),
    every one above it (``live``), no threshold (``all``, the first two depths); and the
    chunk kernel's compiled registers per thread and shared memory."""
    from torch.profiler import ProfilerActivity, profile

    from vllm_ddtree.kernels import conditioned_candidates as cc

    K = ONE_DEPTH_K
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w2, need = _one_depth_factors(g)
    rows = []
    for R in (1, 8, 32):
        base, parents, top_ids = _one_depth_requests(g, R)
        scores = torch.randn(R, K, device="cuda", generator=g).sort(dim=1, descending=True)
        for parents_kind, theta in (("dead", float("inf")), ("live", float("-inf")),
                                    ("all", None)):
            pruned = {} if theta is None else dict(
                parent_scores=scores.values.contiguous(),
                theta=torch.full((R,), theta, device="cuda"))

            def call(pruned=pruned):
                return cc.conditioned_candidates_triton(base, parents, need, top_ids, w1,
                                                        w2, 1.0, K, **pruned)
            us = graph_us(call, 1, 200)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    call()
                torch.cuda.synchronize()
            by_kernel = {e.key: e.self_device_time_total / 10 for e in prof.key_averages()
                         if e.self_device_time_total > 0}
            chunk = sum(t for k, t in by_kernel.items() if "chunk" in k)
            merge = sum(t for k, t in by_kernel.items() if "merge" in k)
            rows.append((R, parents_kind, round(us, 1), round(chunk, 1), round(merge, 1)))
    compiled = []  # from Triton's JIT cache (Triton 3.x internals: best effort)
    for entry in getattr(cc._conditioned_chunk_kernel, "device_caches", {}).values():
        for kernel in (entry[0] if isinstance(entry, tuple) else entry).values():
            getattr(kernel, "_init_handles", lambda: None)()  # fills n_regs, n_spills
            compiled.append((kernel.metadata.num_warps, kernel.n_regs, kernel.n_spills,
                             kernel.metadata.shared))
    return rows, sorted(set(compiled))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--conditioned", action="store_true",
                    help="only the tree with parent-conditioned children")
    ap.add_argument("--profile", action="store_true",
                    help="with --conditioned: only the Triton build's GPU time by kernel")
    ap.add_argument("--no-sweep", action="store_true",
                    help="with --conditioned: without the launch-settings sweep")
    ap.add_argument("--builds", type=int, default=0, metavar="REPS",
                    help="with --conditioned: only the Triton build, median of REPS "
                         "timings, and a digest of its trees")
    ap.add_argument("--depth-costs", action="store_true",
                    help="with --conditioned: only one depth's candidates, dead and live "
                         "parents")
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    import triton
    print(f"device: {dev}; torch {torch.__version__}; Triton {triton.__version__}")
    if args.conditioned and args.depth_costs:
        rows, compiled = depth_costs()
        print("µs per depth's candidates, 16 parents, V = 49152, rank 16, bf16")
        print("| R | parents | CUDA graph | chunk kernel (device) | merge kernel (device) |"
              "\n|---|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(str(x) for x in row) + " |")
        print("\nchunk kernel, as compiled: (warps, registers per thread, spills, shared "
              "memory bytes)")
        for c in compiled:
            print(c)
        return
    if args.conditioned and args.builds:
        print("ms per Triton build, one CUDA graph; D = 16, V = 49152, budget 15")
        print("| logits | rank | R | tree depth | ms | nodes (digest) | scores (digest) |\n"
              "|---|---|---|---|---|---|---|")
        for logits, rank, R, depth, ms, nodes, scores in time_triton_builds(args.builds):
            print(f"| {logits} | {rank} | {R} | {depth} | {ms:.3f} | {nodes} | {scores} |")
        return
    if args.conditioned and args.profile:
        print("| R | kernel | device µs per build | launches per build |\n|---|---|---|---|")
        for row in profile_conditioned():
            print("| " + " | ".join(str(x) for x in row) + " |")
        return
    if args.conditioned:
        exact, timing = check_conditioned(), time_conditioned()
        sweep = [] if args.no_sweep else sweep_conditioned()
        with open(os.path.join(args.out, "core_gpu_conditioned.json"), "w") as f:
            json.dump(dict(device=dev, torch=torch.__version__, exact=exact, timing=timing,
                           sweep=sweep), f, indent=1)
        print("| R | D | V | budget | spread | peak | equals the heap oracle: torch | "
              "triton |\n|---|---|---|---|---|---|---|---|")
        for r in exact:
            print("| " + " | ".join(str(x) for x in r) + " |")
        print("\nms per build, one CUDA graph; D = 16, V = 49152, budget 15")
        print("| logits | rank | R | tree depth | DFlash tree | conditioned, torch | "
              "conditioned, Triton | same trees |\n|---|---|---|---|---|---|---|---|")
        for logits, rank, R, depth, a, b, c, same in timing:
            print(f"| {logits} | {rank} | {R} | {depth} | {a:.3f} | {b:.3f} | {c:.3f} "
                  f"| {same} |")
        if sweep:
            print("\nµs per depth's candidates (two launches, CUDA graph), rank 16, 16 "
                  "parents")
            print("| R | settings | µs | default's candidates |\n|---|---|---|---|")
            for row in sweep:
                print("| " + " | ".join(str(x) for x in row) + " |")
        return
    exact = check_exact()
    timing = time_core(torch.bfloat16) + time_core(torch.float32)
    attn = check_attention()
    with open(os.path.join(args.out, "core_gpu.json"), "w") as f:
        json.dump(dict(device=dev, torch=torch.__version__, exact=exact, timing=timing,
                       attention=attn), f, indent=1)
    print("\n## exactness: CUDA vs CPU (CPU = heap-verified)")
    print("| logits | R | D | V | budget | candidates equal | build equal | walk equal |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in exact:
        print("| " + " | ".join(str(x) for x in r) + " |")
    print("\n## build + walk + layout per step (median ms, CUDA events), D=15, V=151936")
    print("| logits dtype | R | budget | torch eager | torch graph | auto eager | auto graph "
          "| candidates only | best graph / 5.3 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d, R, B, e1, g1, e2, g2, c, pct in timing:
        print(f"| {d} | {R} | {B} | {e1:.3f} | {g1:.3f} | {e2:.3f} | {g2:.3f} | {c:.3f} "
              f"| {pct:.1f}% |")
    print("\n## tree attention: Triton vs torch reference (R=8, 32/8 heads, B=64, prefix 512-1024)")
    print("| dtype | head_dim | max abs err out | max abs err lse | Triton ms | torch ms |")
    print("|---|---|---|---|---|---|")
    for d, hd, e, le, tt, tr in attn:
        print(f"| {d} | {hd} | {e:.2e} | {le:.2e} | {tt:.3f} | {tr:.3f} |")


if __name__ == "__main__":
    main()
