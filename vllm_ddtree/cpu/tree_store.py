"""Per-request tree bookkeeping between the propose of step t and the verify of t + 1.

The scheduler carries only draft token ids, so the worker remembers each request's
tree (parents and depths) until it is verified.  Pure Python + torch; no vLLM import.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from vllm_ddtree.tree import DraftTree


@dataclass
class StoredTree:
    tokens: list[int]
    parents: list[int]  # 0 = root, j + 1 = node j
    depths: list[int]


@dataclass
class VerifyRequest:
    """One request's tree inside the current verify batch."""

    index: int  # request index in the batch
    start: int  # first verify row (the root) in the flattened token batch
    num_nodes: int  # drafted nodes scheduled (the root excluded)
    prefix_len: int  # tokens before the root = the root's position
    tokens: list[int]
    parents: list[int]
    depths: list[int]

    @property
    def is_chain(self) -> bool:
        """Node j's parent is node j - 1: causal attention is already exact."""
        return all(p == j for j, p in enumerate(self.parents))

    def ancestor_mask(self) -> torch.Tensor:
        """``[n + 1, n + 1]`` bool: verify row q may see verify row k."""
        n = self.num_nodes + 1
        mask = torch.eye(n, dtype=torch.bool)
        for j, p in enumerate(self.parents):  # parents precede children
            mask[j + 1] |= mask[p]
        return mask

    @functools.cached_property
    def verify_mask(self) -> torch.Tensor:
        """``[n + 1, prefix_len + n + 1]`` bool: the whole prefix, then the ancestors
        (built once per step, used by every target layer)."""
        n = self.num_nodes + 1
        return torch.cat([torch.ones(n, self.prefix_len, dtype=torch.bool),
                          self.ancestor_mask()], 1)


@dataclass
class VerifyStep:
    requests: list[VerifyRequest]
    target_layers: frozenset[str]
    # filled by the attention layers: layer name -> (layer, impl, kv_cache, key rows,
    # value rows, slot mapping rows), rows in the order of `requests`
    kv_rows: dict = field(default_factory=dict)
    # filled by the verifier: request index -> accepted verify rows (root first)
    paths: dict[int, list[int]] = field(default_factory=dict)

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        """Every request's verify rows (root first), in the order of ``requests``."""
        return torch.cat([torch.arange(r.start, r.start + r.num_nodes + 1)
                          for r in self.requests])


class TreeStore:
    """Trees proposed for the next step, keyed by request id."""

    def __init__(self) -> None:
        self.trees: dict[str, StoredTree] = {}
        self.step: VerifyStep | None = None
        self.last_paths: dict[int, tuple[int, list[int]]] = {}  # index -> (start, path)

    def put(self, req_ids: list[str], tree: DraftTree) -> None:
        """Store every request's tree.  Unused slots (a tree smaller than its width,
        only with tiny vocabularies) become token-0 children of the root: real nodes,
        verified like any other."""
        tok = tree.token_ids.clamp(min=0).tolist()
        par = tree.parents.clamp(min=0).tolist()
        dep = tree.depths.clamp(min=1).tolist()
        for r, req_id in enumerate(req_ids):
            self.trees[req_id] = StoredTree(tok[r], par[r], dep[r])

    def put_chains(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.trees.pop(req_id, None)

    def lookup(self, req_id: str, drafts: list[int]) -> tuple[list[int], list[int]]:
        """(parents, depths) of the scheduled drafts; a chain when the drafts are not
        a prefix of the stored tree (e.g. after preemption) or no tree was stored."""
        n = len(drafts)
        t = self.trees.get(req_id)
        if t is not None and len(t.tokens) >= n and t.tokens[:n] == list(drafts):
            return t.parents[:n], t.depths[:n]
        return list(range(n)), list(range(1, n + 1))

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self.trees.pop(req_id, None)


def walk_lists(tokens: list[int], parents: list[int], target: list[int]) -> tuple[list[int], int]:
    """Accepted verify rows (root first) and the bonus token for one request."""
    children: dict[tuple[int, int], int] = {}
    for j, (t, p) in enumerate(zip(tokens, parents)):
        children[(p, t)] = j + 1
    path, cur = [0], 0
    while (cur, target[cur]) in children:
        cur = children[(cur, target[cur])]
        path.append(cur)
    return path, target[cur]
