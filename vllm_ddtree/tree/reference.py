"""Plain-Python references for the tree core (the oracles of the tests).

``build_tree_heap`` is the paper's Algorithm 1 written as directly as possible: a heap
of rank tuples, one pop per node, each pop pushing the next-ranked sibling and the first
child.  Scores are float32 sums, accumulated root to leaf as on the device.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from .build import sanitized_logits


def depth_rankings(
    draft_logits: torch.Tensor,  # [D, V] one request's draft logits
    k: int,
) -> tuple[list[list[int]], list[list[np.float32]]]:
    """For one request: per depth the ``k`` best token ids (logit desc, id asc)
    and their float32 log-probabilities."""
    x = sanitized_logits(draft_logits)
    lse = torch.logsumexp(x, dim=-1)
    toks, lps = [], []
    for d in range(x.shape[0]):
        row = x[d].tolist()
        order = sorted(range(len(row)), key=lambda t: (-row[t], t))[:k]
        lp = (x[d, order] - lse[d]).numpy().astype(np.float32)
        lp = np.where(np.isnan(lp), np.float32(-np.inf), lp)
        toks.append(order)
        lps.append([np.float32(v) for v in lp])
    return toks, lps


def build_tree_heap(
    draft_logits: torch.Tensor,  # [D, V] one request's draft logits
    budget: int,
) -> list[tuple[int, int, int]]:
    """Reference tree for one request: ``[(token, parent, depth), ...]`` in pop order.

    Heap key: ``(-score, depth, pop index of the parent, token rank)``.
    """
    D, V = draft_logits.shape
    if budget <= 0 or D == 0 or V == 0:
        return []
    k = min(budget, V)
    toks, lps = depth_rankings(draft_logits, k)
    zero = np.float32(0.0)
    heap = [(-(zero + lps[0][0]), 1, -1, 0, zero)]
    out: list[tuple[int, int, int]] = []
    while heap and len(out) < budget:
        neg, depth, parent, rank, parent_score = heapq.heappop(heap)
        me = len(out)
        out.append((toks[depth - 1][rank], parent + 1, depth))
        score = -neg
        if rank + 1 < k:
            s = np.float32(parent_score + lps[depth - 1][rank + 1])
            heapq.heappush(heap, (-s, depth, parent, rank + 1, parent_score))
        if depth < D:
            s = np.float32(score + lps[depth][0])
            heapq.heappush(heap, (-s, depth + 1, me, 0, score))
    return out


def _ranking(logits: torch.Tensor, k: int) -> tuple[list[int], list[np.float32]]:
    """One distribution's ``k`` best token ids (logit desc, id asc) and their float32
    log-probabilities."""
    x = sanitized_logits(logits)
    lse = torch.logsumexp(x, dim=-1)
    row = x.tolist()
    order = sorted(range(len(row)), key=lambda t: (-row[t], t))[:k]
    lp = (x[order] - lse).numpy().astype(np.float32)
    return order, [np.float32(-np.inf) if np.isnan(v) else np.float32(v) for v in lp]


def build_conditioned_tree_heap(
    base_logits: torch.Tensor,  # [D, V_draft] one request's base logits
    root_token: int,
    markov_w1: torch.Tensor,  # [V_target, r]
    markov_w2: torch.Tensor,  # [V_draft, r]
    budget: int,
    draft_to_target: list[int] | None = None,
) -> list[tuple[int, int, int]]:
    """Reference tree with parent-conditioned children (a DSpark drafter): node ``n``'s
    children are ranked by ``base_logits[depth(n)] + markov_w1[token(n)] @ markov_w2.T``
    (the root's by the root token's).  ``[(target token, parent, depth), ...]`` in pop
    order; heap key ``(-score, depth, pop index of the parent, token rank)``."""
    D, V = base_logits.shape
    if budget <= 0 or D == 0 or V == 0:
        return []
    k = min(budget, V)
    to_target = (lambda t: t) if draft_to_target is None else draft_to_target.__getitem__

    def children(depth: int, prev_token: int) -> tuple[list[int], list[np.float32]]:
        bias = markov_w1[prev_token].float() @ markov_w2.float().T  # [V_draft]
        return _ranking(base_logits[depth - 1].float() + bias, k)

    zero = np.float32(0.0)
    ranked = {-1: children(1, root_token)}  # pop index -> its children's ranking
    heap = [(-(zero + ranked[-1][1][0]), 1, -1, 0, zero)]
    out: list[tuple[int, int, int]] = []
    while heap and len(out) < budget:
        neg, depth, parent, rank, parent_score = heapq.heappop(heap)
        toks, lps = ranked[parent]
        me = len(out)
        out.append((to_target(toks[rank]), parent + 1, depth))
        if rank + 1 < k:
            s = np.float32(parent_score + lps[rank + 1])
            heapq.heappush(heap, (-s, depth, parent, rank + 1, parent_score))
        if depth < D:
            ranked[me] = children(depth + 1, out[-1][0])
            s = np.float32(-neg + ranked[me][1][0])
            heapq.heappush(heap, (-s, depth + 1, me, 0, -neg))
    return out


def walk_tree_ref(nodes: list[tuple[int, int, int]], target: list[int]) -> tuple[list[int], int]:
    """Follow the child whose token equals the target's token at the current node.

    ``target[0]`` is the target's token at the root, ``target[j + 1]`` at node ``j``.
    Returns (accepted node indices root-first, 0 = root, j + 1 = node j; bonus token).
    """
    path = [0]
    cur = 0
    while True:
        want = target[cur]
        nxt = [j + 1 for j, (t, p, _) in enumerate(nodes) if p == cur and t == want]
        if not nxt:
            return path, want
        cur = nxt[0]
        path.append(cur)
