"""Per-depth draft candidates: top-k and log-sum-exp of each row of the draft logits.

Each program takes one chunk of one row: it sanitizes the logits (NaN -> -inf, +inf ->
the dtype's largest finite value) and extracts the chunk's top ``k`` as unique int64 keys
(order-preserving float bits above the inverted token id), so ties resolve to the lower
token id by construction.  One program per row then merges: the row's top ``k`` of the
``chunks * k`` keys (one sort of the live ones when they are few, else ``k``
max-reductions; :class:`TopkTuning`), unpacked to values and ids (or
log-probabilities), the log-sum-exp from the chunks' maxima and sums, and the row's
non-finite flag.  :func:`topk_lse_triton` launches them for the tree build's
:func:`~vllm_ddtree.tree.build.depth_candidates_triton`; the reference is
:func:`~vllm_ddtree.tree.build.depth_candidates_torch` (a stable sort).  With the
pruning bound and this merge in Triton, the top-k is four launches, in place of ~20
around two ``torch.topk`` and a ``logsumexp``: fewer launches in the step's CUDA graph
(``benchmarks/gpu_step_parts.py``, column topk/g, times both;
docs/benchmarks/step-cost-h200.md, "The tree build's top-k merge and the T > 0 stop draw
in Triton").

Two variants (``pruned``):

* one pass: each program also writes its chunk's max and sum of exponentials
  (for the log-sum-exp) and runs ``k`` max-reductions over its chunk: every chunk of
  every row pays ``k`` reductions, so at many rows the kernel is compute-bound on them
  (why pruned is the default: docs/benchmarks/core-gpu.md, "Tree build and tree
  attention at Qwen3-8B shape").
* pruned (the default; the same docs section compares the two): a first kernel
  writes the chunk maxima and sums; ``t`` = the ``k``-th largest chunk maximum of the row
  (one program per row) is a lower bound on the row's ``k``-th largest value (the top
  ``k`` chunk maxima are ``k`` distinct entries >= ``t``), so only entries >= ``t`` can
  be in the top ``k``.  The second kernel skips chunks whose maximum is below ``t`` and
  runs one reduction per entry >= ``t`` (at most ``k``).  Smaller chunks for larger
  ``k`` keep at least ``k`` chunks per row where the vocabulary allows.  Same result bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_ddtree.kernels.triton_utils import HAS_TRITON, next_pow2, tl, triton

if HAS_TRITON:
    from vllm_ddtree.kernels.build_tables import key_score, key_tie, pack_key

# Largest k each variant serves; beyond it the tree build uses torch.topk.  One pass:
# its k reductions per chunk grow with k, and above k = 16 torch.topk costs less
# (docs/benchmarks/core-gpu.md, "Tree build and tree attention at Qwen3-8B shape").
ONE_PASS_MAX_K = 16
PRUNED_MAX_K = 64


def topk_lse_max_k(pruned: bool) -> int:
    """Largest ``k`` :func:`topk_lse_triton` serves in the given variant."""
    return PRUNED_MAX_K if pruned else ONE_PASS_MAX_K


if HAS_TRITON:

    @triton.jit
    def sanitize(x, ok, big):
        """float32 ``x`` with NaN -> -inf and +inf -> ``big`` (as
        :func:`~vllm_ddtree.tree.build.sanitized_logits`), and where ``x`` held a NaN or
        an inf among the ``ok`` entries."""
        bad = ok & ((x != x) | (tl.abs(x) == float("inf")))
        x = tl.where(x != x, float("-inf"), x)
        return tl.where(x == float("inf"), big, x), bad

    @triton.jit
    def _load_sanitized(X, A, row, c, stride, a_stride, a_group, V, big,
                        CHUNK: tl.constexpr, HAS_ADD: tl.constexpr):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        ok = offs < V
        x = tl.load(X + row.to(tl.int64) * stride + offs, mask=ok, other=float("-inf"))
        x = x.to(tl.float32)
        if HAS_ADD:  # the row's shared term (float32 sum, then sanitized)
            a_row = (row // a_group).to(tl.int64)
            x += tl.load(A + a_row * a_stride + offs, mask=ok, other=0.0).to(tl.float32)
        x, bad = sanitize(x, ok, big)
        return x, offs, ok, bad

    @triton.jit
    def _chunk_max_sum(x, bad, M, S, NF, row, c, n_chunks):
        m = tl.max(x, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        tl.store(M + row * n_chunks + c, m)
        tl.store(S + row * n_chunks + c, tl.sum(tl.exp(x - m_safe), 0))
        tl.store(NF + row * n_chunks + c, tl.max(bad.to(tl.int32), 0))

    @triton.jit
    def _chunk_max_sum_kernel(X, A, M, S, NF, V, stride, a_stride, a_group, n_chunks, big,
                              CHUNK: tl.constexpr, HAS_ADD: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        x, offs, ok, bad = _load_sanitized(X, A, row, c, stride, a_stride, a_group, V, big,
                                           CHUNK, HAS_ADD)
        _chunk_max_sum(x, bad, M, S, NF, row, c, n_chunks)

    @triton.jit
    def _kth_largest_chunk_max(M, row, n_chunks, K: tl.constexpr, BLOCK_C: tl.constexpr,
                               SORT: tl.constexpr):
        """The row's ``K``-th largest chunk maximum, duplicates counted (``torch.topk``'s
        ``values[K - 1]``); -inf when the row has fewer than ``K`` chunks.  ``SORT``
        (needs ``K <= BLOCK_C``): one sort of the chunk keys, else ``K - 1``
        max-reductions."""
        c = tl.arange(0, BLOCK_C)
        m = tl.load(M + row * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
        key = tl.where(c < n_chunks, pack_key(m, c.to(tl.int64)),  # unique per chunk
                       -9223372036854775807 - 1)
        if SORT:
            key = tl.sort(key, descending=True)
            kth = tl.max(tl.where(c == K - 1, key, -9223372036854775807 - 1), 0)
        else:
            for _ in range(0, K - 1):
                key = tl.where(key == tl.max(key, 0), -9223372036854775807 - 1, key)
            kth = tl.max(key, 0)
        return tl.where(kth == -9223372036854775807 - 1, float("-inf"), key_score(kth))

    @triton.jit
    def _bound_kernel(M, T, n_chunks, K: tl.constexpr, BLOCK_C: tl.constexpr,
                      SORT: tl.constexpr):
        row = tl.program_id(0)
        tl.store(T + row, _kth_largest_chunk_max(M, row, n_chunks, K, BLOCK_C, SORT))

    @triton.jit
    def _chunk_topk_kernel(X, A, KEYS, M, S, NF, T, V, stride, a_stride, a_group, n_chunks,
                           big, K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr,
                           PRUNED: tl.constexpr, HAS_ADD: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        slots = tl.arange(0, KP)
        res = tl.full([KP], -9223372036854775807 - 1, tl.int64)
        out = KEYS + (row * n_chunks + c) * K + slots
        if PRUNED:
            t = tl.load(T + row)
            if tl.load(M + row * n_chunks + c) < t:  # no entry of this chunk can make it
                tl.store(out, res, mask=slots < K)
                return
        x, offs, ok, bad = _load_sanitized(X, A, row, c, stride, a_stride, a_group, V, big,
                                           CHUNK, HAS_ADD)
        if not PRUNED:
            _chunk_max_sum(x, bad, M, S, NF, row, c, n_chunks)
        key = tl.where(ok, pack_key(x, offs.to(tl.int64)), -9223372036854775807 - 1)
        if PRUNED:
            n = tl.minimum(tl.sum((ok & (x >= t)).to(tl.int32), 0), K)
        else:
            n = K
        for i in range(0, n):
            best = tl.max(key, 0)
            res = tl.where(slots == i, best, res)
            key = tl.where(key == best, -9223372036854775807 - 1, key)
        tl.store(out, res, mask=slots < K)

    @triton.jit
    def _merge_kernel(KEYS, CNT, NEED, n_need, M, S, NF, VALS, IDS, LSE, BAD, SCRATCH,
                      n_chunks,
                      K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr,
                      BLOCK_N: tl.constexpr, SMALL: tl.constexpr, SORT: tl.constexpr,
                      LOGPROBS: tl.constexpr, HAS_CNT: tl.constexpr):
        """One row: its top ``K`` of the chunks' keys, unpacked; the log-sum-exp of the
        chunk maxima and sums (``torch.logsumexp``'s formula); the non-finite flag.

        Each chunk's keys are sorted, its live ones first; with ``HAS_CNT`` only the
        first ``CNT[row, chunk]`` slots of a chunk were written (the rest are not read),
        and only the first ``NEED[row % n_need]`` of the row's top are wanted.
        With ``SORT`` and at most ``SMALL`` live keys in the row, they are packed into
        ``SCRATCH`` (each chunk at the count of the live keys before it) and sorted once;
        otherwise ``K`` max-reductions over all the row's slots select them."""
        row = tl.program_id(0)
        slots = tl.arange(0, KP)
        c = tl.arange(0, BLOCK_C)
        c_ok = c < n_chunks
        ok = c_ok[:, None] & (slots < K)[None, :]
        if HAS_CNT:
            cnt = tl.load(CNT + row * n_chunks + c, mask=c_ok, other=0)
            ok &= slots[None, :] < cnt[:, None]
        key = tl.load(KEYS + row.to(tl.int64) * n_chunks * K + c[:, None] * K + slots[None, :],
                      mask=ok, other=-9223372036854775807 - 1)  # [BLOCK_C, KP]
        top = tl.full([KP], -9223372036854775807 - 1, tl.int64)
        live = key != -9223372036854775807 - 1
        per_chunk = tl.sum(live.to(tl.int32), 1)  # [BLOCK_C]
        n_live = tl.sum(per_chunk, 0)
        # a row with no key (a pruned parent's: CNT all 0) keeps no entry
        if n_live > 0:
            if n_live <= (SMALL if SORT else -1):
                before = tl.cumsum(per_chunk, 0) - per_chunk
                pos = before[:, None] + slots[None, :]
                scratch = SCRATCH + row.to(tl.int64) * SMALL
                tl.store(scratch + pos, key, mask=live)
                tl.debug_barrier()
                i_packed = tl.arange(0, SMALL)
                packed = tl.load(scratch + i_packed, mask=i_packed < n_live,
                                 other=-9223372036854775807 - 1)
                packed = tl.reshape(tl.sort(packed, descending=True), (SMALL // KP, KP))
                first = (tl.arange(0, SMALL // KP) == 0)[:, None]
                top = tl.max(tl.where(first, packed, -9223372036854775807 - 1), 0)
            else:  # over the flat slots: one reduction a key, not a 2-D tile's two
                i_flat = tl.arange(0, BLOCK_N)
                f_ok = i_flat < n_chunks * K
                if HAS_CNT:
                    f_ok &= (i_flat % K) < tl.load(CNT + row * n_chunks + i_flat // K,
                                                   mask=f_ok, other=0)
                flat = tl.load(KEYS + row.to(tl.int64) * n_chunks * K + i_flat, mask=f_ok,
                               other=-9223372036854775807 - 1)
                n_top = K
                if HAS_CNT:
                    n_top = tl.minimum(tl.load(NEED + row % n_need), K)
                for j in range(0, n_top):
                    best = tl.max(flat, 0)
                    top = tl.where(slots == j, best, top)
                    flat = tl.where(flat == best, -9223372036854775807 - 1, flat)
        vals = key_score(top)
        y = tl.load(M + row * n_chunks + c, mask=c_ok, other=float("-inf"))
        y += tl.log(tl.load(S + row * n_chunks + c, mask=c_ok, other=1.0))
        y_max = tl.max(y, 0)
        y_max = tl.where(tl.abs(y_max) == float("inf"), 0.0, y_max)
        lse = tl.log(tl.sum(tl.exp(y - y_max), 0)) + y_max
        if LOGPROBS:  # -inf - -inf (a row of -inf) -> -inf, not NaN
            vals = vals - lse
            vals = tl.where(vals != vals, float("-inf"), vals)
        tl.store(VALS + row * K + slots, vals, mask=slots < K)
        tl.store(IDS + row * K + slots, key_tie(top), mask=slots < K)
        tl.store(LSE + row, lse)
        bad = tl.load(NF + row * n_chunks + c, mask=c_ok, other=0)
        tl.store(BAD + row, (tl.max(bad, 0) > 0).to(tl.int8))


def _prune_chunk(V: int, k: int) -> int:
    """A power of two in [256, 4096] leaving at least ``k`` chunks where ``V`` allows."""
    c = 4096
    while c > 256 and -(-V // c) < k:
        c //= 2
    return c


class TopkTuning(NamedTuple):
    """Launch settings of :func:`topk_lse_triton`'s kernels.  None changes a token or its rank;
    the warps of a reduction may round the log-sum-exp (and so the log-probabilities)
    differently."""

    stats_warps: int  # chunk maxima and sums (pruned)
    bound_warps: int  # the pruning bound (pruned)
    topk_warps: int  # per-chunk top k
    merge_warps: int  # per-row merge
    bound_sort: bool  # the bound by one sort of the chunk maxima, not k - 1 reductions
    merge_small: int  # merge by one sort when a row has at most this many live keys (a
    # power of two; 0: never)


def topk_tuning(k: int, rows: int) -> TopkTuning:
    """:func:`topk_lse_triton`'s default launch settings for ``k`` and ``rows`` rows,
    chosen by a sweep at a 151936-token vocabulary (``benchmarks.tree_build_tuning``;
    docs/benchmarks/step-cost-h200.md, "The tree build's top-k and sort settings").  The
    bound by one sort on one warp; 4-warp chunk programs (the ``rows x chunks`` grid
    fills the GPU); the merge by one sort of up to
    ``max(128, 4 kp)`` live keys (``kp``: ``k`` up to a power of two; a typical row has
    fewer, the docs section gives the medians), on 8 warps while a program per row
    leaves SMs idle (up to 132 rows)."""
    kp = next_pow2(k)
    return TopkTuning(stats_warps=8, bound_warps=1, topk_warps=4,
                      merge_warps=8 if rows <= 132 else 4, bound_sort=True,
                      merge_small=max(128, 4 * kp))


def topk_lse_triton(
    x: torch.Tensor,  # [rows, V] logits, last dim contiguous
    k: int,
    chunk: int | None = None,
    pruned: bool = True,
    return_nonfinite: bool = False,
    add: torch.Tensor | None = None,  # [rows // group, V], last dim contiguous
    logprobs: bool = False,
    tuning: TopkTuning | None = None,
) -> tuple[torch.Tensor, ...]:
    """The Triton launcher: per row, the ``k`` best sanitized values and their token
    ids, and the log-sum-exp.

    Returns ``(values [rows, k] float32, token_ids [rows, k] int64, lse [rows]
    float32)``, ranked by value descending, ties by lower id; with ``logprobs`` the
    values are log-probabilities (``value - lse``, -inf for a row of -inf); with
    ``return_nonfinite`` also ``nonfinite [rows] bool``: the row held a NaN or an inf
    (found in the same pass over the logits).  ``pruned``: the variant (module
    docstring); ``k <= topk_lse_max_k(pruned)``.  ``chunk``: vocabulary entries per
    program (default: the variant's).  ``add``: a term shared by groups of consecutive
    rows, row ``i`` taking ``x[i] + add[i // group]`` (float32 sum, then sanitized), as
    if that sum were ``x``, without writing it.  ``tuning`` overrides
    :func:`topk_tuning`.  Four launches pruned, two unpruned, no host sync.
    """
    rows, V = x.shape
    assert x.stride(1) == 1 and 0 < k <= min(topk_lse_max_k(pruned), V)
    if add is not None:
        assert add.dim() == 2 and add.shape[1] == V and add.stride(1) == 1
        assert rows % max(add.shape[0], 1) == 0
    chunk = chunk or (_prune_chunk(V, k) if pruned else 4096)
    n_chunks = triton.cdiv(V, chunk)
    tuning = tuning or topk_tuning(k, rows)
    assert tuning.merge_small & (tuning.merge_small - 1) == 0, "merge_small: a power of two"
    dev = x.device
    keys = torch.empty((rows, n_chunks * k), dtype=torch.int64, device=dev)
    chunk_max = torch.empty((rows, n_chunks), dtype=torch.float32, device=dev)
    chunk_sum = torch.empty_like(chunk_max)  # sum of exp(x - chunk max)
    chunk_bad = torch.empty((rows, n_chunks), dtype=torch.int32, device=dev)
    vals = torch.empty((rows, k), dtype=torch.float32, device=dev)
    ids = torch.empty((rows, k), dtype=torch.int64, device=dev)
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    nonfinite = torch.empty(rows, dtype=torch.bool, device=dev)
    if not rows:
        return (vals, ids, lse, nonfinite) if return_nonfinite else (vals, ids, lse)
    sum_dtype = torch.float32 if add is not None else x.dtype
    big = min(float(torch.finfo(sum_dtype).max), float(torch.finfo(torch.float32).max))
    a, a_stride, a_group = ((add, add.stride(0), rows // max(add.shape[0], 1))
                            if add is not None else (x, 0, 1))
    grid = (rows, n_chunks)
    block_c = next_pow2(n_chunks)
    kp = next_pow2(k)
    bound = lse  # [rows] the pruning bound, overwritten by the merge's lse; unread unpruned
    if pruned:
        _chunk_max_sum_kernel[grid](x, a, chunk_max, chunk_sum, chunk_bad, V, x.stride(0),
                                    a_stride, a_group, n_chunks, big, CHUNK=chunk,
                                    HAS_ADD=add is not None, num_warps=tuning.stats_warps)
        _bound_kernel[(rows,)](chunk_max, bound, n_chunks, K=k, BLOCK_C=block_c,
                               SORT=tuning.bound_sort and k <= block_c,
                               num_warps=tuning.bound_warps)
    _chunk_topk_kernel[grid](
        x, a, keys, chunk_max, chunk_sum, chunk_bad, bound, V, x.stride(0), a_stride,
        a_group, n_chunks, big, K=k, KP=kp, CHUNK=chunk,
        PRUNED=pruned, HAS_ADD=add is not None, num_warps=tuning.topk_warps)
    small = max(tuning.merge_small, kp)
    scratch = (torch.empty((rows, small), dtype=torch.int64, device=dev)
               if tuning.merge_small else keys)
    _merge_kernel[(rows,)](
        keys, chunk_bad, chunk_bad, 1, chunk_max, chunk_sum, chunk_bad, vals, ids, lse,
        nonfinite.view(torch.int8), scratch, n_chunks, K=k, KP=kp, BLOCK_C=block_c,
        BLOCK_N=next_pow2(keys.shape[1]), SMALL=small,
        SORT=tuning.merge_small > 0, LOGPROBS=logprobs, HAS_CNT=False,
        num_warps=tuning.merge_warps)
    return (vals, ids, lse, nonfinite) if return_nonfinite else (vals, ids, lse)
