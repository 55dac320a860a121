"""One launch that stores a batch of draft trees as verify metadata.

Given the best-first trees of a batch (:class:`~vllm_ddtree.tree.DraftTree` fields), the
mask of requests whose draft logits held NaN/inf, the drafter's top-1 token per depth
and the request state of every batch row, :func:`store_trees` writes what the verify
step reads: the draft tokens (by batch row, as vLLM's drafter hands them over) and, by
request state, the walk tokens, the parents, the per-row depths, the ancestor-or-self
bits of every verify row and the chain fallback.  The torch reference is the core's own functions
(:func:`~vllm_ddtree.tree.drop_nonfinite`, :func:`~vllm_ddtree.tree.tree_layout`, clamps),
about 35 small kernels; the Triton kernel is one program per request.

Verify row 0 of a request is its root, row ``j + 1`` is node ``j``.  Row ``i``'s bits
hold its ancestors and itself: the kernel walks every row's parent chain up to the root in
``max depth`` vectorized steps (all rows of a request at once), reading parents from the
input, so no step depends on an earlier step's stores.
"""

from __future__ import annotations

import torch

from vllm_ddtree.kernels.triton_utils import HAS_TRITON, next_pow2, tl, triton, use_triton
from vllm_ddtree.tree import DraftTree, drop_nonfinite, tree_layout


def _check_shapes(
    token_ids: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    bad: torch.Tensor,
    top1: torch.Tensor,
    states: torch.Tensor,
    outs: tuple[torch.Tensor, ...],
) -> None:
    """Shape checks on metadata only (no device access)."""
    R, N = token_ids.shape
    D = top1.shape[1]
    out_draft, out_walk, out_parents, out_depths, out_bits, out_chain = outs
    B = out_walk.shape[-1]
    W = B + 1
    NW = (W + 31) // 32
    if (parents.shape != (R, N) or depths.shape != (R, N) or bad.shape != (R,)
            or states.shape != (R,)):
        raise ValueError("store_trees: token_ids, parents, depths must be [R, N], bad and "
                         "states [R]")
    if N > B:
        raise ValueError(f"store_trees: trees of {N} nodes do not fit outputs of {B}")
    if top1.shape[0] != R:
        raise ValueError(f"store_trees: top1 must be [R={R}, D], got {tuple(top1.shape)}")
    wanted = [(out_draft, (B,)), (out_walk, (B,)), (out_parents, (B,)), (out_depths, (W,)),
              (out_bits, (W, NW)), (out_chain, (D,))]
    for out, tail in wanted:
        if out.dim() != 1 + len(tail) or tuple(out.shape[1:]) != tail or out.shape[0] < R:
            raise ValueError(f"store_trees: an output of shape {tuple(out.shape)} is not "
                             f"[>={R}, {', '.join(map(str, tail))}]")
    if len({out.shape[0] for out in outs[1:]}) != 1:
        raise ValueError("store_trees: the outputs by request state differ in length")


def store_trees_torch(
    token_ids: torch.Tensor,  # [R, N] int64, N <= B
    parents: torch.Tensor,  # [R, N] int64
    depths: torch.Tensor,  # [R, N] int64
    bad: torch.Tensor,  # [R] bool
    top1: torch.Tensor,  # [R, D] int64
    states: torch.Tensor,  # [R] int64 request state of each row, -1: none
    out_draft_tokens: torch.Tensor,  # [>=R, B] int64 or int32, by batch row
    out_walk_tokens: torch.Tensor,  # [S, B] int64, by request state (as below)
    out_parents: torch.Tensor,  # [S, B] int64
    out_depths: torch.Tensor,  # [S, B + 1] int64
    out_bits: torch.Tensor,  # [S, B + 1, NW] int32
    out_chain: torch.Tensor,  # [S, D] int64
) -> None:
    """Reference of :func:`store_trees`: the core's functions on a copy of the trees,
    widened to the outputs' ``B`` slots.  The inputs are not modified."""
    R, N = token_ids.shape
    B = out_walk_tokens.shape[1]
    D = top1.shape[1]
    dev = token_ids.device

    def widen(t: torch.Tensor, fill: int) -> torch.Tensor:  # [R, N] -> [R, B]
        return torch.cat([t, t.new_full((R, B - N), fill)], dim=1)

    tree = DraftTree(widen(token_ids, -1), widen(parents, -1), widen(depths, 0),
                     num_nodes=(token_ids >= 0).sum(dim=1),
                     scores=torch.zeros((R, B), dtype=torch.float32, device=dev),
                     max_depth=D)
    # draft logits that are non-finite exactly in the bad requests
    logits = torch.zeros((R, 1, 1), dtype=torch.float32, device=dev)
    drop_nonfinite(tree, logits.masked_fill(bad.view(R, 1, 1), float("nan")))
    layout = tree_layout(tree, torch.zeros(R, dtype=torch.int64, device=dev))
    out_draft_tokens[:R].copy_(tree.token_ids.clamp(min=0))
    rows = states >= 0  # a boolean index: the reference may read the device
    dst = states[rows].long()
    out_walk_tokens[dst] = tree.token_ids[rows]
    out_parents[dst] = tree.parents.clamp(min=0)[rows]
    out_depths[dst] = layout.depths[rows]
    out_bits[dst] = layout.ancestor_bits[rows]
    out_chain[dst] = top1.masked_fill(bad.unsqueeze(1), -1)[rows]


if HAS_TRITON:

    @triton.jit
    def _store_trees_kernel(
        TOK, PAR, DEP, BAD, TOP1, STATE,
        OUT_DRAFT, OUT_WALK, OUT_PAR, OUT_DEP, OUT_BITS, OUT_CHAIN,
        s_tok, s_par, s_dep, s_top1, s_top1_d, s_state, s_draft, s_walk, s_opar, s_odep,
        s_bits_r, s_bits_w, s_chain,
        N: tl.constexpr, B: tl.constexpr, D: tl.constexpr, NW: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_NW: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        # the request state this row's tree goes to (-1: a padding row, draft tokens only)
        s = tl.load(STATE + r * s_state).to(tl.int64)
        kept = (s >= 0).to(tl.int32)  # 0: every store below has no lane
        s = tl.maximum(s, 0)
        good = tl.load(BAD + r) == 0
        # slots read from the inputs (N of the B output slots; a bad tree is empty)
        n_live = tl.where(good, N, 0)
        par_row = PAR + r * s_par

        # nodes: tokens and parents
        j = tl.arange(0, BLOCK_B)
        jm = j < B
        keep = j < n_live
        tok = tl.load(TOK + r * s_tok + j, mask=keep, other=-1)
        par = tl.load(par_row + j, mask=keep, other=-1)
        tl.store(OUT_DRAFT + r * s_draft + j,
                 tl.maximum(tok, 0).to(OUT_DRAFT.dtype.element_ty), mask=jm)
        tl.store(OUT_WALK + s * s_walk + j, tok, mask=j < B * kept)
        tl.store(OUT_PAR + s * s_opar + j, tl.maximum(par, 0), mask=j < B * kept)

        # verify rows: row 0 is the root (depth 0, no parent), row i >= 1 is node i - 1
        i = tl.arange(0, BLOCK_W)
        im = i < B + 1
        node = (i >= 1) & (i < n_live + 1)
        dep = tl.load(DEP + r * s_dep + i - 1, mask=node, other=0)
        tl.store(OUT_DEP + s * s_odep + i, dep, mask=i < (B + 1) * kept)

        # ancestor-or-self bits: each row's own bit, then its parent chain up to the root
        # (a row at depth d has d ancestors; unused rows, parent -1, only themselves)
        w = tl.arange(0, BLOCK_NW)
        own = (i // 32)[:, None] == w[None, :]
        one = tl.full([BLOCK_W, BLOCK_NW], 1, tl.int64)
        bits = tl.where(own, one << (i % 32).to(tl.int64)[:, None], 0)
        anc = tl.load(par_row + i - 1, mask=node, other=-1).to(tl.int64)
        # (a chain of N nodes is the deepest tree: the bound only guards malformed input)
        for _ in range(tl.minimum(tl.max(dep, axis=0), N)):
            a = tl.maximum(anc, 0)
            hit = (anc >= 0)[:, None] & ((a // 32)[:, None] == w[None, :])
            bits = bits | tl.where(hit, one << (a % 32)[:, None], 0)
            # the root (row 0) ends the chain
            anc = tl.load(par_row + anc - 1, mask=anc >= 1, other=-1).to(tl.int64)
        # int32 words, bit 31 as the sign bit
        bits = tl.where(bits >= 2147483648, bits - 4294967296, bits).to(tl.int32)
        tl.store(OUT_BITS + s * s_bits_r + i[:, None] * s_bits_w + w[None, :], bits,
                 mask=im[:, None] & (w < NW * kept)[None, :])

        # the chain fallback: top-1 per depth, -1 for a bad request
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        t1 = tl.load(TOP1 + r * s_top1 + d * s_top1_d, mask=dm, other=-1)
        tl.store(OUT_CHAIN + s * s_chain + d, tl.where(good, t1, -1), mask=d < D * kept)


def store_trees(
    token_ids: torch.Tensor,  # [R, N] int64 tree node tokens, -1 in unused slots; N <= B
    parents: torch.Tensor,  # [R, N] int64 parent verify row (0 = root, k+1 = node k), -1 unused
    depths: torch.Tensor,  # [R, N] int64 node depth 1..D, 0 unused
    bad: torch.Tensor,  # [R] bool: this request's draft logits held NaN/inf
    top1: torch.Tensor,  # [R, D] int64 the drafter's best token per depth
    states: torch.Tensor,  # [R] int64 request state of each row (-1: none); may be strided
    out_draft_tokens: torch.Tensor,  # [>=R, B] (int64 or int32) the speculator's draft tokens
    out_walk_tokens: torch.Tensor,  # [S, B] int64
    out_parents: torch.Tensor,  # [S, B] int64
    out_depths: torch.Tensor,  # [S, W] int64, W = B + 1
    out_bits: torch.Tensor,  # [S, W, NW] int32, NW = ceil(W / 32)
    out_chain: torch.Tensor,  # [S, D] int64
) -> None:
    """Write rows ``0..R`` of ``out_draft_tokens`` and, for each row ``r`` with
    ``states[r] >= 0``, row ``states[r]`` of the other outputs (every other row is
    untouched; a row of state -1, a CUDA-graph padding row, stores its draft tokens
    only):

    * trees of ``N`` nodes fill the first ``N`` of the outputs' ``B`` slots, the rest are
      unused (a smaller tree than the engine's budget: see the speculator's
      ``_tree_budgets``);
    * a request with ``bad[r]`` gets an empty tree (every slot unused) and chain row -1;
    * ``out_draft_tokens = token_ids.clamp(min=0)``, ``out_walk_tokens = token_ids``,
      ``out_parents = parents.clamp(min=0)``;
    * ``out_depths = [0, depths...]`` and ``out_bits`` the ancestor-or-self bits of every
      verify row (:func:`~vllm_ddtree.tree.tree_layout`);
    * ``out_chain = top1``, -1 in bad requests.

    Nodes must be best-first (a node's parent row comes before it); two rows must not
    share a state.  On the GPU (the kernel) graph-capturable: no host sync, no
    allocation.  The inputs are not modified.
    """
    outs = (out_draft_tokens, out_walk_tokens, out_parents, out_depths, out_bits, out_chain)
    _check_shapes(token_ids, parents, depths, bad, top1, states, outs)
    if token_ids.shape[0] == 0:
        return
    store = store_trees_triton if use_triton(token_ids) else store_trees_torch
    store(token_ids, parents, depths, bad, top1, states, *outs)


def store_trees_triton(
    token_ids: torch.Tensor,  # [R, N] int64 tree node tokens, -1 in unused slots; N <= B
    parents: torch.Tensor,  # [R, N] int64 parent verify row (0 = root, k+1 = node k), -1 unused
    depths: torch.Tensor,  # [R, N] int64 node depth 1..D, 0 unused
    bad: torch.Tensor,  # [R] bool: this request's draft logits held NaN/inf
    top1: torch.Tensor,  # [R, D] int64 the drafter's best token per depth
    states: torch.Tensor,  # [R] int64 request state of each row (-1: none); may be strided
    out_draft_tokens: torch.Tensor,  # [>=R, B] (int64 or int32) the speculator's draft tokens
    out_walk_tokens: torch.Tensor,  # [S, B] int64
    out_parents: torch.Tensor,  # [S, B] int64
    out_depths: torch.Tensor,  # [S, W] int64, W = B + 1
    out_bits: torch.Tensor,  # [S, W, NW] int32, NW = ceil(W / 32)
    out_chain: torch.Tensor,  # [S, D] int64
) -> None:
    """The Triton launcher of :func:`store_trees`: one program per request."""
    outs = (out_draft_tokens, out_walk_tokens, out_parents, out_depths, out_bits, out_chain)
    R, N = token_ids.shape
    B = out_walk_tokens.shape[1]
    D = top1.shape[1]
    for t in (token_ids, parents, depths, *outs):  # top1 may be strided (a view)
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError("store_trees: the last dim of every tensor must be contiguous")
    W = B + 1
    NW = (W + 31) // 32
    bad_u8 = bad.view(torch.uint8) if bad.dtype == torch.bool else bad  # a view, no copy
    block_w = max(16, next_pow2(W))
    block_nw = next_pow2(NW)
    _store_trees_kernel[(R,)](
        token_ids, parents, depths, bad_u8, top1, states,
        out_draft_tokens, out_walk_tokens, out_parents, out_depths, out_bits, out_chain,
        token_ids.stride(0), parents.stride(0), depths.stride(0), top1.stride(0),
        top1.stride(1), states.stride(0),
        out_draft_tokens.stride(0), out_walk_tokens.stride(0), out_parents.stride(0),
        out_depths.stride(0), out_bits.stride(0), out_bits.stride(1), out_chain.stride(0),
        N=N, B=B, D=D, NW=NW,
        BLOCK_B=max(16, next_pow2(B)), BLOCK_W=block_w, BLOCK_NW=block_nw,
        BLOCK_D=max(16, next_pow2(D)),
        num_warps=4 if block_w * block_nw <= 2048 else 8)
