"""Tree attention for DDTree verify rows over a paged KV cache.

Request ``r`` has ``prefix_lens[r]`` context tokens in its paged cache (logical
positions ``0 .. prefix_len - 1``) followed by its verify rows (row ``i`` at logical
position ``prefix_len + i``; row 0 is the root).  Its query rows are
``q[query_start[r] : query_start[r + 1]]``.  Query row ``q`` sees every prefix token
(when ``include_prefix``) and the verify rows set in ``ancestor_bits[q]`` (its ancestors
and itself).  Both implementations return ``(out [T, Hq, hd], lse [T, Hq] float32)``;
with ``include_prefix=False`` the result covers the tree part only, to be merged with a
prefix attention computed elsewhere (:func:`merge_attn_states`).

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (vLLM's
FlashAttention layout), ``block_table [R, max_blocks]``.

The Triton kernel runs one program per (request, block of ``BLOCK_M`` query rows, group
of ``HEADS`` query heads sharing one KV head): the block's rows of those heads form one
tile (row-major: a query row's heads are adjacent), so each K/V tile is read once per
program.  ``HEADS = Hq // Hkv`` reads K/V once per KV head; fewer heads a program give
more programs, which a small batch needs to fill the GPU.  Keys are the whole cache range
with ``include_prefix``, else only the request's verify rows (usually one key tile).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

from vllm_ddtree.kernels.triton_utils import HAS_TRITON, next_pow2, tl, triton

# The Triton interpreter computes bf16 dot products wrongly (numpy has no bf16), so under
# TRITON_INTERPRET=1 bf16 tiles are upcast to float32 first.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, hd]
    block_table_r: torch.Tensor,  # [max_blocks] one request's blocks
    n: int,
) -> torch.Tensor:
    """The request's first ``n`` logical cache entries."""
    bs = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    blocks = block_table_r.long()[pos // bs]
    return cache[blocks, pos % bs]  # [n, Hkv, hd]


def tree_attention_torch(
    q: torch.Tensor,  # [T, Hq, hd]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, hd]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, hd]
    block_table: torch.Tensor,  # [R, max_blocks] block ids
    query_start: torch.Tensor,  # [R + 1] first query row per request
    prefix_lens: torch.Tensor,  # [R] context tokens in the cache
    ancestor_bits: torch.Tensor,  # [T, words] int32: bit i = verify row i is visible
    scale: float | None = None,
    include_prefix: bool = True,
    query_end: torch.Tensor | None = None,  # [R] end of each request's rows
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: dense masked softmax attention in float32, one request at a time.
    ``query_end`` as in :func:`tree_attention_triton` (rows outside stay zero)."""
    T, Hq, hd = q.shape
    Hkv = k_cache.shape[2]
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    out = torch.zeros_like(q)
    lse = torch.full((T, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    qs, pl = query_start.tolist(), prefix_lens.tolist()
    qe = qs[1:] if query_end is None else query_end.tolist()
    for r in range(len(pl)):
        a, b, p = qs[r], qe[r], pl[r]
        n = b - a
        if n == 0:
            continue
        k = _gather_kv(k_cache, block_table[r], p + n).float()
        v = _gather_kv(v_cache, block_table[r], p + n).float()
        k = k.repeat_interleave(Hq // Hkv, dim=1)  # [L, Hq, hd]
        v = v.repeat_interleave(Hq // Hkv, dim=1)
        rows = torch.arange(n, device=q.device)
        words = ancestor_bits[a:b][:, rows // 32].long()
        tree_vis = ((words >> (rows % 32)) & 1).bool()  # [n, n]
        vis = torch.cat([torch.full((n, p), include_prefix, device=q.device), tree_vis], 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale
        s = s.masked_fill(~vis.unsqueeze(0), float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # [Hq, n]
        w = torch.exp(s - row_lse.unsqueeze(-1))
        out[a:b] = torch.einsum("hqk,khd->qhd", w, v).to(q.dtype)
        lse[a:b] = row_lse.transpose(0, 1)
    return out, lse


def merge_attn_states(
    o1: torch.Tensor,  # [T, Hq, hd]
    lse1: torch.Tensor,  # [T, Hq] float32
    o2: torch.Tensor,  # [T, Hq, hd]
    lse2: torch.Tensor,  # [T, Hq] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets (log-sum-exp weighted):
    ``(out [T, Hq, hd] in o1's dtype, lse [T, Hq] float32)``."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).nan_to_num(0.0).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).nan_to_num(0.0).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype), lse


if HAS_TRITON:

    # The prefix log-sum-exp's strides follow the step's token count: specialized (on
    # divisibility by 16), a step whose count falls in another class would compile the
    # kernel again mid-serving.  They index one float per row, so nothing is lost.
    @triton.jit(do_not_specialize=["s_it", "s_ih"])
    def _tree_attn_kernel(
        Q, K, V, OUT, LSE, BT, QS, QE, PL, ANC, LSE_IN,
        scale,
        s_qt, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ot, s_oh, s_bt, s_anc,
        s_lt, s_lh, s_it, s_ih,
        GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr,
        INCLUDE_PREFIX: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
        HAS_QE: tl.constexpr, MERGE: tl.constexpr, STORE_LSE: tl.constexpr,
    ):
        # One program: query rows mb * BLOCK_M .. + BLOCK_M of request r for the HEADS
        # query heads h0 .. h0 + HEADS of KV head kvh, as one [TILE_M, HEAD_DIM] tile
        # (tile row i = query row i // HEADS, head h0 + i % HEADS; rows past
        # BLOCK_M * HEADS pad the tile to a power of two), so each K/V tile is loaded
        # once for all of them.
        r = tl.program_id(0)
        mb = tl.program_id(1)
        h0 = tl.program_id(2) * HEADS
        kvh = h0 // GROUP
        q0 = tl.load(QS + r)
        if HAS_QE:
            n_rows = tl.load(QE + r) - q0
        else:
            n_rows = tl.load(QS + r + 1) - q0
        if mb * BLOCK_M >= n_rows:
            return
        prefix = tl.load(PL + r)
        offs_i = tl.arange(0, TILE_M)
        offs_m = mb * BLOCK_M + offs_i // HEADS  # query row (within the request)
        head = h0 + offs_i % HEADS
        offs_d = tl.arange(0, HEAD_DIM)
        m_ok = (offs_i < BLOCK_M * HEADS) & (offs_m < n_rows)
        tok = q0 + offs_m
        q = tl.load(Q + tok[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
                    mask=m_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        if MERGE:
            # Continue the online softmax from a partial result over the prefix
            # (FlashAttention's output and log-sum-exp; an empty or non-finite LSE
            # means "no prefix keys").
            lse0 = tl.load(LSE_IN + tok * s_it + head * s_ih, mask=m_ok,
                           other=float("-inf"))
            has = (lse0 > float("-inf")) & (lse0 < float("inf"))
            o0 = tl.load(OUT + tok[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :],
                         mask=m_ok[:, None] & has[:, None], other=0.0).to(tl.float32)
            m_i = tl.where(has, lse0, float("-inf"))
            l_i = tl.where(has, 1.0, 0.0)
            acc = tl.where(has[:, None], o0, 0.0)
        else:
            m_i = tl.full([TILE_M], float("-inf"), tl.float32)
            l_i = tl.zeros([TILE_M], tl.float32)
            acc = tl.zeros([TILE_M, HEAD_DIM], tl.float32)
        start = 0 if INCLUDE_PREFIX else prefix
        end = prefix + n_rows
        for k0 in range(start, end, BLOCK_N):
            offs_n = k0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            # 64-bit block offsets: one layer's cache may exceed 2**31 elements
            blk = tl.load(BT + r * s_bt + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
            blk = blk.to(tl.int64)
            slot = offs_n % BLOCK_SIZE
            k_off = blk * s_kb + slot * s_ks + kvh * s_kh  # [BLOCK_N]
            v_off = blk * s_vb + slot * s_vs + kvh * s_vh
            k = tl.load(K + k_off[None, :] + offs_d[:, None], mask=n_ok[None, :], other=0.0)
            v = tl.load(V + v_off[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if IEEE:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = s * scale
            t = offs_n - prefix  # verify row of the key (negative in the prefix)
            in_tree = t >= 0
            tt = tl.where(in_tree, t, 0)
            # ancestor bits are per query row (the HEADS heads of a row share them)
            if INCLUDE_PREFIX or BLOCK_N > 32:
                words = tl.load(ANC + tok[:, None] * s_anc + (tt // 32)[None, :],
                                mask=m_ok[:, None] & (in_tree & n_ok)[None, :], other=0)
            else:
                # key tiles start at verify row 0 and BLOCK_N divides 32: one word a row
                words = tl.load(ANC + tok * s_anc + (k0 - prefix) // 32, mask=m_ok,
                                other=0)[:, None]
            bit = (words >> (tt % 32)[None, :]) & 1
            vis = bit != 0
            if INCLUDE_PREFIX:
                vis = vis | (~in_tree)[None, :]
            vis = vis & n_ok[None, :] & m_ok[:, None]
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
        # (the [TILE_M, HEAD_DIM] pointers are rebuilt here, not kept live over the loop)
        tl.store(OUT + tok[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=m_ok[:, None])
        if STORE_LSE:
            tl.store(LSE + tok * s_lt + head * s_lh, lse, mask=m_ok)


class TreeAttnTiling(NamedTuple):
    """One :func:`tree_attention_triton` launch's tiling."""

    block_m: int  # query rows a program
    heads: int  # query heads a program (a divisor of the group: one KV head)
    tile_m: int  # block_m * heads padded to a power of two, >= 16 (tl.dot)
    block_n: int  # keys a tile
    num_warps: int


def tree_attn_tiling(
    max_rows: int,
    group: int,
    head_dim: int,
    include_prefix: bool,
    block_m: int | None = None,
    block_n: int | None = None,
    heads: int | None = None,
    num_warps: int | None = None,
    num_reqs: int | None = None,
) -> TreeAttnTiling:
    """The tiling of one :func:`tree_attention_triton` launch: ``block_m`` query rows of
    ``heads`` query heads (all ``group`` heads of a KV head by default) per program,
    padded to a ``tile_m``-row tile, keys in tiles of ``block_n``.  Derived from
    ``max_rows`` (fixed per budget) and, for tree keys only, ``num_reqs`` (fixed per
    captured CUDA graph), never from a step's token count, so serving compiles two
    variants of the tree-keys mode and one of the whole-cache mode."""
    heads = group if heads is None else heads
    if heads < 1 or group % heads:
        raise ValueError(f"heads={heads} must divide the query group {group}")
    # The fp32 accumulator is TILE_M x head_dim: at most 128 x 128 (64 KiB, 64 registers
    # a thread over 8 warps), i.e. 128 rows for head_dim <= 128 and 64 for 256.
    max_tile = max(16, min(128, 16384 // head_dim))
    # Tree keys of at most 128 verify rows in all (batch 8 at budget 15, 2 at 63): the
    # launch is latency-bound, and 16-row tiles (one 16-row tl.dot) give the most
    # programs to spread it over (benchmarks.tree_attn_tiling compares them with
    # whole-tree tiles: docs/benchmarks/step-cost-h200.md, "Tree-attention kernel sweep").
    small = (not include_prefix and num_reqs is not None and num_reqs * max_rows <= 128
             and block_m is None)
    if small:
        block_m = max(1, min(max_rows, 16 // heads))
    if block_m is None:
        # a 16-row block holds a whole budget-15 tree; over the tree keys of trees wider
        # than 32 rows, 32-row blocks (fewer programs re-reading the same keys; same
        # docs section); narrower trees shrink it
        rows = 32 if not include_prefix and max_rows > 32 else 16
        block_m = max(1, min(max_rows, rows, max_tile // heads))
    tile_m = max(16, next_pow2(block_m * heads))
    if block_n is None:
        if include_prefix:
            block_n = 32  # the prefix is long: FlashAttention-like tiles
        else:
            # only the request's own rows are keys: one tile of them when they fit
            # (K + V of a tile stay <= 32 KiB a pipeline stage)
            block_n = min(64, 8192 // head_dim, max(16, next_pow2(max_rows)))
    if num_warps is None:
        # 4 warps hold a 64 x 128 tile with 16..32-key tiles without spilling, and over
        # tree keys alone (one key tile) up to 128 x 128 with 32 keys; wider tiles take
        # 8, and so do 64-key tiles under a small batch's 16-row tiles (same docs section)
        limit = 64 * (128 + 32) if include_prefix else 128 * (128 + 32)
        wide = tile_m * (head_dim + block_n) > limit
        num_warps = 8 if wide or (small and block_n >= 64) else 4
    return TreeAttnTiling(block_m, heads, tile_m, block_n, num_warps)


def tree_attention_triton(
    q: torch.Tensor,  # [T, Hq, hd]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, hd]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, hd]
    block_table: torch.Tensor,  # [R, max_blocks] block ids
    query_start: torch.Tensor,  # [R + 1] first query row per request
    prefix_lens: torch.Tensor,  # [R] context tokens in the cache
    ancestor_bits: torch.Tensor,  # [T, words] int32: bit i = verify row i is visible
    scale: float | None = None,
    include_prefix: bool = True,
    max_rows: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    *,
    heads: int | None = None,
    num_warps: int | None = None,
    query_end: torch.Tensor | None = None,  # [R] end of each request's rows
    out: torch.Tensor | None = None,  # [T, Hq, hd]
    prefix_out_lse: torch.Tensor | None = None,  # [Hq, T] float32
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton kernel; same contract as :func:`tree_attention_torch`, plus:

    * ``max_rows`` (the widest request's row count, e.g. ``1 + budget``) sizes the grid
      without reading ``query_start`` on the host;
    * ``query_end [R]``: request ``r``'s rows are ``query_start[r] .. query_end[r]``
      (default ``query_start[r + 1]``); rows outside every range are left untouched;
    * ``out``: write into this ``[T, Hq, hd]`` tensor (in place) instead of a new one;
    * ``prefix_out_lse``: an ``[Hq, T]`` (or any 2-D view indexed ``[h, t]``) log-sum-exp
      of a prefix attention already stored in ``out``; the tree keys are merged into it
      (use with ``include_prefix=False``).  A non-finite entry means "no prefix keys".
    * ``return_lse=False`` skips writing the log-sum-exp (returns ``(out, None)``).
    * ``block_m`` (query rows per program, any positive number), ``block_n`` (keys
      per tile, a power of two >= 16), ``heads`` (query heads per program, a divisor of
      ``Hq // Hkv``) and ``num_warps`` override :func:`tree_attn_tiling`'s choice.
    """
    if not HAS_TRITON:
        raise RuntimeError("tree_attention_triton needs triton")
    T, Hq, hd = q.shape
    R = block_table.shape[0]
    Hkv = k_cache.shape[2]
    if hd not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim {hd} is not supported (16..256, power of two)")
    if max_rows is None:
        max_rows = int((query_start[1:] - query_start[:-1]).max()) if R else 0
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    merge = prefix_out_lse is not None
    if merge and out is None:
        raise ValueError("prefix_out_lse needs out= holding the prefix output")
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty((T, Hq), dtype=torch.float32, device=q.device) if return_lse else None
    if R == 0 or max_rows == 0:
        return out, lse
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert out.stride(2) == 1
    assert Hq % Hkv == 0, (Hq, Hkv)
    group = Hq // Hkv
    tiling = tree_attn_tiling(max_rows, group, hd, include_prefix, block_m, block_n,
                              heads, num_warps, num_reqs=R)
    lse_arg = lse if lse is not None else out
    lse_in = prefix_out_lse if merge else out
    grid = (R, triton.cdiv(max_rows, tiling.block_m), Hq // tiling.heads)
    _tree_attn_kernel[grid](
        q, k_cache, v_cache, out, lse_arg, block_table, query_start,
        query_end if query_end is not None else query_start, prefix_lens, ancestor_bits,
        lse_in, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_table.stride(0), ancestor_bits.stride(0),
        lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
        prefix_out_lse.stride(1) if merge else 0, prefix_out_lse.stride(0) if merge else 0,
        GROUP=group, HEADS=tiling.heads, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=hd,
        BLOCK_M=tiling.block_m, TILE_M=tiling.tile_m, BLOCK_N=tiling.block_n,
        INCLUDE_PREFIX=include_prefix,
        IEEE=q.dtype == torch.float32 or _INTERPRET,
        UPCAST=_INTERPRET and q.dtype == torch.bfloat16,
        HAS_QE=query_end is not None, MERGE=merge, STORE_LSE=lse is not None,
        num_warps=tiling.num_warps,
    )
    return out, lse
