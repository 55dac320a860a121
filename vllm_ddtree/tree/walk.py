"""Batched, sync-free tree walk: follow the child equal to the target's token."""

from __future__ import annotations

import torch

from .build import DraftTree


def walk_tree(
    tree: DraftTree, target_token_ids: torch.Tensor
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
        on_path = ok & (par == 0)
        ones = torch.ones((R, 1), dtype=torch.bool, device=dev)
        for _ in range(D - 1):  # each round extends the accepted path by one depth
            on_path = ok & torch.gather(torch.cat([ones, on_path], dim=1), 1, par)
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
