"""Exact, batched, sync-free construction of DDTree draft trees.

The tree is the node set of the paper's Algorithm 1: the ``B`` prefixes with the
highest score, where a prefix ``(r_1, ..., r_d)`` of per-depth token ranks scores
``sum_i lp_i[r_i]`` (``lp_i`` = log-softmax of depth ``i``'s draft logits, summed in
float32, left to right).  A best-first heap enumerates nodes in increasing order of the
key

    (-score, depth, key rank of the parent, token rank)

(see :func:`vllm_ddtree.tree.reference.build_tree_heap`).  The key never decreases from a
parent to its first child or from a node to its next sibling, so the heap's ``B`` pops
are exactly the ``B`` smallest keys, and this module computes that set directly:

* Within one depth, a node's key is smaller than that of every node whose parent comes
  later in key order and whose token rank is larger.  Hence a node with parent at
  per-depth position ``i`` and token rank ``r`` is preceded by at least
  ``(i + 1) * (r + 1) - 1`` nodes of its own depth, and can be among the ``B`` best of
  its depth only if ``(i + 1) * (r + 1) <= B``.  The per-depth top-``B`` set is therefore
  the top-``B`` of ``~B ln B`` candidate pairs formed from the previous depth's top-``B``.
* A node of the global top-``B`` is among the top-``B`` of its own depth, so the global
  top-``B`` is the top-``B`` of the union of the per-depth sets (``D * B`` candidates).

Keys are packed into int64 (order-preserving float32 bits above a tie code), so each
selection is one ``torch.topk`` with no ties: identical inputs give identical trees on
every device and every tensor-parallel rank.  There is a Python loop over depths only;
no loop over requests or nodes, and no device-to-host copy.

Token ranks at each depth order tokens by sanitized logit (descending), ties by lower
token id.  Sanitizing: NaN counts as -inf, +inf as the input dtype's largest finite value.

Both stages, :func:`depth_candidates` and :func:`build_tree`, have a torch reference
(``*_torch``) and a Triton side (``*_triton``); the plain name picks one
(:func:`~vllm_ddtree.kernels.triton_utils.use_triton`).
"""

from __future__ import annotations

from dataclasses import dataclass
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
from vllm_ddtree.kernels.logsumexp import logsumexp_sanitize_triton
from vllm_ddtree.kernels.topk_lse import topk_lse_max_k, topk_lse_triton
from vllm_ddtree.kernels.tree_build import tree_build_triton, triton_build_supported
from vllm_ddtree.kernels.triton_utils import use_triton


@dataclass
class DraftTree:
    """A batch of draft trees, best-first (hence topological) node order.

    Node ``j`` of request ``r`` has token ``token_ids[r, j]``, parent ``parents[r, j]``
    (0 = the root, ``k + 1`` = node ``k``; always ``<= j``) and depth ``depths[r, j]``
    (1..D).  Slots ``j >= num_nodes[r]`` hold -1, -1 and 0.  ``scores`` holds each
    node's float32 log-probability under the drafter (-inf in unused slots).

    :func:`build_tree` also keeps two by-products of its pass over the draft logits
    (``None`` on trees from elsewhere): ``top1``, each depth's best token (the
    drafter's chain), and ``nonfinite``, whether a request's logits held a NaN or an inf
    (what :func:`drop_nonfinite` acts on).
    """

    token_ids: torch.Tensor  # [R, Bmax] int64
    parents: torch.Tensor  # [R, Bmax] int64
    depths: torch.Tensor  # [R, Bmax] int64
    num_nodes: torch.Tensor  # [R] int64
    scores: torch.Tensor  # [R, Bmax] float32
    max_depth: int  # D (static)
    top1: torch.Tensor | None = None  # [R, D] int64 each depth's best token
    nonfinite: torch.Tensor | None = None  # [R] bool the draft logits held NaN/inf

    @property
    def width(self) -> int:
        return self.token_ids.shape[1]

    @classmethod
    def empty(cls, num_reqs: int, width: int, max_depth: int,
              device: torch.device) -> DraftTree:
        """``num_reqs`` trees of ``width`` unused slots."""
        return cls(
            token_ids=torch.full((num_reqs, width), -1, dtype=torch.int64, device=device),
            parents=torch.full((num_reqs, width), -1, dtype=torch.int64, device=device),
            depths=torch.zeros((num_reqs, width), dtype=torch.int64, device=device),
            num_nodes=torch.zeros((num_reqs,), dtype=torch.int64, device=device),
            scores=torch.full((num_reqs, width), float("-inf"), dtype=torch.float32,
                              device=device),
            max_depth=max_depth,
        )

    def prefix(self, n: int) -> DraftTree:
        """The first ``n`` nodes of every tree: best-first, so the best ``n``-node trees
        (a node's parent always comes before it).  Views, no copy."""
        if n >= self.width:
            return self
        return DraftTree(self.token_ids[:, :n], self.parents[:, :n], self.depths[:, :n],
                         self.num_nodes.clamp(max=n), self.scores[:, :n], self.max_depth,
                         self.top1, self.nonfinite)


def nonfinite_requests(
    tree: DraftTree,
    draft_logits: torch.Tensor,  # [R, D, V]
) -> torch.Tensor:  # [R] bool
    """Requests whose draft logits hold a NaN or an inf: the build's own flag
    (``tree.nonfinite``, no second pass over the logits) where it kept one."""
    if tree.nonfinite is not None:
        return tree.nonfinite
    return ~torch.isfinite(draft_logits).flatten(1).all(dim=1)


def drop_nonfinite(
    tree: DraftTree,
    draft_logits: torch.Tensor,  # [R, D, V]
) -> torch.Tensor:
    """Empty the trees of requests whose draft logits ``[R, D, V]`` hold a NaN or an inf
    (a failing drafter): their verify step commits the target's bonus token only.

    :func:`build_tree` itself ranks such entries (NaN last, +inf first); this is the
    runners' policy on top of it.  In place, graph-capturable, no host sync.  Returns
    the bool mask ``[R]`` of emptied requests (:func:`nonfinite_requests`).
    """
    bad = nonfinite_requests(tree, draft_logits)
    rows = bad.unsqueeze(1)
    tree.token_ids.masked_fill_(rows, -1)
    tree.parents.masked_fill_(rows, -1)
    tree.depths.masked_fill_(rows, 0)
    tree.scores.masked_fill_(rows, float("-inf"))
    tree.num_nodes.masked_fill_(bad, 0)
    return bad


def sanitized_logits(draft_logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., V]
    """float32 copy with NaN -> -inf and +inf -> the input dtype's largest finite value."""
    x = draft_logits.float()
    dt = draft_logits.dtype if draft_logits.dtype.is_floating_point else torch.float32
    big = min(torch.finfo(dt).max, torch.finfo(torch.float32).max)
    return torch.nan_to_num(x, nan=float("-inf"), posinf=big, neginf=float("-inf"))


def depth_candidates(
    draft_logits: torch.Tensor,  # [R, D, V] any float dtype
    k: int,
    inplace: bool = False,
    topk_pruned: bool = True,
    with_nonfinite: bool = False,
    add: torch.Tensor | None = None,  # [R, V] shared by the R's D rows
) -> tuple[torch.Tensor, ...]:
    """Per depth, the ``k`` best tokens and their log-probabilities.

    Returns ``(logprobs [R, D, k] float32, token_ids [R, D, k] int64)``, ranked by logit
    descending, ties by lower token id; with ``with_nonfinite`` also ``nonfinite [R, D]
    bool`` (the depth's logits held a NaN or an inf).  ``add``: the logits are
    ``draft_logits.float() + add.float().unsqueeze(1)``.  ``inplace`` and
    ``topk_pruned`` are options of :func:`depth_candidates_triton` (the torch reference
    :func:`depth_candidates_torch` ignores them); every variant gives the same result.
    Picks one by :func:`~vllm_ddtree.kernels.triton_utils.use_triton`.
    """
    if use_triton(draft_logits):
        return depth_candidates_triton(draft_logits, k, inplace, topk_pruned, with_nonfinite,
                                       add)
    return depth_candidates_torch(draft_logits, k, with_nonfinite, add)


def depth_candidates_torch(
    draft_logits: torch.Tensor,  # [R, D, V] any float dtype
    k: int,
    with_nonfinite: bool = False,
    add: torch.Tensor | None = None,  # [R, V] shared by the R's D rows
) -> tuple[torch.Tensor, ...]:
    """Reference of :func:`depth_candidates`: float32 log-softmax of the sanitized
    logits and an exact top-``k`` (a stable sort's first ``k``), on any device."""
    if add is not None:
        draft_logits = draft_logits.float() + add.float().unsqueeze(1)
    nonfinite = ~torch.isfinite(draft_logits).all(dim=-1) if with_nonfinite else None
    x = sanitized_logits(draft_logits)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    vals, idx = _topk_exact_ties(x, k)
    lp = vals - lse
    lp = torch.where(torch.isnan(lp), torch.full_like(lp, float("-inf")), lp)
    return (lp, idx, nonfinite) if with_nonfinite else (lp, idx)


def _topk_exact_ties(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of the last dim (no NaN), by value descending, ties by
    lower index: a full stable sort's first ``k``, without sorting the vocabulary (the
    sort is the cost this avoids on CPU; docs/benchmarks/cpu.md, "The CPU tree build's
    top-k").  The entries above the k-th value, then the lowest-index entries equal to it."""
    if k >= x.shape[-1]:
        vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
        return vals[..., :k], idx[..., :k]
    kth = torch.topk(x, k, dim=-1).values[..., -1:]
    keep = x >= kth
    # more than k entries reach the k-th value only when it is tied: keep the lowest
    # indices among the tied (a host check on CPU only, where it costs nothing)
    if x.device.type != "cpu" or bool((keep.sum(dim=-1) != k).any()):
        tie = x == kth
        room = k - (x > kth).sum(dim=-1, keepdim=True)
        keep &= ~tie | (tie.cumsum(dim=-1) <= room)
    idx = keep.nonzero()[:, -1].view(*x.shape[:-1], k)  # ascending index per row
    vals, perm = torch.sort(torch.gather(x, -1, idx), dim=-1, descending=True, stable=True)
    return vals, torch.gather(idx, -1, perm)


def _topk_lowest_index(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the last dim in index order; ties at the k-th value resolve to the lowest
    indices (CUDA's radix-select top-k gathers equal values in index order).  One
    ``torch.topk`` over the whole row, not a chunked two-stage top-k (compared in
    docs/benchmarks/core-gpu.md, "Reading")."""
    vals, idx = torch.topk(x, k, dim=-1, sorted=False)
    idx, perm = torch.sort(idx, dim=-1)
    return torch.gather(vals, -1, perm), idx


def depth_candidates_triton(
    draft_logits: torch.Tensor,  # [R, D, V] any float dtype
    k: int,
    inplace: bool = False,
    topk_pruned: bool = True,
    with_nonfinite: bool = False,
    add: torch.Tensor | None = None,  # [R, V] shared by the R's D rows
) -> tuple[torch.Tensor, ...]:
    """The Triton side of :func:`depth_candidates`.  Up to ``k =
    topk_lse_max_k(topk_pruned)`` the chunked top-k kernel
    (:func:`~vllm_ddtree.kernels.topk_lse.topk_lse_triton`: exact ties by construction,
    the non-finite flags from its own pass, ``add`` summed as it reads the logits, never
    written out); above it the log-sum-exp kernel
    (:func:`~vllm_ddtree.kernels.logsumexp.logsumexp_sanitize_triton`) and
    ``torch.topk`` (whose ties resolve to the lowest indices on CUDA only).
    ``inplace``: NaN/inf entries of ``draft_logits`` may be overwritten by their
    sanitized values (``nonfinite`` is read before).  ``topk_pruned``: the top-k
    kernel's variant (see :func:`build_tree`)."""
    R, D, V = draft_logits.shape
    x = draft_logits.reshape(R * D, V)
    if k <= topk_lse_max_k(topk_pruned):  # chunked top-k keys: exact ties by construction
        if add is not None and add.stride(1) != 1:
            add = add.contiguous()
        lp, idx, _, nonfinite = topk_lse_triton(
            x if x.is_contiguous() else x.contiguous(), k, pruned=topk_pruned,
            return_nonfinite=True, add=add, logprobs=True)
    else:
        if add is not None:  # written out: the fallback sanitizes in place
            x = (draft_logits.float() + add.float().unsqueeze(1)).view(R * D, V)
            inplace = True
        nonfinite = ~torch.isfinite(x).all(dim=-1) if with_nonfinite else None
        if not inplace or not x.is_contiguous():
            x = x.clone()
        lse = logsumexp_sanitize_triton(x, sanitize_inplace=True)
        vals, idx = _topk_lowest_index(x, k)  # native dtype, index order
        vals, perm = torch.sort(vals.float(), dim=-1, descending=True, stable=True)
        idx = torch.gather(idx, -1, perm)
        lp = vals - lse.unsqueeze(1)
        lp = torch.where(torch.isnan(lp), torch.full_like(lp, float("-inf")), lp)
    if with_nonfinite:
        return lp.view(R, D, k), idx.view(R, D, k), nonfinite.view(R, D)
    return lp.view(R, D, k), idx.view(R, D, k)


def build_tree(
    draft_logits: torch.Tensor,  # [R, D, V]
    budget: int | torch.Tensor,  # int, or [R] per-request budgets
    max_budget: int | None = None,
    inplace: bool = False,
    topk_pruned: bool = True,
) -> DraftTree:
    """Build the best-first DDTree for every request.

    Args:
        draft_logits: ``[R, D, V]`` raw draft logits (any float dtype).
        budget: node budget (root excluded): an int, or an int tensor ``[R]`` of
            per-request budgets, each ``<= max_budget``.
        max_budget: allocated width ``Bmax``.  Defaults to ``budget`` when it is an int;
            required for tensor budgets (reading their max would sync the device).
        inplace: allow overwriting NaN/inf entries of ``draft_logits`` (saves a copy
            on CUDA; the vLLM runners own their draft-logit buffers).
        topk_pruned: on CUDA, the per-depth top-k kernel's variant
            (:mod:`vllm_ddtree.kernels.topk_lse`): pruned (default: it skips the chunks
            that cannot hold a top-k entry; docs/benchmarks/core-gpu.md, "Tree build and
            tree attention at Qwen3-8B shape", compares the two) or one pass.
            Both give identical trees.

    The candidates come from :func:`depth_candidates`; the selection is
    :func:`build_tree_triton` (one kernel launch for the whole expansion) where
    :func:`~vllm_ddtree.kernels.triton_utils.use_triton` holds and the width fits one
    program (up to a few hundred nodes), else :func:`build_tree_torch`.  Both give
    identical trees.
    """
    width = _tree_width(draft_logits, budget, max_budget)
    D, V = draft_logits.shape[1:]
    if use_triton(draft_logits) and triton_build_supported(D, min(width, V), width):
        return build_tree_triton(draft_logits, budget, max_budget, inplace, topk_pruned)
    return build_tree_torch(draft_logits, budget, max_budget, inplace, topk_pruned)


def build_tree_torch(
    draft_logits: torch.Tensor,  # [R, D, V]
    budget: int | torch.Tensor,  # int, or [R] per-request budgets
    max_budget: int | None = None,
    inplace: bool = False,
    topk_pruned: bool = True,
) -> DraftTree:
    """Reference of :func:`build_tree` (same arguments): each depth's selection in torch
    (one ``topk`` of packed keys per depth), on any device and any width."""
    cand = _build_candidates(draft_logits, budget, max_budget, inplace, topk_pruned)
    if isinstance(cand, DraftTree):
        return cand
    lp, tok, top1, nonfinite, width, per_req = cand
    R, D, K = lp.shape
    dev = draft_logits.device
    empty = DraftTree.empty(R, width, D, dev)
    empty.top1, empty.nonfinite = top1, nonfinite

    # Per-depth top-`width` sets, each sorted by key (best first).
    scores = [lp[:, 0, :]]  # depth 1: ranks 0..K-1 are already in key order
    parent_pos = [torch.full((R, K), -1, dtype=torch.int64, device=dev)]
    tokens = [tok[:, 0, :]]
    pi_all, pr_all = pair_tensors(D, K, width, str(dev))
    npairs = pair_layout(D, K, width)[2]
    for d in range(1, D):
        pi, pr = pi_all[: npairs[d]], pr_all[: npairs[d]]  # parents inside depth d-1's set
        cand = scores[-1][:, pi] + lp[:, d, :][:, pr]  # [R, P] float32, parent first
        key = pack_keys(cand, pi * K + pr)
        top = torch.topk(key, min(width, pi.numel()), dim=1).values  # sorted: best first
        code = unpack_ties(top)
        parent_pos.append(code // K)
        tokens.append(torch.gather(tok[:, d, :], 1, code % K))
        scores.append(unpack_scores(top))
    return assemble_tree(scores, parent_pos, tokens, per_req, empty)


def build_tree_triton(
    draft_logits: torch.Tensor,  # [R, D, V]
    budget: int | torch.Tensor,  # int, or [R] per-request budgets
    max_budget: int | None = None,
    inplace: bool = False,
    topk_pruned: bool = True,
) -> DraftTree:
    """The Triton side of :func:`build_tree` (same arguments): the whole selection in
    one launch (:func:`~vllm_ddtree.kernels.tree_build.tree_build_triton`).  Raises
    ``ValueError`` where Triton is missing or the width's sorts do not fit one program
    (:func:`~vllm_ddtree.kernels.tree_build.triton_build_supported`)."""
    cand = _build_candidates(draft_logits, budget, max_budget, inplace, topk_pruned)
    if isinstance(cand, DraftTree):
        return cand
    lp, tok, top1, nonfinite, width, per_req = cand
    D, K = lp.shape[1:]
    if not triton_build_supported(D, K, width):
        raise ValueError(f"build_tree_triton: does not support D={D}, K={K}, "
                         f"width={width}")
    token_ids, parents, depths, scores, num_nodes = tree_build_triton(lp, tok, width, per_req)
    return DraftTree(token_ids, parents, depths, num_nodes, scores, D, top1, nonfinite)


class _Candidates(NamedTuple):
    """The per-depth candidates both builds select from, and the build's by-products."""

    lp: torch.Tensor  # [R, D, K] float32 log-probabilities, best first
    tok: torch.Tensor  # [R, D, K] int64 their token ids
    top1: torch.Tensor  # [R, D] int64 each depth's best token
    nonfinite: torch.Tensor  # [R] bool the draft logits held NaN/inf
    width: int  # allocated width
    per_req: torch.Tensor  # [R] int64 per-request budgets


def _tree_width(
    draft_logits: torch.Tensor,  # [R, D, V]
    budget: int | torch.Tensor,
    max_budget: int | None,
) -> int:
    """The allocated width of :func:`build_tree`'s trees; checks the arguments (host
    only: no device work)."""
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [R, D, V], got shape {tuple(draft_logits.shape)}")
    if isinstance(budget, torch.Tensor):
        if max_budget is None:
            raise ValueError("build_tree: a tensor budget needs max_budget (the allocated width)")
        width = int(max_budget)
    else:
        width = int(budget if max_budget is None else max_budget)
        if int(budget) > width:
            raise ValueError(f"build_tree: budget {budget} exceeds max_budget {width}")
    if width < 0:
        raise ValueError(f"build_tree: budget must be >= 0, got {width}")
    return width


def _build_candidates(
    draft_logits: torch.Tensor,  # [R, D, V]
    budget: int | torch.Tensor,
    max_budget: int | None,
    inplace: bool,
    topk_pruned: bool,
) -> DraftTree | _Candidates:
    """What both builds start from: the empty trees where there is nothing to select,
    else the :class:`_Candidates` (``K = min(width, V)`` per depth)."""
    width = _tree_width(draft_logits, budget, max_budget)
    R, D, V = draft_logits.shape
    dev = draft_logits.device
    if isinstance(budget, torch.Tensor):
        per_req = budget.to(device=dev, dtype=torch.int64).clamp(0, width)
    else:
        per_req = torch.full((R,), int(budget), dtype=torch.int64, device=dev)
    if width == 0 or R == 0 or D == 0 or V == 0:
        return DraftTree.empty(R, width, D, dev)
    K = min(width, V)
    lp, tok, nonfinite = depth_candidates(draft_logits, K, inplace, topk_pruned,
                                          with_nonfinite=True)  # [R, D, K], [R, D]
    return _Candidates(lp, tok, tok[:, :, 0], nonfinite.any(dim=1), width, per_req)


def assemble_tree(
    scores: list[torch.Tensor],  # per depth: [R, n_d] float32, best first
    parent_pos: list[torch.Tensor],  # per depth: [R, n_d] int64 parent position at d - 1
    tokens: list[torch.Tensor],  # per depth: [R, n_d] int64 token ids
    per_req: torch.Tensor,  # [R] int64 node budget of each request
    out: DraftTree,  # empty trees of the allocated width, filled in place
) -> DraftTree:
    """The global best-first tree from per-depth top-``width`` sets, each in key order:
    the top-``width`` of their union by (score, depth, position), parents mapped from
    per-depth positions to node indices.  Every builder's last stage."""
    R, width = out.token_ids.shape
    dev = out.token_ids.device
    offsets = [0]
    for s in scores:
        offsets.append(offsets[-1] + s.shape[1])
    all_scores = torch.cat(scores, dim=1)  # [R, total]
    total = offsets[-1]
    tie = torch.arange(total, device=dev)  # = depth-major position: (depth, pos) order
    n_out = min(width, total)
    gkey = pack_keys(all_scores, tie.expand(R, total))
    sel = unpack_ties(torch.topk(gkey, n_out, dim=1).values)  # [R, n_out] flat positions

    offs = cached_int64_tensor(tuple(offsets[:-1]), str(dev))
    depth_idx = torch.searchsorted(offs, sel, right=True) - 1  # 0-based depth
    node_tok = torch.gather(torch.cat(tokens, dim=1), 1, sel)
    node_score = torch.gather(all_scores, 1, sel)

    # Parent: flat position of (depth-1, parent_pos) -> index in the output order.
    flat_to_node = torch.full((R, total), -1, dtype=torch.int64, device=dev)
    flat_to_node.scatter_(1, sel, torch.arange(n_out, device=dev).expand(R, n_out))
    ppos = torch.gather(torch.cat(parent_pos, dim=1), 1, sel)
    parent_flat = (offs[(depth_idx - 1).clamp(min=0)] + ppos).clamp(min=0)
    parent_node = torch.gather(flat_to_node, 1, parent_flat)
    parents = torch.where(depth_idx == 0, torch.zeros_like(parent_node), parent_node + 1)

    num_nodes = per_req.clamp(max=n_out)
    live = torch.arange(n_out, device=dev).unsqueeze(0) < num_nodes.unsqueeze(1)
    out.num_nodes = num_nodes
    out.token_ids[:, :n_out] = torch.where(live, node_tok, -1)
    out.parents[:, :n_out] = torch.where(live, parents, -1)
    out.depths[:, :n_out] = torch.where(live, depth_idx + 1, 0)
    out.scores[:, :n_out] = torch.where(live, node_score, float("-inf"))
    return out
