"""Device-resident DDTree state shared by the V2 speculator, model state, verifier and
attention backend of one worker process.  Pure torch (no vLLM import), so it is tested
on CPU.

Lifecycle of one decode step (all on the GPU, no host sync):

1. ``propose`` of step t (drafter pass, tree build) fills the *batch* buffers
   (``b_*``, rows in batch order) and :meth:`commit` scatters them to the
   *request-state* buffers (rows = vLLM's request-state index), like vLLM stores
   ``draft_tokens``;
2. step t + 1: :meth:`fill_rows` gives every verify row its ancestor bits and RoPE
   position; the target runs; :meth:`walk` draws nothing itself but turns the target's
   per-row tokens into the accepted path, the emitted tokens and a row permutation;
3. ``propose`` of step t + 1 compacts the target KV along the path and feeds the
   drafter the accepted rows first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.gpu.verify_rows import (causal_words, fill_tree_rows, use_triton,
                                             walk_verify)
from vllm_ddtree.tree import DraftTree, drop_nonfinite, tree_layout, walk_tree


@dataclass
class Accepted:
    """The walk's result for one verify batch (batch order)."""

    path: torch.Tensor  # [n, D + 1] int64 local verify rows, root first, -1 padded
    num_accepted: torch.Tensor  # [n] int64 (root included)
    src_logit_row: torch.Tensor  # [num_logits] int64: row whose state moves to this row
    num_reqs: int


class TreeBuffers:
    """Persistent buffers (fixed addresses: read inside CUDA graphs)."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, budget: int, depth: int,
                 device) -> None:
        self.B, self.D = budget, depth
        self.W = budget + 1  # verify rows of one request
        self.NW = (self.W + 31) // 32
        S, W, NW = max_num_reqs, self.W, self.NW
        kw = dict(device=device)
        # per request state
        self.bits = causal_words(torch.arange(W), NW).to(device).expand(S, W, NW).contiguous()
        self.depth = torch.arange(W, **kw).expand(S, W).contiguous()
        self.parents = torch.arange(budget, **kw).expand(S, budget).contiguous()
        self.walk_tokens = torch.full((S, budget), -1, dtype=torch.int64, **kw)
        # per batch row (written by the drafter pass, possibly inside a CUDA graph)
        self.b_bits = self.bits.clone()
        self.b_depth = self.depth.clone()
        self.b_parents = self.parents.clone()
        self.b_walk = self.walk_tokens.clone()
        self.b_chain = torch.zeros((S, depth), dtype=torch.int64, **kw)
        # request-steps whose draft logits held NaN/inf (emptied trees), counted on device
        self.nonfinite = torch.zeros(1, dtype=torch.int64, **kw)
        # chain templates (penalties, bad words, grammars: verified as a chain)
        self._chain_bits = causal_words(torch.arange(W), NW).to(device)
        self._chain_depth = torch.arange(W, **kw)
        self._chain_parents = torch.arange(budget, **kw)
        # per token row of the current target step
        self.row_bits = torch.zeros((max_num_tokens, NW), dtype=torch.int32, **kw)
        self.rope = torch.zeros(max_num_tokens, dtype=torch.int64, **kw)
        # host-side per-state flags: verify this request as a chain
        self.chain_flag = np.zeros(S, dtype=bool)
        self.step_has_trees = False
        self.accepted: Accepted | None = None
        self.draft_layer_names: frozenset[str] = frozenset()

    # -- drafter side ----------------------------------------------------------------
    def store_batch(self, tree: DraftTree, draft_logits: torch.Tensor,
                    draft_tokens: torch.Tensor) -> None:
        """Write the batch's trees (``n`` = rows of ``tree``).  Graph-capturable.  Requests
        whose draft logits hold NaN/inf get an empty tree and an empty chain (bonus token
        only) and are counted in ``nonfinite``."""
        bad = drop_nonfinite(tree, draft_logits)
        self.nonfinite.add_(bad.sum())
        n = tree.token_ids.shape[0]
        lay = tree_layout(tree, torch.zeros(n, dtype=torch.int64, device=tree.token_ids.device))
        draft_tokens[:n].copy_(tree.token_ids.clamp(min=0))
        self.b_walk[:n].copy_(tree.token_ids)  # -1 in unused slots: never accepted
        self.b_parents[:n].copy_(tree.parents.clamp(min=0))
        self.b_depth[:n].copy_(lay.depths)
        self.b_bits[:n].copy_(lay.ancestor_bits)
        self.b_chain[:n].copy_(draft_logits.argmax(dim=-1).masked_fill(bad.unsqueeze(1), -1))

    def apply_chain_fallback(self, rows: torch.Tensor, draft_tokens: torch.Tensor) -> None:
        """Batch rows ``rows`` (int64 device tensor) become chains: the drafter's top-1
        token per depth, then filler rows that are never accepted."""
        D = self.D
        chain = self.b_chain[rows]  # [m, D]
        toks = torch.cat([chain, chain[:, -1:].expand(-1, self.B - D)], dim=1).clamp(min=0)
        walk = torch.cat([chain, torch.full_like(chain[:, :1], -1).expand(-1, self.B - D)], 1)
        draft_tokens[rows] = toks.to(draft_tokens.dtype)
        self.b_walk[rows] = walk
        self.b_parents[rows] = self._chain_parents
        self.b_depth[rows] = self._chain_depth
        self.b_bits[rows] = self._chain_bits

    def commit(self, idx_mapping: torch.Tensor, n: int) -> None:
        """Scatter batch rows ``0..n`` to their request states."""
        idx = idx_mapping[:n].long()
        self.bits[idx] = self.b_bits[:n]
        self.depth[idx] = self.b_depth[:n]
        self.parents[idx] = self.b_parents[:n]
        self.walk_tokens[idx] = self.b_walk[:n]

    # -- target side ----------------------------------------------------------------
    def fill_rows(self, query_start, cu_num_logits, idx_mapping, positions, num_reqs: int,
                  num_tokens_padded: int) -> None:
        self.rope[:num_tokens_padded].copy_(positions[:num_tokens_padded])
        fill_tree_rows(query_start, cu_num_logits, idx_mapping, positions, self.bits,
                       self.depth, self.row_bits, self.rope, num_reqs)

    def walk(self, targets: torch.Tensor, cu_num_logits: torch.Tensor,
             idx_mapping: torch.Tensor, num_reqs: int,
             impl: str = "auto") -> tuple[torch.Tensor, Accepted]:
        """``targets [num_logits]``: the target's token at every logits row.

        Returns ``sampled [n, 1 + B]`` (the accepted nodes' tokens then the bonus token,
        -1 padded) and the :class:`Accepted` record (also kept for the drafter).
        ``impl``: "torch" (reference), "triton" (one fused kernel), "auto" (Triton on
        CUDA).
        """
        if use_triton(impl, targets):
            sampled, path, num_acc, src = walk_verify(
                targets, cu_num_logits, idx_mapping, self.walk_tokens, self.parents, self.D,
                num_reqs)
            acc = Accepted(path, num_acc, src, num_reqs)
            self.accepted = acc
            return sampled, acc
        n, W, dev = num_reqs, self.W, targets.device
        L = targets.shape[0]
        cu = cu_num_logits[: n + 1].long()
        nlog = cu[1:] - cu[:-1]  # rows per request (1 + scheduled drafts)
        j = torch.arange(W, device=dev)
        valid = j.unsqueeze(0) < nlog.unsqueeze(1)  # [n, W]
        rows = (cu[:-1].unsqueeze(1) + j).clamp(max=max(L - 1, 0))
        target2d = torch.where(valid, targets[rows], torch.full_like(rows, -2))
        idx = idx_mapping[:n].long()
        # nodes that were not scheduled (tree cut short by vLLM) can never be accepted
        walk_tok = torch.where(valid[:, 1:], self.walk_tokens[idx], -1)
        tree = DraftTree(walk_tok, self.parents[idx], self.depth[idx, 1:],
                         nlog - 1, torch.zeros_like(walk_tok, dtype=torch.float32), self.D)
        path, num_acc, bonus = walk_tree(tree, target2d)
        sampled = torch.full((n, W), -1, dtype=torch.int64, device=dev)
        sampled[:, : self.D + 1] = torch.where(
            path >= 0, torch.gather(target2d, 1, path.clamp(min=0)), -1)
        # logits row l = cu[b] + i takes the state of row cu[b] + path[b, i] (i < k + 1)
        src = torch.arange(L, device=dev)
        i = j[: self.D + 1].unsqueeze(0).expand(n, -1)
        on = i < num_acc.unsqueeze(1)
        dst_rows = torch.where(on, cu[:-1].unsqueeze(1) + i, L)  # L = dropped
        src_rows = cu[:-1].unsqueeze(1) + path.clamp(min=0)
        src = torch.cat([src, src.new_zeros(1)])
        src.scatter_(0, dst_rows.reshape(-1), src_rows.reshape(-1))
        acc = Accepted(path, num_acc, src[:L], n)
        self.accepted = acc
        return sampled, acc

    def take_accepted(self) -> Accepted | None:
        acc, self.accepted = self.accepted, None
        return acc


def needs_chain(sampling_params) -> str | None:
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
