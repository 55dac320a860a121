"""Device-resident DDTree state of one engine's GPU worker: created and owned by its
:class:`~vllm_ddtree.gpu.speculator.DDTreeSpeculator`, which hands it to the model state,
the verifier and the tree attention of the same runner (see ``DDTreeSpeculator.load_model``).
Pure torch (no vLLM import), so it is tested on CPU.

Lifecycle of one decode step (all on the GPU, no host sync):

1. ``propose`` of step t (drafter pass, tree build) fills the *batch* buffers
   (``batch_*``, rows in batch order) and :meth:`TreeBuffers.commit` scatters them to the
   *request-state* buffers (rows = vLLM's request-state index), like vLLM stores
   ``draft_tokens``;
2. step t + 1: :meth:`TreeBuffers.fill_rows` gives every verify row its ancestor bits and
   RoPE position and every request its prefix length; the target runs;
   :meth:`TreeBuffers.walk` draws nothing itself but turns the target's per-row tokens
   into the accepted path, the emitted tokens and a row permutation;
3. ``propose`` of step t + 1 compacts the target KV along the path and feeds the
   drafter the accepted rows first.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_ddtree.gpu.tree_store import store_trees
from vllm_ddtree.gpu.verify_rows import (
    causal_words,
    commit_states,
    fill_tree_rows,
    use_triton,
    walk_verify,
)
from vllm_ddtree.tree import DraftTree, nonfinite_requests, walk_tree


@dataclass
class Accepted:
    """The walk's result for one verify batch (batch order)."""

    path: torch.Tensor  # [num_reqs, max_depth + 1] int64 local verify rows, root first, -1 padded
    num_accepted: torch.Tensor  # [num_reqs] int64 (root included)
    src_logit_row: torch.Tensor  # [num_logits] int64: row whose state moves to this row
    num_reqs: int


class TreeBuffers:
    """Persistent buffers (fixed addresses: read inside CUDA graphs).

    ``S`` below is ``max_num_reqs`` (request-state rows), ``W = max_rows = budget + 1``
    (verify rows of one request), ``NW = num_words = ceil(W / 32)``.
    """

    def __init__(self, max_num_reqs: int, max_num_tokens: int, budget: int, max_depth: int,
                 device: torch.device | str, step_budgets: Iterable[int] = ()) -> None:
        self.budget = budget  # draft nodes per tree
        self.max_depth = max_depth  # tree depth D (drafter positions per request)
        self.max_rows = budget + 1  # verify rows of one request: the root, then the nodes
        # verify widths a step can have (1 + each budget of a per-batch-size schedule)
        self.verify_widths = sorted({1 + b for b in step_budgets if b < budget}
                                    | {self.max_rows})
        self.num_words = (self.max_rows + 31) // 32  # int32 words of one ancestor bit row
        num_states, width, num_words = max_num_reqs, self.max_rows, self.num_words
        causal = causal_words(torch.arange(width), num_words).to(device)
        # per request state
        # [S, W, NW] int32: verify row i attends to row j iff bit j of row i is set
        self.ancestor_bits = causal.expand(num_states, width, num_words).contiguous()
        # [S, W] int64: verify row -> tree depth (RoPE offset from the root)
        self.depths = torch.arange(width, device=device).expand(num_states, width).contiguous()
        # [S, B] int64: node j's parent verify row (0 = the root)
        self.parents = torch.arange(budget, device=device).expand(num_states, budget).contiguous()
        # [S, B] int64: node j's token for the walk (-1: never accepted)
        self.walk_tokens = torch.full((num_states, budget), -1, dtype=torch.int64,
                                      device=device)
        # per batch row (written by the drafter pass, possibly inside a CUDA graph)
        self.batch_ancestor_bits = self.ancestor_bits.clone()  # [S, W, NW]
        self.batch_depths = self.depths.clone()  # [S, W]
        self.batch_parents = self.parents.clone()  # [S, B]
        self.batch_walk_tokens = self.walk_tokens.clone()  # [S, B]
        # [S, D] int64: the drafter's top-1 token per depth (-1: NaN/inf draft logits)
        self.batch_chain = torch.zeros((num_states, max_depth), dtype=torch.int64,
                                       device=device)
        # [1] int64: request-steps whose draft logits held NaN/inf (emptied trees)
        self.num_nonfinite = torch.zeros(1, dtype=torch.int64, device=device)
        # chain templates (penalties, bad words, grammars: verified as a chain)
        self._chain_ancestor_bits = causal  # [W, NW]
        self._chain_depths = torch.arange(width, device=device)  # [W]
        self._chain_parents = torch.arange(budget, device=device)  # [B]
        # per token row of the current target step
        self.row_bits = torch.zeros((max_num_tokens, num_words), dtype=torch.int32,
                                    device=device)  # [max_num_tokens, NW]
        # [max_num_tokens] int64: RoPE positions (tree rows: root position + depth)
        self.row_positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        # per request of the current target step, for the tree attention
        # [S] int32: KV length before the step's rows
        self.prefix_lens = torch.zeros(num_states, dtype=torch.int32, device=device)
        # [S] int32: end of the rows a mixed step's tree kernel recomputes
        self.query_end = torch.zeros(num_states, dtype=torch.int32, device=device)
        # [S] host bools: verify this request state as a chain
        self.chain_flag = np.zeros(num_states, dtype=bool)
        # host flag for the attention metadata builder: this step verifies trees
        self.step_has_trees = False
        self.accepted: Accepted | None = None

    def kernel_rows(self, max_query_len: int) -> int:
        """Verify rows per request that a tree-attention launch covers in a step whose
        longest request has ``max_query_len <= max_rows`` rows: the narrowest verify
        width that holds them.  An adaptive engine's narrow steps then take the narrow
        tiling (not the widest budget's), and every step takes a tiling its CUDA-graph
        capture compiled at start-up (one per width)."""
        widths = self.verify_widths
        return widths[min(bisect.bisect_left(widths, max_query_len), len(widths) - 1)]

    # -- drafter side ----------------------------------------------------------------
    def store_batch(
        self,
        tree: DraftTree,  # num_reqs trees of budget nodes
        draft_logits: torch.Tensor,  # [num_reqs, max_depth, vocab]
        draft_tokens: torch.Tensor,  # [max_num_reqs, budget] the speculator's draft tokens
    ) -> torch.Tensor:  # [num_reqs] bool
        """Write the batch's trees (one kernel, :func:`store_trees`; graph-capturable).
        Requests whose draft logits hold NaN/inf get an empty tree and an empty chain
        (bonus token only) and are counted in ``num_nonfinite``; returns their mask.
        The drafter's chain and the NaN/inf mask are the tree build's by-products
        (``tree.top1``, ``tree.nonfinite``), else read from ``draft_logits``."""
        bad = nonfinite_requests(tree, draft_logits)
        top1 = tree.top1 if tree.top1 is not None else draft_logits.argmax(dim=-1)
        self.num_nonfinite.add_(bad.sum())
        store_trees(tree.token_ids, tree.parents, tree.depths, bad, top1, draft_tokens,
                    self.batch_walk_tokens, self.batch_parents, self.batch_depths,
                    self.batch_ancestor_bits, self.batch_chain)
        return bad

    def apply_chain_fallback(
        self,
        rows: torch.Tensor,  # [m] int64 batch rows to verify as a chain
        draft_tokens: torch.Tensor,  # [max_num_reqs, budget]
    ) -> None:
        """Batch rows ``rows`` become chains: the drafter's top-1 token per depth, then
        filler rows that are never accepted."""
        filler = self.budget - self.max_depth  # rows past the chain's last depth
        chain = self.batch_chain[rows]  # [m, D]
        tokens = torch.cat([chain, chain[:, -1:].expand(-1, filler)], dim=1).clamp(min=0)
        walk = torch.cat([chain, torch.full_like(chain[:, :1], -1).expand(-1, filler)], 1)
        draft_tokens[rows] = tokens.to(draft_tokens.dtype)
        self.batch_walk_tokens[rows] = walk
        self.batch_parents[rows] = self._chain_parents
        self.batch_depths[rows] = self._chain_depths
        self.batch_ancestor_bits[rows] = self._chain_ancestor_bits

    def commit(
        self,
        idx_mapping: torch.Tensor,  # [num_reqs] int32 batch row -> request state
        num_reqs: int,
    ) -> None:
        """Scatter batch rows ``0..num_reqs`` to their request states (one launch on
        CUDA: :func:`~vllm_ddtree.gpu.verify_rows.commit_states`)."""
        commit_states(idx_mapping, [(self.batch_ancestor_bits, self.ancestor_bits),
                                    (self.batch_depths, self.depths),
                                    (self.batch_parents, self.parents),
                                    (self.batch_walk_tokens, self.walk_tokens)], num_reqs)

    # -- target side ----------------------------------------------------------------
    def fill_rows(
        self,
        query_start: torch.Tensor,  # [num_reqs_padded + 1] int32 vLLM's query_start_loc
        cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
        idx_mapping: torch.Tensor,  # [num_reqs] int32 batch row -> request state
        positions: torch.Tensor,  # [num_tokens_padded] int64 linear positions
        seq_lens: torch.Tensor,  # [num_reqs_padded] int32
        num_reqs: int,
        num_reqs_padded: int,
        num_tokens_padded: int,
    ) -> None:
        """This step's per-row ancestor bits and RoPE positions (``row_bits``,
        ``row_positions``) and per-request prefix lengths and recompute ends
        (``prefix_lens``, ``query_end``): one launch."""
        fill_tree_rows(query_start, cu_num_logits, idx_mapping, positions, seq_lens,
                       self.ancestor_bits, self.depths, self.row_bits, self.row_positions,
                       self.prefix_lens, self.query_end, num_reqs, num_reqs_padded,
                       num_tokens_padded)

    def walk(
        self,
        targets: torch.Tensor,  # [num_logits] int64 the target's token at every logits row
        cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
        idx_mapping: torch.Tensor,  # [num_reqs] int32 batch row -> request state
        num_reqs: int,
        impl: str = "auto",
    ) -> tuple[torch.Tensor, Accepted]:
        """Returns ``sampled [num_reqs, 1 + budget]`` (the accepted nodes' tokens then the
        bonus token, -1 padded) and the :class:`Accepted` record (also kept for the
        drafter).  ``impl``: "torch" (the core walk :func:`~vllm_ddtree.tree.walk_tree`
        on this layout), "triton" (its fused twin
        :func:`~vllm_ddtree.gpu.verify_rows.walk_verify`), "auto" (Triton on CUDA).
        """
        if use_triton(impl, targets):
            sampled, path, num_accepted, src_logit_row = walk_verify(
                targets, cu_num_logits, idx_mapping, self.walk_tokens, self.parents,
                self.max_depth, num_reqs)
            accepted = Accepted(path, num_accepted, src_logit_row, num_reqs)
            self.accepted = accepted
            return sampled, accepted
        width, max_depth, device = self.max_rows, self.max_depth, targets.device
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
        walk_tokens = torch.where(valid[:, 1:], self.walk_tokens[states], -1)
        tree = DraftTree(walk_tokens, self.parents[states], self.depths[states, 1:],
                         num_logits - 1, torch.zeros_like(walk_tokens, dtype=torch.float32),
                         max_depth)
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
        accepted = Accepted(path, num_accepted, src_logit_row[:total_logits], num_reqs)
        self.accepted = accepted
        return sampled, accepted

    def take_accepted(self) -> Accepted | None:
        accepted, self.accepted = self.accepted, None
        return accepted


def needs_chain(sampling_params: Any) -> str | None:
    """Why a request must be verified as a linear chain (its draft rows' history is
    linear in vLLM's penalty, bad-words, thinking-budget and grammar code), or None."""
    p = sampling_params
    if p is None:
        return None
    if getattr(p, "structured_outputs", None) is not None:
        return "structured output (a grammar)"
    if (getattr(p, "repetition_penalty", 1.0) != 1.0 or getattr(p, "presence_penalty", 0.0)
            or getattr(p, "frequency_penalty", 0.0)):
        return "repetition/presence/frequency penalties"
    if getattr(p, "bad_words", None) or getattr(p, "_bad_words_token_ids", None):
        return "bad words"
    if getattr(p, "thinking_token_budget", None) is not None:  # applied by 0.32+ sampler
        return "a thinking-token budget"
    return None
