"""Per-depth draft candidates: top-k and log-sum-exp of each row of the draft logits.

Each program takes one chunk of one row: it sanitizes the logits (NaN -> -inf, +inf ->
the dtype's largest finite value) and extracts the chunk's top ``k`` as unique int64 keys
(order-preserving float bits above the inverted token id), so ties resolve to the lower
token id by construction.  A small ``torch.topk`` over the ``chunks * k`` keys then gives
the row's top ``k`` exactly.  Reference: ``depth_candidates`` on CPU (a stable sort).

Two variants (``pruned``):

* one pass: each program also writes its chunk's max and sum of exponentials
  (for the log-sum-exp) and runs ``k`` max-reductions over its chunk.  At batch 32 of a
  151936-token vocabulary this was the DDTree step's largest own kernel on the H200
  (0.78 ms per step for 480 rows, k = 15, in a profile of the whole step):
  compute-bound on the ``k`` reductions.
* pruned (the default: it halves the tree build at 32 requests x budget 15 on the H200,
  1.36 -> 0.72 ms, docs/benchmarks.md "Tree build and tree attention"): a first kernel writes the
  chunk maxima and sums; ``t`` = the ``k``-th largest chunk maximum of the row is a lower
  bound on the row's ``k``-th largest value (the top ``k`` chunk maxima are ``k``
  distinct entries >= ``t``), so only entries >= ``t`` can be in the top ``k``.  The
  second kernel skips chunks whose maximum is below ``t`` and runs one reduction per
  entry >= ``t`` (at most ``k``).  Smaller chunks for larger ``k`` keep at least ``k``
  chunks per row where the vocabulary allows.  Same result bit for bit.
"""

from __future__ import annotations

import torch

from vllm_ddtree.kernels.build_tables import unpack_scores, unpack_ties
from vllm_ddtree.kernels.triton_utils import HAS_TRITON, tl, triton

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
        bits = (x + 0.0).to(tl.int32, bitcast=True).to(tl.int64)  # + 0.0: -0.0 -> +0.0
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        key = (bits << 32) | (4294967295 - offs.to(tl.int64))
        key = tl.where(ok, key, -9223372036854775807 - 1)
        if PRUNED:
            n = tl.minimum(tl.sum((ok & (x >= t)).to(tl.int32), 0), K)
        else:
            n = K
        for i in range(0, n):
            best = tl.max(key, 0)
            res = tl.where(slots == i, best, res)
            key = tl.where(key == best, -9223372036854775807 - 1, key)
        tl.store(out, res, mask=slots < K)


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
) -> tuple[torch.Tensor, ...]:
    """Per row, the ``k`` best sanitized values and their token ids, and the log-sum-exp.

    Returns ``(values [rows, k] float32, token_ids [rows, k] int64, lse [rows]
    float32)``, ranked by value descending, ties by lower id; with
    ``return_nonfinite`` also ``nonfinite [rows] bool``: the row held a NaN or an inf
    (found in the same pass over the logits).  ``pruned``: the variant (module
    docstring); ``k <= topk_lse_max_k(pruned)``.  ``chunk``: vocabulary entries per
    program (default: the variant's).  ``add``: a term shared by groups of consecutive
    rows, row ``i`` taking ``x[i] + add[i // group]`` (float32 sum, then sanitized), as
    if that sum were ``x``, without writing it.  No host sync.
    """
    rows, V = x.shape
    assert x.stride(1) == 1 and 0 < k <= min(topk_lse_max_k(pruned), V)
    if add is not None:
        assert add.dim() == 2 and add.shape[1] == V and add.stride(1) == 1
        assert rows % max(add.shape[0], 1) == 0
    chunk = chunk or (_prune_chunk(V, k) if pruned else 4096)
    n_chunks = triton.cdiv(V, chunk)
    keys = torch.empty((rows, n_chunks * k), dtype=torch.int64, device=x.device)
    chunk_max = torch.empty((rows, n_chunks), dtype=torch.float32, device=x.device)
    chunk_sum = torch.empty_like(chunk_max)  # sum of exp(x - chunk max)
    chunk_bad = torch.empty((rows, n_chunks), dtype=torch.int32, device=x.device)
    sum_dtype = torch.float32 if add is not None else x.dtype
    big = min(float(torch.finfo(sum_dtype).max), float(torch.finfo(torch.float32).max))
    a, a_stride, a_group = ((add, add.stride(0), rows // max(add.shape[0], 1))
                            if add is not None else (x, 0, 1))
    bound = chunk_max  # [rows] when pruned; unread otherwise
    if rows:
        grid = (rows, n_chunks)
        if pruned:
            _chunk_max_sum_kernel[grid](x, a, chunk_max, chunk_sum, chunk_bad, V, x.stride(0),
                                        a_stride, a_group, n_chunks, big, CHUNK=chunk,
                                        HAS_ADD=add is not None, num_warps=8)
            if n_chunks >= k:
                bound = torch.topk(chunk_max, k, dim=-1).values[:, k - 1].contiguous()
            else:  # fewer chunks than k: no bound
                bound = torch.full((rows,), float("-inf"), device=x.device)
        _chunk_topk_kernel[grid](
            x, a, keys, chunk_max, chunk_sum, chunk_bad, bound, V, x.stride(0), a_stride,
            a_group, n_chunks, big, K=k, KP=triton.next_power_of_2(k), CHUNK=chunk,
            PRUNED=pruned, HAS_ADD=add is not None, num_warps=8)
    top = torch.topk(keys, k, dim=-1).values  # unique keys: exact, sorted best first
    lse = torch.logsumexp(chunk_max + torch.log(chunk_sum), dim=-1)
    if return_nonfinite:
        return unpack_scores(top), unpack_ties(top), lse, chunk_bad.amax(dim=-1) > 0
    return unpack_scores(top), unpack_ties(top), lse
