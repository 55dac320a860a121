"""Per-depth draft candidates: top-k and log-sum-exp of each row of the draft logits.

Each program takes one chunk of one row: it sanitizes the logits (NaN -> -inf, +inf ->
the dtype's largest finite value) and extracts the chunk's top ``k`` as unique int64 keys
(order-preserving float bits above the inverted token id), so ties resolve to the lower
token id by construction.  One program per row then merges: the row's top ``k`` of the
``chunks * k`` keys (``k`` max-reductions), unpacked to values and ids (or
log-probabilities), the log-sum-exp from the chunks' maxima and sums, and the row's
non-finite flag.  Reference: ``depth_candidates`` on CPU (a stable sort).  With the
pruning bound and this merge in Triton (four launches, in place of ~20 around two
``torch.topk`` and a ``logsumexp``), the top-k of one request at budget 15 (15 rows)
takes 0.026 ms in a CUDA graph on the H200, 0.072 ms before
(``benchmarks/gpu_step_parts.py``, column topk/g; docs/benchmarks/step-cost-h200.md).

Two variants (``pruned``):

* one pass: each program also writes its chunk's max and sum of exponentials
  (for the log-sum-exp) and runs ``k`` max-reductions over its chunk.  At batch 32 of a
  151936-token vocabulary this was the DDTree step's largest own kernel on the H200
  (0.78 ms per step for 480 rows, k = 15, in a profile of the whole step):
  compute-bound on the ``k`` reductions.
* pruned (the default: it halves the tree build at 32 requests x budget 15 on the H200,
  1.36 -> 0.72 ms, docs/benchmarks.md "Tree build and tree attention"): a first kernel
  writes the chunk maxima and sums; ``t`` = the ``k``-th largest chunk maximum of the row
  (one program per row) is a lower bound on the row's ``k``-th largest value (the top
  ``k`` chunk maxima are ``k`` distinct entries >= ``t``), so only entries >= ``t`` can
  be in the top ``k``.  The second kernel skips chunks whose maximum is below ``t`` and
  runs one reduction per entry >= ``t`` (at most ``k``).  Smaller chunks for larger
  ``k`` keep at least ``k`` chunks per row where the vocabulary allows.  Same result bit for bit.
"""

from __future__ import annotations

import torch

from vllm_ddtree.kernels.triton_utils import HAS_TRITON, tl, triton

if HAS_TRITON:
    from vllm_ddtree.kernels.build_tables import key_score, key_tie, pack_key

# Largest k each variant serves; beyond it the tree build uses torch.topk.  One pass:
# its k reductions per chunk are faster than torch.topk only up to k = 16 on the H200
# (k = 32 made the build 1.35 -> 2.2 ms at 32 requests on the H200).
ONE_PASS_MAX_K = 16
PRUNED_MAX_K = 64


def topk_lse_max_k(pruned: bool) -> int:
    """Largest ``k`` :func:`topk_lse` serves in the given variant."""
    return PRUNED_MAX_K if pruned else ONE_PASS_MAX_K


if HAS_TRITON:

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
        bad = ok & ((x != x) | (tl.abs(x) == float("inf")))  # NaN or +-inf
        x = tl.where(x != x, float("-inf"), x)
        x = tl.where(x == float("inf"), big, x)
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
    def _kth_largest_chunk_max(M, row, n_chunks, K: tl.constexpr, BLOCK_C: tl.constexpr):
        """The row's ``K``-th largest chunk maximum, duplicates counted (``torch.topk``'s
        ``values[K - 1]``); -inf when the row has fewer than ``K`` chunks."""
        c = tl.arange(0, BLOCK_C)
        m = tl.load(M + row * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
        key = tl.where(c < n_chunks, pack_key(m, c.to(tl.int64)),  # unique per chunk
                       -9223372036854775807 - 1)
        for _ in range(0, K - 1):
            key = tl.where(key == tl.max(key, 0), -9223372036854775807 - 1, key)
        kth = tl.max(key, 0)
        return tl.where(kth == -9223372036854775807 - 1, float("-inf"), key_score(kth))

    @triton.jit
    def _bound_kernel(M, T, n_chunks, K: tl.constexpr, BLOCK_C: tl.constexpr):
        row = tl.program_id(0)
        tl.store(T + row, _kth_largest_chunk_max(M, row, n_chunks, K, BLOCK_C))

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
    def _merge_kernel(KEYS, M, S, NF, VALS, IDS, LSE, BAD, n_keys, n_chunks,
                      K: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_C: tl.constexpr, LOGPROBS: tl.constexpr):
        """One row: its top ``K`` of ``n_keys`` unique keys, unpacked; the log-sum-exp of
        the chunk maxima and sums (``torch.logsumexp``'s formula); the non-finite flag."""
        row = tl.program_id(0)
        slots = tl.arange(0, KP)
        i = tl.arange(0, BLOCK_N)
        key = tl.load(KEYS + row.to(tl.int64) * n_keys + i, mask=i < n_keys,
                      other=-9223372036854775807 - 1)
        top = tl.full([KP], -9223372036854775807 - 1, tl.int64)
        for j in range(0, K):
            best = tl.max(key, 0)
            top = tl.where(slots == j, best, top)
            key = tl.where(key == best, -9223372036854775807 - 1, key)
        vals = key_score(top)
        c = tl.arange(0, BLOCK_C)
        y = tl.load(M + row * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
        y += tl.log(tl.load(S + row * n_chunks + c, mask=c < n_chunks, other=1.0))
        y_max = tl.max(y, 0)
        y_max = tl.where(tl.abs(y_max) == float("inf"), 0.0, y_max)
        lse = tl.log(tl.sum(tl.exp(y - y_max), 0)) + y_max
        if LOGPROBS:  # -inf - -inf (a row of -inf) -> -inf, not NaN
            vals = vals - lse
            vals = tl.where(vals != vals, float("-inf"), vals)
        tl.store(VALS + row * K + slots, vals, mask=slots < K)
        tl.store(IDS + row * K + slots, key_tie(top), mask=slots < K)
        tl.store(LSE + row, lse)
        bad = tl.load(NF + row * n_chunks + c, mask=c < n_chunks, other=0)
        tl.store(BAD + row, (tl.max(bad, 0) > 0).to(tl.int8))


def _prune_chunk(V: int, k: int) -> int:
    """A power of two in [256, 4096] leaving at least ``k`` chunks where ``V`` allows."""
    c = 4096
    while c > 256 and -(-V // c) < k:
        c //= 2
    return c


def topk_lse(
    x: torch.Tensor,  # [rows, V] logits, last dim contiguous
    k: int,
    chunk: int | None = None,
    pruned: bool = True,
    return_nonfinite: bool = False,
    add: torch.Tensor | None = None,  # [rows // group, V], last dim contiguous
    logprobs: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Per row, the ``k`` best sanitized values and their token ids, and the log-sum-exp.

    Returns ``(values [rows, k] float32, token_ids [rows, k] int64, lse [rows]
    float32)``, ranked by value descending, ties by lower id; with ``logprobs`` the
    values are log-probabilities (``value - lse``, -inf for a row of -inf); with
    ``return_nonfinite`` also ``nonfinite [rows] bool``: the row held a NaN or an inf
    (found in the same pass over the logits).  ``pruned``: the variant (module
    docstring); ``k <= topk_lse_max_k(pruned)``.  ``chunk``: vocabulary entries per
    program (default: the variant's).  ``add``: a term shared by groups of consecutive
    rows, row ``i`` taking ``x[i] + add[i // group]`` (float32 sum, then sanitized), as
    if that sum were ``x``, without writing it.  Four launches pruned, two unpruned, no
    host sync.
    """
    rows, V = x.shape
    assert x.stride(1) == 1 and 0 < k <= min(topk_lse_max_k(pruned), V)
    if add is not None:
        assert add.dim() == 2 and add.shape[1] == V and add.stride(1) == 1
        assert rows % max(add.shape[0], 1) == 0
    chunk = chunk or (_prune_chunk(V, k) if pruned else 4096)
    n_chunks = triton.cdiv(V, chunk)
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
    block_c = triton.next_power_of_2(n_chunks)
    bound = lse  # [rows] the pruning bound, overwritten by the merge's lse; unread unpruned
    if pruned:
        _chunk_max_sum_kernel[grid](x, a, chunk_max, chunk_sum, chunk_bad, V, x.stride(0),
                                    a_stride, a_group, n_chunks, big, CHUNK=chunk,
                                    HAS_ADD=add is not None, num_warps=8)
        _bound_kernel[(rows,)](chunk_max, bound, n_chunks, K=k, BLOCK_C=block_c,
                               num_warps=4)
    _chunk_topk_kernel[grid](
        x, a, keys, chunk_max, chunk_sum, chunk_bad, bound, V, x.stride(0), a_stride,
        a_group, n_chunks, big, K=k, KP=triton.next_power_of_2(k), CHUNK=chunk,
        PRUNED=pruned, HAS_ADD=add is not None, num_warps=8)
    _merge_kernel[(rows,)](
        keys, chunk_max, chunk_sum, chunk_bad, vals, ids, lse, nonfinite.view(torch.int8),
        keys.shape[1], n_chunks, K=k, KP=triton.next_power_of_2(k),
        BLOCK_N=triton.next_power_of_2(keys.shape[1]), BLOCK_C=block_c, LOGPROBS=logprobs,
        num_warps=4)
    return (vals, ids, lse, nonfinite) if return_nonfinite else (vals, ids, lse)
