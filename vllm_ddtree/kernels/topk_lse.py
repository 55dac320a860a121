"""Per-depth draft candidates in one read of the logits: top-k and log-sum-exp.

Each program takes one chunk of one row: it sanitizes the logits (NaN -> -inf, +inf ->
the dtype's largest finite value), writes the chunk's partial max and sum of
exponentials, and extracts the chunk's top ``k`` as unique int64 keys
(order-preserving float bits above the inverted token id), so ties resolve to the lower
token id by construction.  A small ``torch.topk`` over the ``chunks * k`` keys then gives
the row's top ``k`` exactly.  Reference: ``depth_candidates`` on CPU (a stable sort).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

MAX_K = 16  # iterative extraction costs k passes over each chunk: measured faster than
# torch.topk only up to k = 16 on H200 (docs/benchmarks/core-gpu.md)
_LOW32 = (1 << 32) - 1

if triton is not None:

    @triton.jit
    def _chunk_topk_lse_kernel(X, KEYS, M, S, V, stride, n_chunks, big,
                               K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        ok = offs < V
        x = tl.load(X + row.to(tl.int64) * stride + offs, mask=ok, other=float("-inf"))
        x = x.to(tl.float32)
        x = tl.where(x != x, float("-inf"), x)
        x = tl.where(x == float("inf"), big, x)
        m = tl.max(x, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(tl.exp(x - m_safe), 0)
        tl.store(M + row * n_chunks + c, m)
        tl.store(S + row * n_chunks + c, s)
        xs = x + 0.0
        bits = xs.to(tl.int32, bitcast=True).to(tl.int64)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        key = (bits << 32) | (4294967295 - offs.to(tl.int64))
        key = tl.where(ok, key, -9223372036854775807 - 1)
        slots = tl.arange(0, KP)
        res = tl.full([KP], -9223372036854775807 - 1, tl.int64)
        for i in range(K):
            best = tl.max(key, 0)
            res = tl.where(slots == i, best, res)
            key = tl.where(key == best, -9223372036854775807 - 1, key)
        tl.store(KEYS + (row * n_chunks + c) * K + slots, res, mask=slots < K)


def topk_lse(x: torch.Tensor, k: int, chunk: int = 4096) -> tuple[torch.Tensor, ...]:
    """``x [rows, V]`` -> ``(values [rows, k] float32 sanitized, token ids [rows, k],
    lse [rows] float32)``, ranked by value descending, ties by lower id."""
    rows, V = x.shape
    assert x.stride(1) == 1 and 0 < k <= min(MAX_K, V)
    n_chunks = triton.cdiv(V, chunk)
    keys = torch.empty((rows, n_chunks * k), dtype=torch.int64, device=x.device)
    m = torch.empty((rows, n_chunks), dtype=torch.float32, device=x.device)
    s = torch.empty_like(m)
    big = min(float(torch.finfo(x.dtype).max), float(torch.finfo(torch.float32).max))
    if rows:
        _chunk_topk_lse_kernel[(rows, n_chunks)](
            x, keys, m, s, V, x.stride(0), n_chunks, big,
            K=k, KP=triton.next_power_of_2(k), CHUNK=chunk, num_warps=8)
    top = torch.topk(keys, k, dim=-1).values  # unique keys: exact, sorted best first
    idx = _LOW32 - (top & _LOW32)
    bits = top >> 32
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    vals = bits.to(torch.int32).view(torch.float32)
    lse = torch.logsumexp(m + torch.log(s), dim=-1)
    return vals, idx, lse
