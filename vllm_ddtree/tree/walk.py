"""Batched, sync-free tree walk: follow the child equal to the target's token."""

from __future__ import annotations

import torch

from .build import DraftTree


def walk_tree(
    tree: DraftTree,
    target_token_ids: torch.Tensor,  # [R, W + 1]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk every request's tree along the target's own tokens.

    Args:
        tree: the drafted trees (``W = tree.width`` slots each).
        target_token_ids: ``[R, W + 1]``; column 0 is the target's token at the root,
            column ``j + 1`` its token at node ``j``.

    Returns:
        ``accepted_nodes [R, D + 1]``: accepted nodes root-first (0 = root, ``j + 1`` =
        node ``j``), -1 padded; ``num_accepted [R]``: their count, root included;
        ``bonus_token_ids [R]``: the target's token at the last accepted node.
    """
    R, W = tree.token_ids.shape
    D = tree.max_depth
    dev = tree.token_ids.device
    target = target_token_ids.to(torch.int64)
    if target.shape != (R, W + 1):
        raise ValueError(f"target_token_ids must be [{R}, {W + 1}], got {tuple(target.shape)}")
    acc = torch.full((R, D + 2), -1, dtype=torch.int64, device=dev)
    acc[:, 0] = 0
    if W > 0:
        live = tree.parents >= 0
        par = tree.parents.clamp(min=0)
        # A node matches when its token is what the target chose at its parent.
        ok = live & (tree.token_ids == torch.gather(target, 1, par))
        # on_path[j] = ok[j] and on_path[parent[j]], by pointer doubling over the
        # root-extended arrays: log2(D) rounds instead of D.
        ones = torch.ones((R, 1), dtype=torch.bool, device=dev)
        acc_ok = torch.cat([ones, ok], dim=1)
        jump = torch.cat([torch.zeros((R, 1), dtype=torch.long, device=dev), par], dim=1)
        for _ in range(max(1, D.bit_length())):
            acc_ok = acc_ok & torch.gather(acc_ok, 1, jump)
            jump = torch.gather(jump, 1, jump)
        on_path = acc_ok[:, 1:]
        col = torch.where(on_path, tree.depths, torch.full_like(tree.depths, D + 1))
        node = torch.arange(1, W + 1, device=dev).expand(R, W)
        acc.scatter_(1, col, torch.where(on_path, node, -1))
        acc[:, D + 1] = -1
        num_accepted = 1 + on_path.sum(dim=1)
    else:
        num_accepted = torch.ones((R,), dtype=torch.int64, device=dev)
    accepted = acc[:, : D + 1].contiguous()
    last = torch.gather(accepted, 1, (num_accepted - 1).unsqueeze(1))
    bonus = torch.gather(target, 1, last).squeeze(1)
    return accepted, num_accepted, bonus
