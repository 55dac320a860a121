"""The walk of a verify batch laid out by vLLM: follow, in every request's tree, the
child equal to the target's token, and emit vLLM's sampled tokens.

Request ``b``'s logits rows are ``cu_num_logits[b] ..`` (row 0 = the root, row ``j + 1``
= node ``j``); its tree is the one stored for its request state (``walk_tokens``,
``parents`` by state, gathered with ``idx_mapping``).  Nodes past the rows vLLM
scheduled (a tree cut short) are never accepted.

:func:`walk_rows_torch` is the core walk (:func:`vllm_ddtree.tree.walk_tree`) on this
layout; :func:`walk_rows_triton` is its fused twin (one program per request); the tests
compare the two.  :func:`walk_rows` picks one
(:func:`~vllm_ddtree.kernels.triton_utils.use_triton`).  No vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.kernels.triton_utils import HAS_TRITON, next_pow2, tl, triton, use_triton
from vllm_ddtree.tree import DraftTree, walk_tree


@dataclass(frozen=True)
class Accepted:
    """The walk's result for one verify batch (batch order)."""

    path: torch.Tensor  # [num_reqs, max_depth + 1] int64 local verify rows, root first, -1 padded
    num_accepted: torch.Tensor  # [num_reqs] int64 (root included)
    src_logit_row: torch.Tensor  # [num_logits] int64: row whose state moves to this row
    num_reqs: int


def walk_rows(
    targets: torch.Tensor,  # [num_logits] int64 the target's token at every logits row
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    idx_mapping: torch.Tensor,  # [num_reqs] int32 batch row -> request state
    walk_tokens: torch.Tensor,  # [S, budget] int64 node tokens by request state (-1: never)
    parents: torch.Tensor,  # [S, budget] int64 node parents (verify rows) by state
    depths: torch.Tensor,  # [S, budget + 1] int64 verify-row depths by state
    max_depth: int,
    num_reqs: int,
) -> tuple[torch.Tensor, Accepted]:
    """Returns ``sampled [num_reqs, 1 + budget]`` (the accepted nodes' tokens then the
    bonus token, -1 padded: vLLM's sampler output) and the :class:`Accepted` record."""
    walk = walk_rows_triton if use_triton(targets) else walk_rows_torch
    return walk(targets, cu_num_logits, idx_mapping, walk_tokens, parents, depths,
                max_depth, num_reqs)


def walk_rows_torch(
    targets: torch.Tensor,  # [num_logits] int64
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    idx_mapping: torch.Tensor,  # [num_reqs] int32
    walk_tokens: torch.Tensor,  # [S, budget] int64
    parents: torch.Tensor,  # [S, budget] int64
    depths: torch.Tensor,  # [S, budget + 1] int64
    max_depth: int,
    num_reqs: int,
) -> tuple[torch.Tensor, Accepted]:
    """Reference of :func:`walk_rows`: the core walk on this layout."""
    width = walk_tokens.shape[1] + 1
    device = targets.device
    total_logits = targets.shape[0]
    cu = cu_num_logits[: num_reqs + 1].long()
    row_start = cu[:-1].unsqueeze(1)  # [n, 1] first logits row of each request
    num_logits = cu[1:] - cu[:-1]  # [n] rows per request (1 + scheduled drafts)
    cols = torch.arange(width, device=device)
    valid = cols.unsqueeze(0) < num_logits.unsqueeze(1)  # [n, W]
    rows = (row_start + cols).clamp(max=max(total_logits - 1, 0))
    target2d = torch.where(valid, targets[rows], torch.full_like(rows, -2))  # [n, W]
    states = idx_mapping[:num_reqs].long()
    # nodes that were not scheduled (tree cut short by vLLM) can never be accepted
    tokens = torch.where(valid[:, 1:], walk_tokens[states], -1)
    tree = DraftTree(tokens, parents[states], depths[states, 1:], num_logits - 1,
                     torch.zeros_like(tokens, dtype=torch.float32), max_depth)
    path, num_accepted, _ = walk_tree(tree, target2d)
    sampled = torch.full((num_reqs, width), -1, dtype=torch.int64, device=device)
    sampled[:, : max_depth + 1] = torch.where(
        path >= 0, torch.gather(target2d, 1, path.clamp(min=0)), -1)
    # logits row l = cu[b] + i takes the state of row cu[b] + path[b, i] (i < k + 1)
    depth_cols = cols[: max_depth + 1].unsqueeze(0).expand(num_reqs, -1)
    on_path = depth_cols < num_accepted.unsqueeze(1)
    dst_rows = torch.where(on_path, row_start + depth_cols, total_logits)  # = dropped
    src_rows = row_start + path.clamp(min=0)
    src_logit_row = torch.arange(total_logits + 1, device=device)
    src_logit_row.scatter_(0, dst_rows.reshape(-1), src_rows.reshape(-1))
    return sampled, Accepted(path, num_accepted, src_logit_row[:total_logits], num_reqs)


if HAS_TRITON:

    @triton.jit
    def _walk_kernel(TGT, CU, IDX, WTOK, PAR, SAMPLED, PATH, NACC, SRC,
                     s_wt, s_par, s_sam, s_path,
                     BUDGET: tl.constexpr, MAX_DEPTH: tl.constexpr, MAX_ROWS: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr):
        b = tl.program_id(0)
        row_start = tl.load(CU + b).to(tl.int64)
        num_logits = tl.load(CU + b + 1).to(tl.int64) - row_start
        state = tl.load(IDX + b).to(tl.int64)
        j = tl.arange(0, BLOCK_B)
        live = j < tl.minimum(num_logits - 1, BUDGET)  # scheduled nodes only
        tok = tl.load(WTOK + state * s_wt + j, mask=live, other=-1)
        par = tl.load(PAR + state * s_par + j, mask=live, other=-1)
        cols = tl.arange(0, BLOCK_W)
        path = tl.where(cols == 0, 0, -1).to(tl.int64)
        cur = tl.zeros((), tl.int64)
        k = tl.zeros((), tl.int64)
        for _ in range(MAX_DEPTH):
            t = tl.load(TGT + row_start + cur)
            hit = live & (par == cur) & (tok == t) & (tok >= 0)
            nxt = tl.min(tl.where(hit, j, BLOCK_B), axis=0)
            found = nxt < BLOCK_B
            cur = tl.where(found, nxt.to(tl.int64) + 1, cur)
            k = tl.where(found, k + 1, k)
            path = tl.where(found & (cols == k), cur, path)
        num_accepted = k + 1
        tl.store(NACC + b, num_accepted)
        tl.store(PATH + b * s_path + cols, path, mask=cols < MAX_DEPTH + 1)
        on = cols < num_accepted
        row = tl.where(on, path, 0)
        sam = tl.load(TGT + row_start + row, mask=on, other=-1)
        tl.store(SAMPLED + b * s_sam + cols, tl.where(on, sam, -1), mask=cols < MAX_ROWS)
        src = tl.where(on, row_start + row, row_start + cols)
        tl.store(SRC + row_start + cols, src, mask=cols < num_logits)




def walk_rows_triton(
    targets: torch.Tensor,  # [num_logits] int64
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    idx_mapping: torch.Tensor,  # [num_reqs] int32
    walk_tokens: torch.Tensor,  # [S, budget] int64
    parents: torch.Tensor,  # [S, budget] int64
    depths: torch.Tensor,  # [S, budget + 1] int64 (unused: the kernel walks by parent)
    max_depth: int,
    num_reqs: int,
) -> tuple[torch.Tensor, Accepted]:
    """The Triton launcher of :func:`walk_rows`: one program per request."""
    budget = walk_tokens.shape[1]
    max_rows = budget + 1
    total_logits = targets.shape[0]
    device = targets.device
    sampled = torch.empty((num_reqs, max_rows), dtype=torch.int64, device=device)
    path = torch.empty((num_reqs, max_depth + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty((num_reqs,), dtype=torch.int64, device=device)
    src_logit_row = torch.empty((total_logits,), dtype=torch.int64, device=device)
    if num_reqs:
        _walk_kernel[(num_reqs,)](
            targets, cu_num_logits, idx_mapping, walk_tokens, parents, sampled, path,
            num_accepted, src_logit_row, walk_tokens.stride(0), parents.stride(0),
            sampled.stride(0), path.stride(0),
            BUDGET=budget, MAX_DEPTH=max_depth, MAX_ROWS=max_rows,
            BLOCK_B=next_pow2(budget), BLOCK_W=next_pow2(max_rows),
            num_warps=4)
    return sampled, Accepted(path, num_accepted, src_logit_row, num_reqs)
