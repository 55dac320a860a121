"""Tree bookkeeping of the CPU path: the trees proposed at step t, kept until their
verify at t + 1, and the verify step in flight.

The scheduler carries only draft token ids, so the worker remembers each request's
tree (parents and depths) until it is verified.  Pure Python + torch; no vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from vllm_ddtree.tree import DraftTree


class ScheduledTree(NamedTuple):
    """One request's scheduled drafts as a tree (``n`` = number of scheduled drafts)."""

    token_ids: list[int]  # [n] a node's token; -1 for a slot past the tree (never accepted)
    parents: list[int]  # [n] 0 = root, j + 1 = node j; -1 for a slot past the tree
    depths: list[int]  # [n] 1..D; 0 for a slot past the tree


@dataclass
class _StoredTree:
    draft_token_ids: list[int]  # [W] the draft ids the scheduler got (slots past the tree: 0)
    parents: list[int]  # [W] as in DraftTree (slots past the tree: -1)
    depths: list[int]  # [W] as in DraftTree (slots past the tree: 0)


class TreeStore:
    """Trees proposed for the next step, keyed by request id."""

    def __init__(self) -> None:
        self._trees: dict[str, _StoredTree] = {}

    def put(self, req_ids: Sequence[str], tree: DraftTree) -> None:
        """Store every request's tree (row ``r`` of ``tree`` is ``req_ids[r]``)."""
        draft_token_ids = tree.token_ids.clamp(min=0).tolist()
        parents = tree.parents.tolist()
        depths = tree.depths.tolist()
        for row, req_id in enumerate(req_ids):
            self._trees[req_id] = _StoredTree(draft_token_ids[row], parents[row], depths[row])

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the trees of these requests (finished, or drafted as a chain)."""
        for req_id in req_ids:
            self._trees.pop(req_id, None)

    def lookup(self, req_id: str, draft_token_ids: Sequence[int]) -> ScheduledTree:
        """The scheduled drafts as a tree: a prefix of the stored tree (the scheduler may
        cut it; a prefix of a topological order is a tree), or a chain when the drafts
        are not such a prefix (e.g. after preemption) or no tree was stored.

        Slots past the tree's last node (only with tiny vocabularies, or a tree emptied
        for non-finite draft logits) are scheduled with token 0 but get token -1 here:
        the walk never accepts them."""
        num_drafts = len(draft_token_ids)
        stored = self._trees.get(req_id)
        if (stored is not None and len(stored.draft_token_ids) >= num_drafts
                and stored.draft_token_ids[:num_drafts] == list(draft_token_ids)):
            parents = stored.parents[:num_drafts]
            token_ids = [token if parent >= 0 else -1
                         for token, parent in zip(draft_token_ids, parents)]
            return ScheduledTree(token_ids, parents, stored.depths[:num_drafts])
        return ScheduledTree(list(draft_token_ids), list(range(num_drafts)),
                             list(range(1, num_drafts + 1)))


def stack_trees(trees: Sequence[ScheduledTree]) -> DraftTree:
    """One :class:`DraftTree` of ``len(trees)`` rows for the walk and the verify layout,
    padded to the widest; ``num_nodes`` = each request's scheduled drafts."""
    num_trees = len(trees)
    width = max((len(tree.token_ids) for tree in trees), default=0)

    def padded(per_tree: list[list[int]], fill: int) -> torch.Tensor:  # [num_trees, width]
        rows = [values + [fill] * (width - len(values)) for values in per_tree]
        return torch.tensor(rows, dtype=torch.int64).view(num_trees, width)

    depths = padded([tree.depths for tree in trees], 0)
    return DraftTree(
        token_ids=padded([tree.token_ids for tree in trees], -1),
        parents=padded([tree.parents for tree in trees], -1),
        depths=depths,
        num_nodes=torch.tensor([len(tree.token_ids) for tree in trees], dtype=torch.int64),
        scores=torch.zeros(depths.shape, dtype=torch.float32),
        max_depth=int(depths.max()) if depths.numel() else 0,
    )


@dataclass
class VerifyRequest:
    """One request's tree inside the current verify batch."""

    index: int  # request index in the batch
    start: int  # first verify row (the root) in the flattened token batch
    num_nodes: int  # drafted nodes scheduled (the root excluded)
    prefix_len: int  # tokens before the root = the root's position
    # [num_nodes + 1, prefix_len + num_nodes + 1] bool: the whole prefix, then the
    # verify rows each row may see; None for a chain (vLLM's causal rows are exact)
    verify_mask: torch.Tensor | None

    @property
    def is_chain(self) -> bool:
        """Node j's parent is node j - 1: causal attention is already exact."""
        return self.verify_mask is None


@dataclass
class VerifyKV:
    """One target layer's K/V of the verify rows, kept for the compaction after the walk."""

    layer: Any  # vLLM's attention layer
    impl: Any  # its CPU attention impl (writes the cache)
    kv_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, 2 * head_size]
    key: torch.Tensor  # [num_verify_rows, num_kv_heads, head_size]
    value: torch.Tensor  # [num_verify_rows, num_kv_heads, head_size]
    slot_mapping: torch.Tensor  # [num_verify_rows] each verify row's KV slot


@dataclass
class VerifyStep:
    """The tree verify of one step: built by the runner before the target forward,
    completed by the attention layers (:meth:`keep_kv`), consumed by the runner's
    sampler (:meth:`kept_kv`)."""

    requests: list[VerifyRequest]
    tree: DraftTree  # [len(requests), W]: row r is requests[r]'s tree
    rows: torch.Tensor  # [num_verify_rows] every request's verify rows (root first), in order
    # layer name -> its verify rows' K/V; only through keep_kv / kept_kv
    _kv_rows: dict[str, VerifyKV] = field(default_factory=dict, init=False, repr=False)

    def keep_kv(self, layer_name: str, kv: VerifyKV) -> None:
        """Keep target layer ``layer_name``'s K/V of the verify rows for the compaction
        (one entry per layer: a layer run again this step replaces its own)."""
        self._kv_rows[layer_name] = kv

    def kept_kv(self) -> Iterator[VerifyKV]:
        """The K/V kept by every target layer this step, in the order they ran."""
        return iter(self._kv_rows.values())


class VerifyContext:
    """The verify step in flight of one runner: the runner sets :attr:`step` around the
    target forward, the attention impls of its target layers read it."""

    def __init__(self) -> None:
        self.step: VerifyStep | None = None
