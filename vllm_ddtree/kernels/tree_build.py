"""Triton kernel for the tree build: one program per request does every depth.

Same algorithm, pair tables and packed keys (:mod:`.build_tables`) as the torch tree
build it is tested against (:func:`~vllm_ddtree.tree.build.build_tree_torch`; the tree
build's Triton side :func:`~vllm_ddtree.tree.build.build_tree_triton` launches
:func:`tree_build_triton`): per depth, the ``~B ln B``
candidate (parent, rank) pairs are scored, packed into int64 keys and sorted in registers
(``tl.sort``); the global top-``B`` is one more sort over the ``D`` per-depth sets.
Replaces a few hundred small torch kernels with one launch.  Used for widths whose sorts
fit one program.

:func:`select_children_triton` is one depth of the same selection for trees whose
children are conditioned on their parent (:mod:`vllm_ddtree.tree.conditioned`): there
each depth's candidates depend on the previous depth's nodes, so the build takes one
launch per depth instead of one per tree, each keeping its depth's set, and
:func:`conditioned_assemble_triton` the tree kernel's last stage (the global top-``B``,
``_assemble``) over those sets
(:func:`~vllm_ddtree.tree.conditioned.build_conditioned_tree_triton`; reference:
:func:`~vllm_ddtree.tree.conditioned.build_conditioned_tree_torch`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_ddtree.kernels.build_tables import (
    cached_int64_tensor,
    pair_layout,
    pair_tensors,
)
from vllm_ddtree.kernels.triton_utils import HAS_TRITON, next_pow2, tl, triton

if HAS_TRITON:
    from vllm_ddtree.kernels.build_tables import key_score, pack_key

MAX_SORT = 4096  # largest in-register sort per program


if HAS_TRITON:

    @triton.jit
    def _assemble(
        keys, S, NSET, node_map, tok, TS, budget,
        OUT_TOK, OUT_PAR, OUT_DEP, OUT_SCORE, r,
        D: tl.constexpr, K: tl.constexpr, W: tl.constexpr, PB: tl.constexpr,
        DB: tl.constexpr, BY_POS: tl.constexpr,
    ):
        """One request's tree from its per-depth sets: the global top-``W`` of the
        first ``NSET[d]`` keys of each depth ``d`` (``keys + d * S``, best first, tie
        code ``parent position * K + token rank``), written as node tokens, parents,
        depths and scores (``W`` slots, the first ``budget`` live).  A node's token is
        ``tok[d * TS + position]`` (``BY_POS``) or ``tok[d * TS + rank]``.
        ``node_map``: ``[D, PB]`` scratch."""
        g = tl.arange(0, DB)
        gd = g // PB
        gp = g % PB
        gok = (gd < D) & (gp < tl.load(NSET + gd, mask=gd < D, other=0))
        gk = tl.load(keys + gd * S + gp, mask=gok, other=-9223372036854775807 - 1)
        live = gok & (gk != -9223372036854775807 - 1)
        gk = (gk & -4294967296) | (4294967295 - (gd * PB + gp).to(tl.int64))
        gk = tl.where(live, gk, -9223372036854775807 - 1)
        gk = tl.sort(gk, descending=True)
        code = 4294967295 - (gk & 4294967295)
        sel = g < W
        valid = sel & (gk != -9223372036854775807 - 1)
        nd = tl.where(valid, code // PB, 0)
        npos = tl.where(valid, code % PB, 0)
        nkey = tl.load(keys + nd * S + npos, mask=valid, other=0)
        tie = 4294967295 - (nkey & 4294967295)
        ppos = tie // K
        tl.store(node_map + nd * PB + npos, g, mask=valid)
        tl.debug_barrier()
        pnode = tl.load(node_map + (nd - 1) * PB + ppos, mask=valid & (nd > 0), other=-1)
        parent = tl.where(nd > 0, pnode + 1, 0)
        if BY_POS:
            token = tl.load(tok + nd * TS + npos, mask=valid, other=-1)
        else:
            token = tl.load(tok + nd * TS + tie % K, mask=valid, other=-1)
        keep = valid & (g < budget)
        out = r * W + g
        tl.store(OUT_TOK + out, tl.where(keep, token, -1), mask=sel)
        tl.store(OUT_PAR + out, tl.where(keep, parent, -1), mask=sel)
        tl.store(OUT_DEP + out, tl.where(keep, nd + 1, 0), mask=sel)
        tl.store(OUT_SCORE + out, tl.where(keep, key_score(nkey), float("-inf")), mask=sel)

    @triton.jit
    def _tree_build_kernel(
        LP, TOK, PI, PR, NP, NSET, KEYS, MAP, BUDGET,
        OUT_TOK, OUT_PAR, OUT_DEP, OUT_SCORE,
        D: tl.constexpr, K: tl.constexpr, W: tl.constexpr, P2: tl.constexpr,
        S: tl.constexpr, PB: tl.constexpr, DB: tl.constexpr,
    ):
        r = tl.program_id(0)
        lp = LP + r * D * K
        keys = KEYS + r * D * S
        # depth 1: ranks 0..K-1 are already in key order
        o = tl.arange(0, S)
        n1 = tl.minimum(W, K)
        v = tl.load(lp + o, mask=o < n1, other=0.0)
        k1 = tl.where(o < n1, pack_key(v, o.to(tl.int64)), -9223372036854775807 - 1)
        tl.store(keys + o, k1)
        tl.debug_barrier()
        po = tl.arange(0, P2)
        for d in range(1, D):
            npair = tl.load(NP + d)
            ok = po < npair
            pi = tl.load(PI + po, mask=ok, other=0)
            pr = tl.load(PR + po, mask=ok, other=0)
            pkey = tl.load(keys + (d - 1) * S + pi, mask=ok, other=0)
            val = tl.load(lp + d * K + pr, mask=ok, other=0.0)
            cand = key_score(pkey) + val
            key = pack_key(cand, pi.to(tl.int64) * K + pr)
            key = tl.where(ok, key, -9223372036854775807 - 1)
            key = tl.sort(key, descending=True)
            tl.store(keys + d * S + po, key, mask=po < S)
            tl.debug_barrier()
        _assemble(keys, S, NSET, MAP + r * D * PB, TOK + r * D * K, K, tl.load(BUDGET + r),
                  OUT_TOK, OUT_PAR, OUT_DEP, OUT_SCORE, r, D, K, W, PB, DB, False)

    @triton.jit
    def _select_children_kernel(
        PREV, LP, TOK, BAD, D2T, PI, PR,
        OUT_SCORE, PARENTS, KEYS, NTOK, TOP1, NFD, BEST, THETA,
        npair, n, s_prev, width, v_draft, d, D, K: tl.constexpr, WN: tl.constexpr,
        P2: tl.constexpr, PB: tl.constexpr, WB: tl.constexpr, NB: tl.constexpr,
        HAS_MAP: tl.constexpr, FIRST: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        po = tl.arange(0, P2)
        ok = po < npair
        pi = tl.load(PI + po, mask=ok, other=0).to(tl.int64)
        pr = tl.load(PR + po, mask=ok, other=0).to(tl.int64)
        lp = LP + r * (n + 1) * K  # [n + 1, K] this request's candidates
        tok = TOK + r * (n + 1) * K
        prev = tl.load(PREV + r * s_prev + pi, mask=ok, other=0.0)
        val = tl.load(lp + pi * K + pr, mask=ok, other=0.0)
        key = tl.where(ok, pack_key(prev + val, pi * K + pr), -9223372036854775807 - 1)
        key = tl.sort(key, descending=True)
        sel = po < WN
        code = 4294967295 - (key & 4294967295)  # parent position * K + rank
        t = tl.load(tok + code, mask=sel, other=0)
        # a child slot its parent did not fill (no id: a pruned parent, or fewer finite
        # logits than children) holds no token; such a node scores -inf
        t = tl.where((t >= 0) & (t < v_draft), t, 0)
        c = tl.load(tok + n * K)  # the chain's parent (column n): its best child
        if HAS_MAP:
            t = tl.load(D2T + t, mask=sel, other=0)
            c = tl.load(D2T + c)
        tl.store(OUT_SCORE + r * WN + po, key_score(key), mask=sel)
        tl.store(PARENTS + r * (WN + 1) + po, t, mask=sel)
        tl.store(PARENTS + r * (WN + 1) + WN, c)
        # the depth's set for the assembly (conditioned_assemble_triton)
        tl.store(KEYS + (r * D + d) * PB + po, key, mask=sel)
        tl.store(NTOK + (r * D + d) * PB + po, t, mask=sel)
        tl.store(TOP1 + r * D + d, c)
        j = tl.arange(0, NB)
        bad = tl.load(BAD + r * (n + 1) + j, mask=j < n + 1, other=0)
        tl.store(NFD + r * D + d, tl.max(bad, 0))
        # the best `width` scores of the nodes so far (depth 1's, PREV, the first time)
        # and THETA, the (width - 1)-th of them: a descendant of a node is beaten by that
        # node (a score no higher, a greater depth), so only nodes among the best
        # width - 1 so far can have descendants in the tree, and none scores below THETA
        tl.debug_barrier()
        i = tl.arange(0, 2 * WB)
        if FIRST:
            old = tl.load(PREV + r * s_prev + i, mask=i < n, other=float("-inf"))
        else:
            old = tl.load(BEST + r * WB + i, mask=i < WB, other=float("-inf"))
        new = tl.load(OUT_SCORE + r * WN + (i - WB), mask=(i >= WB) & (i < WB + WN),
                      other=float("-inf"))
        both = tl.where(i < WB, old, new)
        both = tl.sort(tl.where(both != both, float("-inf"), both), descending=True)
        tl.store(BEST + r * WB + i, both, mask=i < WB)
        theta = tl.max(tl.where(i == width - 2, both, float("-inf")), 0)
        tl.store(THETA + r, tl.where(width > 1, theta, float("inf")))

    @triton.jit
    def _conditioned_assemble_kernel(
        LP0, TOK0, BAD0, NSET, KEYS, NTOK, TOP1, NFD, MAP,
        OUT_TOK, OUT_PAR, OUT_DEP, OUT_SCORE, NUM, NONFINITE,
        n_out, D: tl.constexpr, K: tl.constexpr, W: tl.constexpr,
        PB: tl.constexpr, DB: tl.constexpr, DP: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        keys = KEYS + r * D * PB
        ntok = NTOK + r * D * PB
        # depth 1: the root's K best children, ranks already in key order
        o = tl.arange(0, PB)
        ok = o < tl.minimum(W, K)
        v = tl.load(LP0 + r * K + o, mask=ok, other=0.0)
        tl.store(keys + o, pack_key(v, o.to(tl.int64)), mask=ok)
        tl.store(ntok + o, tl.load(TOK0 + r * K + o, mask=ok, other=0), mask=ok)
        tl.store(TOP1 + r * D, tl.load(TOK0 + r * K))  # the chain: the best child
        dd = tl.arange(0, DP)
        bad = tl.load(NFD + r * D + dd, mask=(dd > 0) & (dd < D), other=0).to(tl.int32)
        bad = tl.maximum(tl.max(bad, 0), tl.load(BAD0 + r).to(tl.int32))
        tl.store(NONFINITE + r, bad.to(tl.int8))
        tl.store(NUM + r, n_out)
        tl.debug_barrier()
        _assemble(keys, PB, NSET, MAP + r * D * PB, ntok, PB, n_out,
                  OUT_TOK, OUT_PAR, OUT_DEP, OUT_SCORE, r, D, K, W, PB, DB, True)


class ConditionedSelection(NamedTuple):
    """What the conditioned build's per-depth selections (:func:`select_children_triton`)
    keep for its assembly (:func:`conditioned_assemble_triton`), and the pruning state
    they carry from depth to depth."""

    keys: torch.Tensor  # [R, D, PB] int64 each depth's set as packed keys, best first
    tokens: torch.Tensor  # [R, D, PB] int64 their tokens (target ids)
    top1: torch.Tensor  # [R, D] int64 the drafter's chain
    nonfinite: torch.Tensor  # [R, D] int8 a depth's computed logits held NaN/inf
    best: torch.Tensor  # [R, next_pow2(width)] float32 the best scores so far
    theta: torch.Tensor  # [R] float32 the (width - 1)-th of them: the next threshold

    @classmethod
    def empty(cls, num_reqs: int, max_depth: int, width: int,
              device: torch.device) -> ConditionedSelection:
        """Uninitialised tables (every entry read is written first)."""
        pb = next_pow2(width)

        def table(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

        return cls(table(num_reqs, max_depth, pb), table(num_reqs, max_depth, pb),
                   table(num_reqs, max_depth), table(num_reqs, max_depth, dtype=torch.int8),
                   table(num_reqs, pb, dtype=torch.float32),
                   table(num_reqs, dtype=torch.float32))


def select_children_supported(max_depth: int, k: int, width: int) -> bool:
    """Whether Triton is there and every depth's pair sort fits one program."""
    return (HAS_TRITON and width > 0
            and next_pow2(max(pair_layout(max_depth, k, width)[2])) <= MAX_SORT)


def select_children_triton(
    prev_scores: torch.Tensor,  # [R, n] float32 scores of depth d - 1's nodes, best first
    logprobs: torch.Tensor,  # [R, n + 1, K] float32 each parent's candidates (column n:
    token_ids: torch.Tensor,  # [R, n + 1, K] int64   the chain's parent), draft ids
    nonfinite: torch.Tensor,  # [R, n + 1] bool       and their logits' flags
    pair_pos: torch.Tensor,  # [P] int32 the pair table's parent positions ...
    pair_rank: torch.Tensor,  # [P] int32 ... and token ranks (pair_tensors)
    num_pairs: int,  # pairs whose parent lies inside depth d - 1's set
    width: int,
    depth: int,  # d (0-based, >= 1)
    state: ConditionedSelection,  # written: the depth's set, chain token and flag, and
    # the best scores so far and the threshold (depth 2 starts them from prev_scores)
    v_draft: int,  # the draft vocabulary's size
    draft_to_target: torch.Tensor | None = None,  # [V_draft] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """One depth of the conditioned build, one launch: the best ``min(width,
    num_pairs)`` of the (parent, rank) pairs by (score of the prefix, then pair order),
    as ``build_conditioned_tree_torch`` selects them (same packed keys).  Returns their
    scores ``[R, n']`` and the next depth's parents ``[R, n' + 1]``: their tokens as
    target ids (token 0 where a parent left the slot empty, at score -inf), then the
    chain's next token (``token_ids[:, n, 0]``).  Into ``state`` it writes the depth's
    set and chain token and whether its logits held NaN/inf, folds its scores into
    ``best`` and writes ``theta``, the threshold of the next depth's candidates
    (:func:`~vllm_ddtree.kernels.conditioned_candidates.conditioned_candidates_triton`)."""
    R, n1, K = logprobs.shape
    n, wn = n1 - 1, min(width, num_pairs)
    D, pb = state.keys.shape[1:]
    wb = next_pow2(width)
    assert state.best.shape == (R, wb) and pb == wb and 0 < depth < D
    dev = logprobs.device
    scores = torch.empty((R, wn), dtype=torch.float32, device=dev)
    parents = torch.empty((R, wn + 1), dtype=torch.int64, device=dev)
    if R:
        has_map = draft_to_target is not None
        _select_children_kernel[(R,)](
            prev_scores, logprobs.contiguous(), token_ids.contiguous(),
            nonfinite.contiguous().view(torch.int8),
            draft_to_target if has_map else token_ids, pair_pos, pair_rank,
            scores, parents, state.keys, state.tokens, state.top1, state.nonfinite,
            state.best, state.theta, num_pairs, n, prev_scores.stride(0), width, v_draft,
            depth, D, K=K, WN=wn, P2=next_pow2(max(2, num_pairs)), PB=pb, WB=wb,
            NB=next_pow2(n + 1), HAS_MAP=has_map, FIRST=depth == 1,
            num_warps=4 if num_pairs <= 1024 else 8)
    return scores, parents


def conditioned_assemble_triton(
    logprobs: torch.Tensor,  # [R, K] float32 depth 1's candidates (the root's children)
    token_ids: torch.Tensor,  # [R, K] int64 their tokens (target ids)
    nonfinite: torch.Tensor,  # [R] bool depth 1's logits held NaN/inf
    state: ConditionedSelection,  # every later depth's selection
    width: int,
) -> tuple[torch.Tensor, ...]:
    """The conditioned build's trees from its per-depth sets, one launch: as
    :func:`tree_build_triton` assembles them.  Returns ``(token_ids, parents, depths,
    scores)``, each ``[R, width]``, ``num_nodes [R]``, ``top1 [R, D]`` and ``nonfinite
    [R]`` (bool), with ``DraftTree``'s conventions."""
    R, K = logprobs.shape
    D, pb = state.keys.shape[1:]
    sizes = _set_sizes(D, K, width)
    n_out = min(width, sum(sizes))
    dev = logprobs.device
    node_map = torch.empty((R, D, pb), dtype=torch.int64, device=dev)
    out_tok = torch.empty((R, width), dtype=torch.int64, device=dev)
    out_par = torch.empty_like(out_tok)
    out_dep = torch.empty_like(out_tok)
    out_score = torch.empty((R, width), dtype=torch.float32, device=dev)
    num_nodes = torch.empty(R, dtype=torch.int64, device=dev)
    bad = torch.empty(R, dtype=torch.bool, device=dev)
    if R:
        db = next_pow2(D) * pb
        _conditioned_assemble_kernel[(R,)](
            logprobs.contiguous(), token_ids.contiguous(), nonfinite.view(torch.int8),
            cached_int64_tensor(tuple(sizes), str(dev)), state.keys, state.tokens,
            state.top1, state.nonfinite, node_map, out_tok, out_par, out_dep, out_score,
            num_nodes, bad.view(torch.int8), n_out, D=D, K=K, W=width, PB=pb, DB=db,
            DP=next_pow2(D), num_warps=build_warps(pb, db))
    return out_tok, out_par, out_dep, out_score, num_nodes, state.top1, bad


def _set_sizes(max_depth: int, k: int, width: int) -> list[int]:
    """Nodes in each depth's set: depth 1's ``min(width, k)`` candidates, then the best
    ``width`` of each later depth's pairs (:func:`pair_layout`)."""
    num_pairs = pair_layout(max_depth, k, width)[2]
    return [min(width, k)] + [min(width, n) for n in num_pairs[1:]]


def _pair_tables(
    max_depth: int, k: int, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """The shared pair tables (:func:`pair_layout`) as the kernel reads them: parent
    positions and token ranks ``[P]`` int32, pairs per depth and each depth's set size
    ``[max_depth]`` int64; then the sort width (a power of two) and the total number of
    nodes over all depths."""
    parent_pos, ranks = pair_tensors(max_depth, k, width, str(device), torch.int32)
    num_pairs = pair_layout(max_depth, k, width)[2]
    sizes = _set_sizes(max_depth, k, width)
    # cached: nothing is copied to the device while a CUDA graph is captured
    num_pairs_t = cached_int64_tensor(tuple(num_pairs), str(device))
    sizes_t = cached_int64_tensor(tuple(sizes), str(device))
    return parent_pos, ranks, num_pairs_t, sizes_t, next_pow2(max(num_pairs)), sum(sizes)


def triton_build_supported(max_depth: int, k: int, width: int) -> bool:
    """Whether Triton is there and the build's sorts for depth ``max_depth``, ``k``
    candidates per depth and ``width`` nodes fit one program."""
    if not HAS_TRITON or width == 0:
        return False
    p2 = next_pow2(len(pair_layout(max_depth, k, width)[0]))
    return p2 <= MAX_SORT and next_pow2(width) * next_pow2(max_depth) <= MAX_SORT


def build_warps(sort_width: int, global_width: int) -> int:
    """Warps of one tree-build program whose per-depth sorts are ``sort_width`` keys
    and whose global selection sorts ``global_width``: 8 from 512-key sorts (budget 63)
    or a 2048-key selection (sorts with the work to share among more threads), else 4
    (smaller sorts gain nothing from another warp count); chosen with
    ``benchmarks.tree_build_tuning`` (docs/benchmarks/step-cost-h200.md, "The tree
    build's top-k and sort settings")."""
    return 8 if sort_width >= 512 or global_width >= 2048 else 4


def tree_build_triton(
    logprobs: torch.Tensor,  # [R, D, K] float32 per-depth candidate log-probabilities
    token_ids: torch.Tensor,  # [R, D, K] int64 their token ids
    width: int,
    budgets: torch.Tensor,  # [R] int64 per-request node budgets (<= width)
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trees of ``build_tree_torch`` from its per-depth candidates
    (``depth_candidates``), in one launch (one program per request).

    Returns ``(token_ids, parents, depths, scores)``, each ``[R, width]``, and
    ``num_nodes [R]``, with ``DraftTree``'s conventions.  ``num_warps`` overrides
    :func:`build_warps`.
    """
    R, D, K = logprobs.shape
    dev = logprobs.device
    parent_pos, ranks, num_pairs, sizes, p2, total = _pair_tables(D, K, width, dev)
    num_nodes = budgets.clamp(max=min(width, total))
    pb = next_pow2(width)
    s = max(p2, pb)
    db = next_pow2(D) * pb
    keys = torch.empty((R, D, s), dtype=torch.int64, device=dev)
    node_map = torch.empty((R, D, pb), dtype=torch.int64, device=dev)
    out_tok = torch.empty((R, width), dtype=torch.int64, device=dev)
    out_par = torch.empty_like(out_tok)
    out_dep = torch.empty_like(out_tok)
    out_score = torch.empty((R, width), dtype=torch.float32, device=dev)
    _tree_build_kernel[(R,)](
        logprobs.contiguous(), token_ids.contiguous(), parent_pos, ranks, num_pairs, sizes,
        keys, node_map, num_nodes, out_tok, out_par, out_dep, out_score,
        D=D, K=K, W=width, P2=p2, S=s, PB=pb, DB=db,
        num_warps=num_warps or build_warps(p2, db),
    )
    return out_tok, out_par, out_dep, out_score, num_nodes
