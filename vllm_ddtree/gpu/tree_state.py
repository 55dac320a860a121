"""The draft trees of one engine's GPU worker, by request state.

:class:`TreeStates` is created by the engine's
:class:`~vllm_ddtree.gpu.speculator.DDTreeSpeculator` and changed only through its own
methods, all on the GPU with no host sync:

1. ``propose`` of step t (drafter pass, tree build) stores the batch's trees at the rows
   of their request states (:meth:`TreeStates.store_batch`, inside the drafter's CUDA
   graph: each batch row's state comes from a device buffer the graph reads), then turns
   requests that must be verified as a chain into chains
   (:meth:`~TreeStates.apply_chain_fallback`);
2. step t + 1: the model state has :meth:`~TreeStates.fill_rows` write the step's
   verify rows (:class:`~vllm_ddtree.gpu.step_rows.StepRows`); the target runs; the
   verifier walks the trees along the target's tokens (:meth:`~TreeStates.walk`).

A new request's slot is cleared by the model state (:meth:`~TreeStates.add_request`,
which also records whether the request is verified as a chain); the trees a warm-up
pass wrote are dropped (:meth:`~TreeStates.drop_trees`).  Pure torch (no vLLM import),
so it is tested on CPU.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_ddtree.gpu.rows import causal_words
from vllm_ddtree.gpu.step_rows import StepRows
from vllm_ddtree.gpu.tree_store import store_trees
from vllm_ddtree.gpu.walk import Accepted, walk_rows
from vllm_ddtree.tree import DraftTree, nonfinite_requests


class TreeStates:
    """Persistent buffers (fixed addresses: read inside CUDA graphs).

    ``S`` below is ``max_num_reqs`` (request-state rows), ``W = budget + 1`` (verify
    rows of one request), ``NW = ceil(W / 32)``.
    """

    def __init__(self, max_num_reqs: int, budget: int, max_depth: int,
                 device: torch.device | str) -> None:
        self.budget = budget  # draft nodes per tree
        self.max_depth = max_depth  # tree depth D (drafter positions per request)
        width = budget + 1
        num_words = (width + 31) // 32
        causal = causal_words(torch.arange(width), num_words).to(device)
        # by request state
        # [S, W, NW] int32: verify row i attends to row j iff bit j of row i is set
        self._ancestor_bits = causal.expand(max_num_reqs, width, num_words).contiguous()
        # [S, W] int64: verify row -> tree depth (RoPE offset from the root)
        self._depths = torch.arange(width, device=device).expand(max_num_reqs,
                                                                 width).contiguous()
        # [S, B] int64: node j's parent verify row (0 = the root)
        self._parents = torch.arange(budget, device=device).expand(max_num_reqs,
                                                                   budget).contiguous()
        # [S, B] int64: node j's token for the walk (-1: never accepted)
        self._walk_tokens = torch.full((max_num_reqs, budget), -1, dtype=torch.int64,
                                       device=device)
        # [S, D] int64: the drafter's top-1 token per depth (-1: NaN/inf draft logits)
        self._chain = torch.zeros((max_num_reqs, max_depth), dtype=torch.int64,
                                  device=device)
        # the chain every fallback request gets (its tokens come from _chain)
        self._chain_ancestor_bits = causal  # [W, NW]
        self._chain_depths = torch.arange(width, device=device)  # [W]
        self._chain_parents = torch.arange(budget, device=device)  # [B]
        # [S] host bools: verify this request state as a chain; how many are set
        self._chain_flag = np.zeros(max_num_reqs, dtype=bool)
        self._num_chain_flags = 0

    # -- what the verifier reads -------------------------------------------------------
    @property
    def walk_tokens(self) -> torch.Tensor:  # [S, B] int64, read only
        """Each request state's node tokens (-1: never accepted)."""
        return self._walk_tokens

    @property
    def parents(self) -> torch.Tensor:  # [S, B] int64, read only
        """Each request state's node parents (verify rows, 0 = the root)."""
        return self._parents

    # -- requests ------------------------------------------------------------------
    def add_request(self, req_index: int, as_chain: bool) -> None:
        """A new request took state ``req_index``: its predecessor's tree is dropped (a
        step before this request's first tree accepts nothing; a device fill, no sync)
        and ``as_chain`` says whether its drafts are verified as a chain."""
        self._walk_tokens[req_index].fill_(-1)
        self._num_chain_flags += int(as_chain) - int(self._chain_flag[req_index])
        self._chain_flag[req_index] = as_chain

    def drop_trees(self, states: torch.Tensor) -> None:  # [n] request states
        """The trees of ``states`` are never accepted (their next verify keeps the bonus
        token only, which is exact whatever else the rows hold): for the states a
        warm-up pass (vLLM's dummy run) stored trees in.  One device write, no sync."""
        self._walk_tokens.index_fill_(0, states.long(), -1)

    def chain_rows(self, idx_mapping_np: np.ndarray) -> np.ndarray:  # [m] int64
        """The batch rows (of ``idx_mapping_np``, batch row -> state) verified as a
        chain: host flags only."""
        if not self._num_chain_flags:  # the common case: no request needs a chain
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(self._chain_flag[idx_mapping_np])

    # -- drafter side ----------------------------------------------------------------
    def store_batch(
        self,
        tree: DraftTree,  # num_reqs trees of at most budget nodes
        draft_logits: torch.Tensor,  # [num_reqs, max_depth, vocab]
        draft_tokens: torch.Tensor,  # [max_num_reqs, budget] the speculator's draft tokens
        states: torch.Tensor,  # [num_reqs] int64 request state of each row (-1: none)
    ) -> torch.Tensor:  # [num_reqs] bool
        """Write the batch's draft tokens (by batch row) and its trees at the rows of
        their request states (one kernel, :func:`store_trees`; graph-capturable); slots
        past a narrower tree's nodes are never accepted, a row of state -1 (CUDA-graph
        padding) writes no tree.
        Requests whose draft logits hold NaN/inf get an empty tree and an empty chain
        (bonus token only); returns their mask.
        The drafter's chain and the NaN/inf mask are the tree build's by-products
        (``tree.top1``, ``tree.nonfinite``), else read from ``draft_logits``."""
        bad = nonfinite_requests(tree, draft_logits)
        top1 = tree.top1 if tree.top1 is not None else draft_logits.argmax(dim=-1)
        store_trees(tree.token_ids, tree.parents, tree.depths, bad, top1, states,
                    draft_tokens, self._walk_tokens, self._parents, self._depths,
                    self._ancestor_bits, self._chain)
        return bad

    def apply_chain_fallback(
        self,
        rows: torch.Tensor,  # [m] int64 batch rows to verify as a chain
        states: torch.Tensor,  # [m] int64 their request states
        draft_tokens: torch.Tensor,  # [max_num_reqs, budget]
    ) -> None:
        """The trees of ``states`` (stored by the batch rows ``rows``) become chains:
        the drafter's top-1 token per depth, then filler rows that are never
        accepted."""
        filler = self.budget - self.max_depth  # rows past the chain's last depth
        chain = self._chain[states]  # [m, D]
        tokens = torch.cat([chain, chain[:, -1:].expand(-1, filler)], dim=1).clamp(min=0)
        walk = torch.cat([chain, torch.full_like(chain[:, :1], -1).expand(-1, filler)], 1)
        draft_tokens[rows] = tokens.to(draft_tokens.dtype)
        self._walk_tokens[states] = walk
        self._parents[states] = self._chain_parents
        self._depths[states] = self._chain_depths
        self._ancestor_bits[states] = self._chain_ancestor_bits

    # -- target side ----------------------------------------------------------------
    def fill_rows(
        self,
        out: StepRows,
        query_start: torch.Tensor,  # [num_reqs_padded + 1] int32 vLLM's query_start_loc
        cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
        idx_mapping: torch.Tensor,  # [num_reqs] int32 batch row -> request state
        positions: torch.Tensor,  # [num_tokens_padded] int64 linear positions
        seq_lens: torch.Tensor,  # [num_reqs_padded] int32
        num_reqs: int,
        num_reqs_padded: int,
        num_tokens_padded: int,
        has_trees: bool,
    ) -> None:
        """Have ``out`` write the step's rows from these requests' trees
        (:meth:`~vllm_ddtree.gpu.step_rows.StepRows.fill`)."""
        out.fill(query_start, cu_num_logits, idx_mapping, positions, seq_lens,
                 self._ancestor_bits, self._depths, num_reqs, num_reqs_padded,
                 num_tokens_padded, has_trees)

    def walk(
        self,
        targets: torch.Tensor,  # [num_logits] int64 the target's token at every logits row
        cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
        idx_mapping: torch.Tensor,  # [num_reqs] int32 batch row -> request state
        num_reqs: int,
    ) -> tuple[torch.Tensor, Accepted]:
        """``sampled [num_reqs, 1 + budget]`` (the accepted nodes' tokens then the bonus
        token, -1 padded) and the :class:`~vllm_ddtree.gpu.walk.Accepted` record
        (:func:`~vllm_ddtree.gpu.walk.walk_rows`)."""
        return walk_rows(targets, cu_num_logits, idx_mapping, self._walk_tokens,
                         self._parents, self._depths, self.max_depth, num_reqs)
