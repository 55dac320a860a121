"""DDTree trees whose branches are conditioned on their parent (DSpark-style drafters).

A DSpark drafter gives per depth ``d`` base logits ``base[d]`` (draft vocabulary) and a
low-rank Markov head: the logits of the token after ``t`` are ``base[d] + bias(t)``,
``bias(t) = markov_w1[t] @ markov_w2.T`` (``markov_w1`` indexed by target token id,
``markov_w2`` by draft token id).  Depth 1 is conditioned on the root (the request's
last committed token).  So every node has its own child distribution, where a DFlash
tree gives all nodes of a depth the same one.

The tree is again the ``B`` best prefixes under the key of :mod:`.build`, ``(-score,
depth, key rank of the parent, token rank)``, with the token rank taken within the
parent's own distribution (logit descending, ties by lower draft id) and a prefix's
score the float32 sum of its nodes' log-probabilities.  A path is never more probable
than its prefix, so the set is prefix-closed and the per-depth argument of :mod:`.build`
holds unchanged: depth ``d + 1``'s top-``B`` lies among the children of depth ``d``'s
top-``B``, a parent at position ``i`` contributing its ``B // (i + 1)`` best children.
The only new work is one distribution per kept parent: ``[R, B, V]`` logits per depth,
of which the build needs each parent's log-sum-exp and ``B // (i + 1)`` best entries
(the Triton build never writes the logits out).  Most of those parents cannot have
descendants in the tree: a node's descendants rank below it (no higher score, greater
depth), so only a node among the ``B - 1`` best found so far can have one.  The Triton
build skips the others' distributions from the third depth on (a trained drafter's
trees are deep and narrow: at budget 15 the shipped SmolLM2 DSpark drafter's requests
have a parent left at 4.5 of 15 depths on average, ``benchmarks.dspark_tree_shape``),
which changes no node of finite score (a tree that must hold nodes of score -inf,
logits with fewer than ``B`` finite paths, may hold other ones).

:func:`build_conditioned_tree` picks by :func:`~vllm_ddtree.kernels.triton_utils.use_triton`
between torch (:func:`build_conditioned_tree_torch`, the reference) and Triton
(:func:`build_conditioned_tree_triton`): three launches a depth (every parent's best
children and log-sum-exp straight from the Markov factors,
:mod:`vllm_ddtree.kernels.conditioned_candidates`, then the selection) and one that
assembles the trees.  Oracle:
:func:`vllm_ddtree.tree.reference.build_conditioned_tree_heap`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from vllm_ddtree.kernels.build_tables import (
    cached_int64_tensor,
    pack_keys,
    pair_layout,
    pair_tensors,
    unpack_scores,
    unpack_ties,
)
from vllm_ddtree.kernels.conditioned_candidates import (
    BOUND_TOKENS,
    bound_tokens_triton,
    conditioned_candidates_triton,
)
from vllm_ddtree.kernels.tree_build import (
    ConditionedSelection,
    conditioned_assemble_triton,
    select_children_supported,
    select_children_triton,
)
from vllm_ddtree.kernels.triton_utils import use_triton

from .build import DraftTree, assemble_tree, depth_candidates


class MarkovHead(NamedTuple):
    """A DSpark drafter's low-rank Markov head: the bias on the logits of the token after
    target token ``t`` is ``scale * w1[t] @ w2.T`` (float32 sums of the factors)."""

    w1: torch.Tensor  # [V_target, r] indexed by target token id
    w2: torch.Tensor  # [V_draft, r] (same dtype as w1)
    scale: float = 1.0  # the drafter's logit scale


def markov_bias(
    head: MarkovHead,
    prev_tokens: torch.Tensor,  # [...] int64 target token ids
) -> torch.Tensor:  # [..., V_draft] float32
    """The Markov head's bias on the logits of the token after each of ``prev_tokens``."""
    emb = head.w1[prev_tokens].float()  # [..., r]
    bias = emb @ head.w2.float().T
    return bias if head.scale == 1.0 else bias * head.scale


def parent_needs(k: int, width: int, n: int) -> list[int]:
    """How many best children each of a depth's ``n + 1`` parents can contribute: the
    kept node at position ``i`` ``min(k, width // (i + 1))`` (:func:`pair_layout`),
    the chain's token (column ``n``) one."""
    return [min(k, width // (i + 1)) for i in range(n)] + [1]


def conditioned_candidates_torch(
    base: torch.Tensor,  # [R, V_draft] the depth's base logits
    parents: torch.Tensor,  # [R, P] int64 target token id of each parent
    head: MarkovHead,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of :func:`~vllm_ddtree.kernels.conditioned_candidates.
    conditioned_candidates_triton`: each parent's ``k`` best children
    (``logprobs [R, P, k]``, draft ids ``[R, P, k]``, ``nonfinite [R, P]``), the
    depth's logits ``base + bias(parent)`` summed in float32 (inside the top-k kernel
    on CUDA, never written out as ``[R, P, V]`` logits)."""
    R, P = parents.shape
    bias = markov_bias(head, parents.reshape(-1)).view(R, P, -1)
    return depth_candidates(bias, k, inplace=True, with_nonfinite=True, add=base)


def build_conditioned_tree(
    base_logits: torch.Tensor,  # [R, D, V_draft]
    root_tokens: torch.Tensor,  # [R] int64 target token id at each tree's root
    head: MarkovHead,
    budget: int,
    draft_to_target: torch.Tensor | None = None,  # [V_draft] int64, None: same vocabulary
) -> DraftTree:
    """The best-first DDTree of every request with parent-conditioned children.

    Node tokens are target ids (``draft_to_target`` maps a reduced draft vocabulary;
    the next depth's bias reads the mapped id, as the drafter's own sampler does).  Same
    layout, determinism and tie rules as :func:`vllm_ddtree.tree.build.build_tree`; a
    Python loop over depths only, no device-to-host copy.  ``top1`` is the drafter's own
    greedy chain (each depth's best token after the chain's previous one, which the tree
    may not hold), ``nonfinite`` flags requests whose logits held NaN/inf (base logits
    at every depth; the Markov bias of the parents whose children the build computes:
    every parent in torch, in Triton only those that can reach the tree).

    :func:`build_conditioned_tree_triton` where
    :func:`~vllm_ddtree.kernels.triton_utils.use_triton` holds and its pair sort fits one
    program (``benchmarks.core_gpu --conditioned`` times the two: docs/benchmarks/core-gpu.md,
    "Conditioned (DSpark) tree build"), else :func:`build_conditioned_tree_torch`; the same
    tree where the Markov products are exact in float32 (bf16 factors can round a
    near-tie the other way: the two sum them in different orders).
    """
    width = _width(base_logits, budget)
    D, V = base_logits.shape[1:]
    if use_triton(base_logits) and select_children_supported(D, min(width, V), width):
        return build_conditioned_tree_triton(base_logits, root_tokens, head, budget,
                                             draft_to_target)
    return build_conditioned_tree_torch(base_logits, root_tokens, head, budget,
                                        draft_to_target)


def build_conditioned_tree_torch(
    base_logits: torch.Tensor,  # [R, D, V_draft]
    root_tokens: torch.Tensor,  # [R] int64 target token id at each tree's root
    head: MarkovHead,
    budget: int,
    draft_to_target: torch.Tensor | None = None,  # [V_draft] int64, None: same vocabulary
) -> DraftTree:
    """Reference of :func:`build_conditioned_tree` (same arguments): each depth's
    candidates by :func:`conditioned_candidates_torch` and its selection in torch (one
    ``topk`` of packed keys), on any device and any width."""
    width = _width(base_logits, budget)
    R, D, V = base_logits.shape
    if width == 0 or R == 0 or D == 0 or V == 0:
        return DraftTree.empty(R, width, D, base_logits.device)
    return _build_torch(base_logits, root_tokens, head, width, draft_to_target)


def build_conditioned_tree_triton(
    base_logits: torch.Tensor,  # [R, D, V_draft]
    root_tokens: torch.Tensor,  # [R] int64 target token id at each tree's root
    head: MarkovHead,
    budget: int,
    draft_to_target: torch.Tensor | None = None,  # [V_draft] int64, None: same vocabulary
) -> DraftTree:
    """The Triton side of :func:`build_conditioned_tree` (same arguments): each depth in
    three launches, the parents' candidates
    (:func:`~vllm_ddtree.kernels.conditioned_candidates.conditioned_candidates_triton`)
    and the selection (:func:`~vllm_ddtree.kernels.tree_build.select_children_triton`),
    then one that assembles the trees
    (:func:`~vllm_ddtree.kernels.tree_build.conditioned_assemble_triton`).  Raises
    ``ValueError`` where Triton is missing or a depth's pair sort does not fit one
    program (:func:`~vllm_ddtree.kernels.tree_build.select_children_supported`)."""
    width = _width(base_logits, budget)
    R, D, V = base_logits.shape
    if width == 0 or R == 0 or D == 0 or V == 0:
        return DraftTree.empty(R, width, D, base_logits.device)
    if not select_children_supported(D, min(width, V), width):
        raise ValueError(f"build_conditioned_tree_triton: needs Triton and a pair sort "
                         f"that fits one program (depth {D}, budget {width})")
    return _build_triton(base_logits, root_tokens, head, width, draft_to_target)


def _width(base_logits: torch.Tensor, budget: int) -> int:
    """The trees' width; checks the arguments (host only)."""
    if base_logits.dim() != 3:
        raise ValueError(f"base_logits must be [R, D, V], got {tuple(base_logits.shape)}")
    width = int(budget)
    if width < 0:
        raise ValueError(f"build_conditioned_tree: budget must be >= 0, got {width}")
    return width


def _build_torch(
    base_logits: torch.Tensor,  # [R, D, V_draft], none of R, D, V zero
    root_tokens: torch.Tensor,  # [R] int64
    head: MarkovHead,
    width: int,  # > 0
    draft_to_target: torch.Tensor | None,  # [V_draft] int64
) -> DraftTree:
    """:func:`build_conditioned_tree_torch`'s build: each depth's candidates and
    selection in torch, then :func:`~vllm_ddtree.tree.build.assemble_tree`."""
    R, D, V = base_logits.shape
    dev = base_logits.device
    K = min(width, V)

    def to_target(ids: torch.Tensor) -> torch.Tensor:
        return ids if draft_to_target is None else draft_to_target[ids]

    # depth 1: one distribution per request, conditioned on the root
    lp, tok, bad = conditioned_candidates_torch(base_logits[:, 0], root_tokens.view(R, 1),
                                                head, K)  # [R, 1, K]
    scores, tokens = [lp[:, 0, :]], [to_target(tok[:, 0, :])]
    chain, bads = [tokens[0][:, 0]], [bad]
    parent_pos = [torch.full((R, K), -1, dtype=torch.int64, device=dev)]
    pi_all, pr_all = pair_tensors(D, K, width, str(dev))
    npairs = pair_layout(D, K, width)[2]
    # every kept node of depth d - 1 is a parent with its own distribution; the chain's
    # last token rides along as one more parent (column n), outside the pairs
    parents = torch.cat([tokens[0], chain[0].unsqueeze(1)], dim=1)  # [R, n + 1]
    for d in range(1, D):
        n = tokens[-1].shape[1]
        lp, tok, bad = conditioned_candidates_torch(base_logits[:, d], parents, head, K)
        bads.append(bad)
        chain.append(to_target(tok[:, n, 0]))
        pi, pr = pi_all[: npairs[d]], pr_all[: npairs[d]]  # parents in depth d-1's set
        cand = scores[-1][:, pi] + lp[:, pi, pr]  # [R, P] float32, parent first
        top = torch.topk(pack_keys(cand, pi * K + pr), min(width, pi.numel()),
                         dim=1).values
        code = unpack_ties(top)
        ppos, rank = code // K, code % K
        kept = to_target(tok[:, :n].flatten(1).gather(1, ppos * K + rank))
        scores.append(unpack_scores(top))
        if d + 1 < D:
            parents = torch.cat([kept, chain[-1].unsqueeze(1)], dim=1)
        parent_pos.append(ppos)
        tokens.append(kept)
    per_req = torch.full((R,), width, dtype=torch.int64, device=dev)
    tree = assemble_tree(scores, parent_pos, tokens, per_req, DraftTree.empty(R, width, D, dev))
    return dataclasses.replace(tree, top1=torch.stack(chain, dim=1),
                               nonfinite=torch.cat(bads, dim=1).any(dim=1))


def _build_triton(
    base_logits: torch.Tensor,  # [R, D, V_draft], none of R, D, V zero
    root_tokens: torch.Tensor,  # [R] int64
    head: MarkovHead,
    width: int,  # > 0, the pair sorts fit one program
    draft_to_target: torch.Tensor | None,  # [V_draft] int64
) -> DraftTree:
    """:func:`build_conditioned_tree_triton`'s build: per depth the parents' candidates
    and the selection (three launches), then one launch assembles the trees from the
    sets the selections kept."""
    R, D, V = base_logits.shape
    dev = base_logits.device
    K = min(width, V)
    w1, w2 = head.w1, head.w2.to(head.w1.dtype)
    # [D, R, NB] each depth's high base tokens: the kernel's pruning bound
    top_ids = bound_tokens_triton(base_logits.contiguous(), min(V, max(K, BOUND_TOKENS)))
    state = ConditionedSelection.empty(R, D, width, dev)
    pi_all, pr_all = pair_tensors(D, K, width, str(dev), torch.int32)
    npairs = pair_layout(D, K, width)[2]
    # depth 1: one distribution per request, conditioned on the root
    lp0, tok0, bad0 = conditioned_candidates_triton(
        base_logits[:, 0], root_tokens.view(R, 1), cached_int64_tensor((K,), str(dev)),
        top_ids[0], w1, w2, head.scale, K)  # [R, 1, K]
    scores = lp0[:, 0, :]
    # every kept node of depth d - 1 is a parent with its own distribution; the chain's
    # last token rides along as one more parent (column n), outside the pairs
    first = tok0[:, 0, :] if draft_to_target is None else draft_to_target[tok0[:, 0, :]]
    parents = torch.cat([first, first[:, :1]], dim=1)  # [R, n + 1]
    for d in range(1, D):
        need = cached_int64_tensor(tuple(parent_needs(K, width, parents.shape[1] - 1)),
                                   str(dev))
        # from depth 3 on, only the parents that can still be in the tree
        pruned = {} if d < 2 else {"parent_scores": scores, "theta": state.theta}
        lp, tok, bad = conditioned_candidates_triton(base_logits[:, d], parents, need,
                                                     top_ids[d], w1, w2, head.scale, K,
                                                     **pruned)
        scores, parents = select_children_triton(scores, lp, tok, bad, pi_all, pr_all,
                                                 npairs[d], width, d, state, V,
                                                 draft_to_target)
    token_ids, parent_idx, depths, node_scores, num_nodes, top1, nonfinite = (
        conditioned_assemble_triton(lp0[:, 0, :], first, bad0[:, 0], state, width))
    return DraftTree(token_ids, parent_idx, depths, num_nodes, node_scores, D, top1,
                     nonfinite)
