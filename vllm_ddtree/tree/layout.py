"""Verify-pass metadata from a DraftTree, and the KV compaction plan from a walk.

Verify row 0 of a request is its root (the bonus token of the previous step); row
``j + 1`` is tree node ``j``.  KV slots stay linear (row ``i`` -> slot ``base + i``);
only RoPE positions follow the tree (``root position + depth``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .build import DraftTree


@dataclass
class TreeLayout:
    positions: torch.Tensor  # [R, 1 + W] int64: root position + depth
    depths: torch.Tensor  # [R, 1 + W] int64 (root 0; unused rows 0)
    parents: torch.Tensor  # [R, 1 + W] int64 verify-row parent (root and unused: -1)
    ancestor_bits: torch.Tensor  # [R, 1 + W, ceil((1 + W) / 32)] int32
    num_rows: torch.Tensor  # [R] int64: 1 + num_nodes

    def dense_mask(self) -> torch.Tensor:
        """``[R, 1 + W, 1 + W]`` bool: row q may attend to verify row k."""
        n = self.positions.shape[1]
        k = torch.arange(n, device=self.positions.device)
        words = self.ancestor_bits[..., k // 32].to(torch.int64)
        return ((words >> (k % 32)) & 1).bool()


def tree_layout(
    tree: DraftTree,
    root_positions: torch.Tensor,  # [R] position of each request's root row
) -> TreeLayout:
    """Positions and the ancestor-or-self relation of every verify row.

    Unused rows (beyond ``num_nodes``) see only themselves, so every row has a
    non-empty attention set.
    """
    R, W = tree.token_ids.shape
    n = W + 1
    dev = tree.token_ids.device
    zeros = torch.zeros((R, 1), dtype=torch.int64, device=dev)
    depths = torch.cat([zeros, tree.depths], dim=1)
    parents = torch.cat([zeros - 1, tree.parents], dim=1)
    positions = root_positions.to(torch.int64).view(R, 1) + depths

    words = (n + 31) // 32
    rows = torch.arange(n, device=dev)
    onehot = torch.zeros((R, n, words), dtype=torch.int64, device=dev)
    onehot[:, rows, rows // 32] = (1 << (rows % 32)).expand(R, n)
    # ancestor-or-self bits by pointer doubling: log2(D) rounds of "or my jump's bits"
    bits = onehot
    jump = torch.where(parents >= 0, parents, rows.expand(R, n))
    for _ in range(max(1, tree.max_depth.bit_length())):
        bits = bits | torch.gather(bits, 1, jump.unsqueeze(-1).expand(R, n, words))
        jump = torch.gather(jump, 1, jump)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return TreeLayout(positions, depths, parents, bits, tree.num_nodes + 1)


@dataclass
class CompactionPlan:
    """Move verify row ``src_rows[r, i]`` to row ``dst_rows[r, i]`` where ``moves``."""

    src_rows: torch.Tensor  # [R, D + 1] int64
    dst_rows: torch.Tensor  # [R, D + 1] int64
    moves: torch.Tensor  # [R, D + 1] bool: accepted and not already in place


def compaction_plan(
    accepted_nodes: torch.Tensor,  # [R, D + 1] int64 accepted verify rows, root-first
    num_accepted: torch.Tensor,  # [R] int64 their count, root included
) -> CompactionPlan:
    """Where each accepted verify row's KV entries go: row ``accepted_nodes[r, i]`` to
    row ``i``; both arguments as :func:`~vllm_ddtree.tree.walk.walk_tree` returns them.
    A destination never follows its source, so gathering every source before writing
    makes overlapping moves safe."""
    R, L = accepted_nodes.shape
    dst = torch.arange(L, device=accepted_nodes.device).expand(R, L)
    live = dst < num_accepted.unsqueeze(1)
    src = torch.where(live, accepted_nodes, dst)
    return CompactionPlan(src, dst.contiguous(), live & (src != dst))
