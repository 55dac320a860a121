"""One depth of the conditioned (DSpark) tree build's candidates: two launches.

At depth ``d`` every parent ``p`` of request ``r`` (a kept node of depth ``d - 1``, or
the drafter's chain token) has its own child logits ``x = base[r, d] + scale * (w1[tok_p]
@ w2.T)`` over the draft vocabulary.  The build needs, per parent, its log-sum-exp and
its ``need_p`` best children (``need_p = min(K, width // (p + 1))``: a parent at position
``p`` contributes at most that many pairs; the chain's parent 1), never the ``[R, P, V]``
logits themselves.

* ``_conditioned_chunk_kernel``, one program per (request, group of vocabulary chunks):
  the pruning bound of each of the request's parents (below), then chunk by chunk the
  logits of all its parents as one ``[P, r] x [r, CHUNK]`` product (bf16 factors on
  tensor cores, float32 sums), sanitized as :func:`~vllm_ddtree.tree.build.
  sanitized_logits`; per parent the chunk's maximum, sum of exponentials and non-finite
  flag; and the chunk's entries that can be among the parent's best: ``t_p``, the
  ``need_p``-th largest of the parent's logits at the depth's ``NB`` bound tokens, is a
  lower bound on the parent's ``need_p``-th largest logit (``need_p`` distinct
  entries reach it), so only entries ``>= t_p`` are kept, at most ``need_p`` a chunk,
  as packed keys (:mod:`.build_tables`: ties to the lower id).  Each kept entry costs
  two reductions over the tile, so the bound's tightness is the kernel's cost: at the
  SmolLM2 DSpark drafter's shape (V = 49152, Markov bias about half the base logits'
  spread, budget 15) the best parent's bound over the 15 best base tokens let ~400
  entries through, over the best 64 ~35 (:data:`BOUND_TOKENS`).  The build takes the
  best base token of each of 64 vocabulary spans (:func:`bound_tokens_triton`: one
  read of the base logits, where an exact top-64 is a top-k).  Grouping chunks
  computes the bound once for several chunks where the requests fill the GPU
  (:func:`conditioned_tuning`).  Given the parents' scores and a threshold per request
  (from the third depth on), a parent below the threshold cannot have descendants in
  the tree: its chunks keep no entry and raise no flag, and a request with no parent
  left does one row's work, its chain's (``_chain_chunks``).
* :mod:`.topk_lse`'s merge, one program per parent: the best ``K`` of the kept keys
  (the first ``need_p`` exact; later slots are not read; none for a parent below the
  threshold), log-probabilities, the non-finite flag.

The torch reference is :func:`~vllm_ddtree.tree.conditioned.conditioned_candidates_torch`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_ddtree.kernels.triton_utils import HAS_TRITON, next_pow2, tl, triton

if HAS_TRITON:
    from vllm_ddtree.kernels.build_tables import key_score, pack_key
    from vllm_ddtree.kernels.topk_lse import _merge_kernel, sanitize

# the pruning bound's tokens: this many high base tokens a depth (the module docstring
# gives the entries a bound lets through)
BOUND_TOKENS = 64


class ConditionedTuning(NamedTuple):
    """Launch settings of :func:`conditioned_candidates_triton`'s chunk kernel.  None
    changes a candidate; the chunking may round a log-sum-exp differently."""

    tile: int  # [parents, chunk] logits a chunk holds (a power of two)
    warps: int  # of a chunk program
    group: int  # chunks a program takes in turn (each program computes the bound once)
    bound_sort: bool  # the bound by one sort of its tokens, not need - 1 reductions
    merge_sort: bool  # the merge by one sort of a row's kept keys, not max-reductions


# from this many one-chunk programs (8192-entry tiles) up, programs take groups of chunks
GROUPED_FROM = 528


def _chunk(tile: int, parents: int, V: int) -> int:
    """Vocabulary entries a chunk of ``tile`` entries holds for ``parents`` parents (a
    power of two)."""
    return max(16, min(tile // parents, next_pow2(V)))


def conditioned_tuning(rows: int, parents: int, V: int, cuda: bool) -> ConditionedTuning:
    """The default settings for ``rows`` requests of ``parents`` parents (a power of
    two) over ``V`` draft tokens: one 8192-entry chunk a program on 8 warps while that
    grid is smaller than :data:`GROUPED_FROM` (up to 5 requests at the SmolLM2
    DSpark drafter's shape), else 8 chunks a program, of 4096 entries on 4 warps up to
    16 parents (the fastest of a sweep at budget 15: docs/benchmarks/core-gpu.md,
    "Conditioned (DSpark) tree build"), of 8192 on 8 above (unswept; halving wide trees'
    chunks would double the merge's tile).  The bound and the merge by sort on the GPU
    (the interpreter's sort is slow)."""
    if rows * -(-V // _chunk(8192, parents, V)) < GROUPED_FROM:
        return ConditionedTuning(tile=8192, warps=8, group=1, bound_sort=cuda,
                                 merge_sort=cuda)
    if parents <= 16:
        return ConditionedTuning(tile=4096, warps=4, group=8, bound_sort=cuda,
                                 merge_sort=cuda)
    return ConditionedTuning(tile=8192, warps=8, group=8, bound_sort=cuda, merge_sort=cuda)


if HAS_TRITON:

    @triton.jit
    def _markov_dot(W2, emb, cols, col_ok, ro, ro_ok, w2_stride, IEEE: tl.constexpr):
        """``emb @ w2[cols].T``: [PB, C] float32 (each row's sums independent of the
        others', so a row alone gives the same numbers)."""
        w2 = tl.load(W2 + cols[None, :].to(tl.int64) * w2_stride + ro[:, None],
                     mask=ro_ok[:, None] & col_ok[None, :], other=0.0)  # [RP, C]
        if IEEE:
            return tl.dot(emb, w2, input_precision="ieee")
        return tl.dot(emb, w2)

    @triton.jit
    def _markov_logits(BASE, W2, emb, cols, col_ok, ro, ro_ok, w2_stride, scale, big,
                       IEEE: tl.constexpr):
        """``base[cols] + scale * emb @ w2[cols].T``, sanitized: [PB, C] float32; and
        each row's flag: one of its entries was NaN or inf."""
        dot = _markov_dot(W2, emb, cols, col_ok, ro, ro_ok, w2_stride, IEEE)
        base = tl.load(BASE + cols, mask=col_ok, other=float("-inf")).to(tl.float32)
        x, bad = sanitize(base[None, :] + scale * dot, col_ok[None, :], big)
        return x, tl.max(bad.to(tl.int32), 1)

    @triton.jit
    def _chain_chunks(BASE, W2, emb, KEYS, CNT, M, S, NF, r, g, group, p, p_ok, P, V,
                      n_chunks, ro, ro_ok, w2_stride, scale, big, K: tl.constexpr,
                      CHUNK: tl.constexpr, IEEE: tl.constexpr):
        """A request none of whose kept nodes can reach the tree: only the chain's
        parent (row ``P - 1``), one row's work; per chunk its maximum, sum, flag and
        best entry; the other rows' chunks are empty (no entry, no flag)."""
        chain = p == P - 1
        emb = tl.where(chain[:, None], emb, tl.zeros_like(emb))  # its row alone: same sums
        for s in range(0, group):
            c = g * group + s
            cols = c * CHUNK + tl.arange(0, CHUNK)
            col_ok = cols < V
            dot = tl.sum(_markov_dot(W2, emb, cols, col_ok, ro, ro_ok, w2_stride, IEEE), 0)
            base = tl.load(BASE + cols, mask=col_ok, other=float("-inf")).to(tl.float32)
            x, bad = sanitize(base + scale * dot, col_ok, big)  # [CHUNK]
            m = tl.max(x, 0)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            col = tl.min(tl.where(col_ok & (x == m), cols, V), 0)
            stat = (r * P + p) * n_chunks + c
            st_ok = p_ok & (p * 0 + c < n_chunks)
            tl.store(M + stat, tl.where(chain, m, float("-inf")), mask=st_ok)
            tl.store(S + stat, tl.where(chain, tl.sum(tl.exp(x - m_safe), 0), 0.0),
                     mask=st_ok)
            tl.store(NF + stat, tl.where(chain, tl.max(bad.to(tl.int32), 0), 0), mask=st_ok)
            tl.store(CNT + stat, chain.to(tl.int32), mask=st_ok)
            tl.store(KEYS + stat * K, pack_key(p * 0.0 + m, p * 0 + col.to(tl.int64)),
                     mask=st_ok & chain)

    @triton.jit
    def _conditioned_chunk_kernel(
        BASE, W1, W2, PARENTS, NEED, TOP_IDS, PSCORE, THETA,
        KEYS, CNT, M, S, NF,
        P, V, rank, n_chunks, group, base_stride, w1_stride, w2_stride, ps_stride, scale,
        big,
        K: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, PB: tl.constexpr,
        RP: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr,
        BOUND_SORT: tl.constexpr, PRUNE: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        p = tl.arange(0, PB)
        p_ok = p < P
        need = tl.load(NEED + p, mask=p_ok, other=1)  # [PB] ranks each parent needs
        tok = tl.load(PARENTS + r * P + p, mask=p_ok, other=0).to(tl.int64)
        ro = tl.arange(0, RP)
        ro_ok = ro < rank
        emb = tl.load(W1 + tok[:, None] * w1_stride + ro[None, :],
                      mask=p_ok[:, None] & ro_ok[None, :], other=0.0)  # [PB, RP]
        base = BASE + r * base_stride
        # rows whose children are wanted: the chain's parent (row P - 1), and with PRUNE
        # the kept nodes whose score reaches the request's threshold
        use = p_ok
        n_live = 1
        if PRUNE:
            ps = tl.load(PSCORE + r * ps_stride + p, mask=p < P - 1, other=float("-inf"))
            live = (p < P - 1) & (ps >= tl.load(THETA + r))
            use = live | (p == P - 1)
            n_live = tl.sum(live.to(tl.int32), 0)
        if n_live == 0:
            _chain_chunks(base, W2, emb, KEYS, CNT, M, S, NF, r, g, group, p, p_ok, P, V,
                          n_chunks, ro, ro_ok, w2_stride, scale, big, K, CHUNK, IEEE)
        else:
            # t: each parent's need-th largest logit (duplicates counted) over the
            # depth's NB bound tokens
            j = tl.arange(0, NBP)
            j_ok = j < NB
            ids = tl.load(TOP_IDS + r * NB + j, mask=j_ok, other=0)
            xt, _ = _markov_logits(base, W2, emb, ids, j_ok, ro, ro_ok, w2_stride, scale,
                                   big, IEEE)  # [PB, NBP]
            kt = tl.where(j_ok[None, :], pack_key(xt, j[None, :].to(tl.int64)),
                          -9223372036854775807 - 1)
            if BOUND_SORT:
                kt = tl.sort(kt, dim=1, descending=True)
                kt = tl.where(j[None, :] == need[:, None] - 1, kt, -9223372036854775807 - 1)
            else:  # need - 1 removals of the row's largest key
                for i in range(0, tl.max(need, 0) - 1):
                    top = tl.max(kt, 1)
                    drop = (kt == top[:, None]) & (i < need - 1)[:, None]
                    kt = tl.where(drop, -9223372036854775807 - 1, kt)
            t = key_score(tl.max(kt, 1))
            # a margin against a product summed in another order than the chunk's
            t = t - (tl.abs(t) * 0.0009765625 + 1e-30)
            for s in range(0, group):
                c = g * group + s
                cols = c * CHUNK + tl.arange(0, CHUNK)
                col_ok = cols < V
                x, bad = _markov_logits(base, W2, emb, cols, col_ok, ro, ro_ok, w2_stride,
                                        scale, big, IEEE)  # [PB, CHUNK]
                stat = (r * P + p) * n_chunks + c
                st_ok = p_ok & (p * 0 + c < n_chunks)  # [PB] (a tensor: the interpreter's mask)
                m = tl.max(x, 1)
                m_safe = tl.where(m == float("-inf"), 0.0, m)
                tl.store(M + stat, m, mask=st_ok)
                tl.store(S + stat, tl.sum(tl.exp(x - m_safe[:, None]), 1), mask=st_ok)
                tl.store(NF + stat, tl.where(use, bad, 0), mask=st_ok)
                hit = col_ok[None, :] & (x >= t[:, None]) & use[:, None]
                cnt = tl.minimum(tl.sum(hit.to(tl.int32), 1), need)  # [PB]
                tl.store(CNT + stat, cnt, mask=st_ok)
                # the kept entries in key order (value descending, then lower id): two
                # reductions each, on the logits (no int64 tile)
                out = KEYS + stat * K
                for i in range(0, tl.max(tl.where(st_ok, cnt, 0), 0)):
                    best = tl.max(tl.where(hit, x, float("-inf")), 1)  # [PB]
                    col = tl.min(tl.where(hit & (x == best[:, None]), cols[None, :], V), 1)
                    tl.store(out + i, pack_key(best, col.to(tl.int64)),
                             mask=st_ok & (i < cnt))
                    hit &= cols[None, :] != col[:, None]


if HAS_TRITON:

    @triton.jit
    def _bound_tokens_kernel(BASE, OUT, V, R, D, span, longest, NB: tl.constexpr,
                             SPANS: tl.constexpr, BLOCK: tl.constexpr):
        """``SPANS`` of one (request, depth) row's ``NB`` vocabulary spans (``span``
        tokens each, the last one, ``longest``, to the end), side by side, ``BLOCK``
        tokens of each at a time: each span's best token, ties to the lower id."""
        row = tl.program_id(0).to(tl.int64)  # r * D + d
        j = tl.program_id(1) * SPANS + tl.arange(0, SPANS)
        start = j * span
        end = tl.where(j == NB - 1, V, start + span)
        best = tl.full([SPANS], float("-inf"), tl.float32)
        tok = start  # a span of -inf (or NaN) logits: its first token
        for c0 in range(0, longest, BLOCK):
            cols = start[:, None] + c0 + tl.arange(0, BLOCK)[None, :]
            ok = (cols < end[:, None]) & (j < NB)[:, None]
            x = tl.load(BASE + row * V + cols, mask=ok, other=float("-inf")).to(tl.float32)
            x = tl.where(x != x, float("-inf"), x)  # NaN ranks last
            m = tl.max(x, 1)
            t = tl.min(tl.where(ok & (x == m[:, None]), cols, V), 1)
            better = m > best  # an earlier block keeps a tie: the lower id
            tok = tl.where(better, t, tok)
            best = tl.where(better, m, best)
        tl.store(OUT + ((row % D) * R + row // D) * NB + j, tok, mask=j < NB)


def bound_tokens_triton(
    base_logits: torch.Tensor,  # [R, D, V] contiguous
    nb: int,  # tokens per row, 1 <= nb <= V
) -> torch.Tensor:  # [D, R, nb] int64
    """The pruning bound's tokens (:func:`conditioned_candidates_triton`'s ``top_ids``) of
    every request and depth, one launch: the best base token of each of ``nb`` spans of
    the vocabulary (``V // nb`` tokens each, the last one to the end), distinct by
    construction.  Any distinct tokens give the same candidates; high base logits make
    a tight bound, and span maxima cost one read of the logits where the exact top-``nb``
    costs a top-k (docs/benchmarks/core-gpu.md, "Fewer launches, cheaper bound tokens")."""
    R, D, V = base_logits.shape
    assert base_logits.is_contiguous() and 1 <= nb <= V
    span = V // nb
    out = torch.empty((D, R, nb), dtype=torch.int64, device=base_logits.device)
    if R * D:
        # 8 spans a program, up to 1024 tokens of each at a time: at V = 49152 a
        # 64-token bound is 8 programs a row of one [8, 1024] block each
        spans = min(8, next_pow2(nb))
        _bound_tokens_kernel[(R * D, triton.cdiv(nb, spans))](
            base_logits, out, V, R, D, span, V - (nb - 1) * span, NB=nb, SPANS=spans,
            BLOCK=max(16, min(1024, next_pow2(V - (nb - 1) * span))), num_warps=4)
    return out


def bound_tokens_torch(
    base_logits: torch.Tensor,  # [R, D, V]
    nb: int,  # tokens per row, 1 <= nb <= V
) -> torch.Tensor:  # [D, R, nb] int64
    """Reference of :func:`bound_tokens_triton`."""
    R, D, V = base_logits.shape
    span = V // nb
    x = torch.nan_to_num(base_logits.float(), nan=float("-inf"))
    head = x[..., : (nb - 1) * span].reshape(R, D, nb - 1, span).argmax(dim=-1)
    last = x[..., (nb - 1) * span:].argmax(dim=-1, keepdim=True) + (nb - 1) * span
    return torch.cat([head + span * torch.arange(nb - 1, device=x.device), last],
                     dim=-1).transpose(0, 1).contiguous()


def conditioned_candidates_triton(
    base: torch.Tensor,  # [R, V_draft] the depth's base logits (last dim contiguous)
    parents: torch.Tensor,  # [R, P] int64 target token id of each parent
    need: torch.Tensor,  # [P] int64 best children each parent needs (<= k)
    top_ids: torch.Tensor,  # [R, NB] int64 distinct tokens, NB >= max(need): the bound's
    w1: torch.Tensor,  # [V_target, rank] the Markov head's factors (same dtype)
    w2: torch.Tensor,  # [V_draft, rank]
    scale: float,
    k: int,
    tuning: ConditionedTuning | None = None,
    parent_scores: torch.Tensor | None = None,  # [R, P - 1] float32 (last dim contiguous)
    theta: torch.Tensor | None = None,  # [R] float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per parent its ``k`` best children: ``(logprobs [R, P, k] float32, draft ids
    [R, P, k] int64, nonfinite [R, P] bool)``, ranked by logit descending, ties by lower
    id; only the first ``need[p]`` of parent ``p`` are its children (later slots hold
    anything).  ``top_ids``: the pruning bound's tokens (any distinct ids give the same
    result; the higher their base logits, the more they prune).  ``tuning`` overrides
    :func:`conditioned_tuning`.  Two launches, no host sync.

    With ``parent_scores`` and ``theta``: parent ``p < P - 1`` is a tree node of that
    score, and only those scoring at least ``theta`` of their request (nodes that can
    still be in the tree, see :mod:`vllm_ddtree.tree.conditioned`) and the last parent
    (the chain's) get their children and flag; the others get ``-inf`` log-probabilities
    and no flag, and a request with none of the former does only the chain's row."""
    R, P = parents.shape
    V = base.shape[1]
    rank = w2.shape[1]
    assert base.stride(1) == 1 and w1.stride(1) == 1 and w2.stride(1) == 1
    assert w1.dtype == w2.dtype and 0 < k <= V and top_ids.is_contiguous()
    assert top_ids.shape[1] >= k, "the bound needs need[p] <= k of its tokens"
    prune = parent_scores is not None
    assert prune == (theta is not None)
    assert not prune or (parent_scores.shape == (R, P - 1) and parent_scores.stride(1) == 1)
    nb = top_ids.shape[1]
    dev = base.device
    pb = max(16, next_pow2(P))
    tuning = tuning or conditioned_tuning(R, pb, V, base.is_cuda)
    chunk = _chunk(tuning.tile, pb, V)
    n_chunks = triton.cdiv(V, chunk)
    n_groups = triton.cdiv(n_chunks, tuning.group)
    rows = R * P
    keys = torch.empty((rows, n_chunks, k), dtype=torch.int64, device=dev)
    cnt = torch.empty((rows, n_chunks), dtype=torch.int32, device=dev)
    chunk_max = torch.empty((rows, n_chunks), dtype=torch.float32, device=dev)
    chunk_sum = torch.empty_like(chunk_max)
    chunk_bad = torch.empty((rows, n_chunks), dtype=torch.int32, device=dev)
    lp = torch.empty((rows, k), dtype=torch.float32, device=dev)
    ids = torch.empty((rows, k), dtype=torch.int64, device=dev)
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    bad = torch.empty(rows, dtype=torch.bool, device=dev)
    if rows:
        big = float(torch.finfo(torch.float32).max)
        _conditioned_chunk_kernel[(R, n_groups)](
            base, w1, w2, parents, need, top_ids, parent_scores if prune else base,
            theta if prune else base, keys, cnt, chunk_max, chunk_sum, chunk_bad, P, V,
            rank, n_chunks, tuning.group, base.stride(0), w1.stride(0), w2.stride(0),
            parent_scores.stride(0) if prune else 0, float(scale), big, K=k, NB=nb,
            NBP=max(16, next_pow2(nb)), PB=pb, RP=max(16, next_pow2(rank)), CHUNK=chunk,
            IEEE=w2.dtype == torch.float32, BOUND_SORT=tuning.bound_sort, PRUNE=prune,
            num_warps=tuning.warps)
        kp = next_pow2(k)
        small = max(128, 4 * kp)  # topk_tuning's merge_small
        scratch = (torch.empty((rows, small), dtype=torch.int64, device=dev)
                   if tuning.merge_sort else keys)
        _merge_kernel[(rows,)](
            keys, cnt, need, P, chunk_max, chunk_sum, chunk_bad, lp, ids, lse,
            bad.view(torch.int8), scratch, n_chunks, K=k, KP=kp, BLOCK_C=next_pow2(n_chunks),
            BLOCK_N=next_pow2(n_chunks * k), SMALL=small, SORT=tuning.merge_sort, LOGPROBS=True,
            HAS_CNT=True, num_warps=4)
    return lp.view(R, P, k), ids.view(R, P, k), bad.view(R, P)
