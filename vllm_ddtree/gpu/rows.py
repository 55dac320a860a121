"""Per-step verify rows.

vLLM lays a decode step out as one block of query rows per request (``query_start``).
A request whose every row is a logits row (``num_logits == q_len > 1``) is a tree
verify: its row ``i`` is tree row ``i`` (0 = root).  Everything else (prefill chunks,
draft-less decodes) is causal.

:func:`fill_tree_rows` writes, for every request with ``q_len <= W`` (``W = 1 +
budget``), each row's ancestor bits over its own request's rows (``[T, NW]`` int32,
``NW = ceil(W / 32)``), every row's RoPE position (tree rows: ``root position +
depth``; the rest: vLLM's), and each request's prefix length and recompute range for
the tree attention.  Trees come from per-request-state buffers (``bits_by_state [S, W,
NW]``, ``depth_by_state [S, W]``) gathered with ``idx_mapping`` because vLLM reorders
requests between steps.

:func:`fill_tree_rows_torch` is the reference that the tests compare the Triton launcher
(:func:`fill_tree_rows_triton`) to; :func:`fill_tree_rows` picks one
(:func:`~vllm_ddtree.kernels.triton_utils.use_triton`).  No vLLM import.
"""

from __future__ import annotations

import torch

from vllm_ddtree.kernels.triton_utils import HAS_TRITON, next_pow2, tl, triton, use_triton


def causal_words(
    local: torch.Tensor,  # [N] int: each row's index within its request
    num_words: int,
) -> torch.Tensor:  # [N, num_words] int32
    """Bits ``{0..local}`` of every row (a causal row)."""
    word_start = torch.arange(num_words, device=local.device) * 32
    # bits set in each word
    num_set = (local.to(torch.int64).unsqueeze(1) + 1 - word_start).clamp(0, 32)
    words = torch.where(num_set >= 32, torch.full_like(num_set, -1), (1 << num_set) - 1)
    return words.to(torch.int32)


def fill_tree_rows_torch(
    query_start: torch.Tensor,  # [num_reqs_padded + 1] int32
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    idx_mapping: torch.Tensor,  # [num_reqs] int32 batch row -> request state
    positions: torch.Tensor,  # [num_tokens_padded] int64 linear positions
    seq_lens: torch.Tensor,  # [num_reqs_padded] int32 KV length after this step's rows
    bits_by_state: torch.Tensor,  # [S, W, NW] int32
    depth_by_state: torch.Tensor,  # [S, W] int64
    out_bits: torch.Tensor,  # [num_tokens, NW] int32
    out_positions: torch.Tensor,  # [num_tokens] int64
    out_prefix_lens: torch.Tensor,  # [num_reqs_padded] int32
    out_query_end: torch.Tensor,  # [num_reqs_padded] int32
    num_reqs: int,
    num_reqs_padded: int,
    num_tokens_padded: int,
) -> None:
    """Reference of :func:`fill_tree_rows` (host loop)."""
    max_rows, num_words = bits_by_state.shape[1], bits_by_state.shape[2]
    starts, cu = query_start.tolist(), cu_num_logits.tolist()
    out_positions[:num_tokens_padded] = positions[:num_tokens_padded]
    n = num_reqs_padded
    query_lens = query_start[1 : n + 1] - query_start[:n]
    out_prefix_lens[:n] = seq_lens[:n] - query_lens
    out_query_end[:n] = torch.where(query_lens <= max_rows, query_start[1 : n + 1],
                                    query_start[:n])
    for b in range(num_reqs):
        first, end = starts[b], starts[b + 1]
        query_len = end - first
        if query_len > max_rows or query_len == 0:
            continue
        state = int(idx_mapping[b])
        if cu[b + 1] - cu[b] == query_len and query_len > 1:
            out_bits[first:end] = bits_by_state[state, :query_len]
            out_positions[first:end] = positions[first] + depth_by_state[state, :query_len]
        else:
            out_bits[first:end] = causal_words(
                torch.arange(query_len, device=positions.device), num_words)


if HAS_TRITON:

    @triton.jit
    def _copy_span(SRC, DST, n, BLOCK: tl.constexpr):
        """``DST[0:n] = SRC[0:n]``, ``BLOCK`` elements at a time."""
        offs = tl.arange(0, BLOCK)
        for start in range(0, n, BLOCK):
            ok = start + offs < n
            tl.store(DST + start + offs, tl.load(SRC + start + offs, mask=ok), mask=ok)

    # the batch's sizes change every step: one compiled variant for all of them
    @triton.jit(do_not_specialize=["num_reqs", "num_reqs_padded", "num_tokens_padded"])
    def _fill_tree_rows_kernel(QS, CU, IDX, POS, SEQ, BITS_S, DEPTH_S, OUT_BITS, OUT_POS,
                               OUT_PREFIX, OUT_QEND, num_reqs, num_reqs_padded,
                               num_tokens_padded, s_bs, s_br, s_ds, s_ob,
                               MAX_ROWS: tl.constexpr, NUM_WORDS: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                               BLOCK_P: tl.constexpr):
        b = tl.program_id(0)
        if b == num_reqs_padded:  # token rows past the last request (graph padding)
            start = tl.load(QS + num_reqs_padded)
            _copy_span(POS + start, OUT_POS + start, num_tokens_padded - start, BLOCK_P)
            return
        first = tl.load(QS + b)
        end = tl.load(QS + b + 1)
        query_len = end - first
        fits = query_len <= MAX_ROWS
        tl.store(OUT_PREFIX + b, tl.load(SEQ + b) - query_len)
        tl.store(OUT_QEND + b, tl.where(fits, end, first))
        real = b < num_reqs  # not a padding request
        num_logits = tl.load(CU + b + 1, mask=real, other=0) - tl.load(CU + b, mask=real,
                                                                        other=0)
        rows = tl.arange(0, BLOCK_R)
        words = tl.arange(0, BLOCK_W)
        r_ok = rows < query_len
        ok = r_ok[:, None] & (words < NUM_WORDS)[None, :]
        if real & fits & (num_logits == query_len) & (query_len > 1):  # a tree
            state = tl.load(IDX + b).to(tl.int64)
            bits = tl.load(BITS_S + state * s_bs + rows[:, None] * s_br + words[None, :],
                           mask=ok, other=0)
            tl.store(OUT_BITS + (first + rows)[:, None] * s_ob + words[None, :], bits,
                     mask=ok)
            depth = tl.load(DEPTH_S + state * s_ds + rows, mask=r_ok, other=0)
            tl.store(OUT_POS + first + rows, tl.load(POS + first) + depth, mask=r_ok)
        else:
            _copy_span(POS + first, OUT_POS + first, query_len, BLOCK_P)
            if real & fits:
                nbits = tl.minimum(tl.maximum(rows[:, None] + 1 - words[None, :] * 32, 0),
                                   32)
                low = (tl.full(nbits.shape, 1, tl.int64) << nbits.to(tl.int64)) - 1
                bits = tl.where(nbits >= 32, -1, low.to(tl.int32))
                tl.store(OUT_BITS + (first + rows)[:, None] * s_ob + words[None, :], bits,
                         mask=ok)


def fill_tree_rows(
    query_start: torch.Tensor,  # [num_reqs_padded + 1] int32
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    idx_mapping: torch.Tensor,  # [num_reqs] int32 batch row -> request state
    positions: torch.Tensor,  # [num_tokens_padded] int64 linear positions
    seq_lens: torch.Tensor,  # [num_reqs_padded] int32 KV length after this step's rows
    bits_by_state: torch.Tensor,  # [S, W, NW] int32
    depth_by_state: torch.Tensor,  # [S, W] int64
    out_bits: torch.Tensor,  # [num_tokens, NW] int32
    out_positions: torch.Tensor,  # [num_tokens] int64
    out_prefix_lens: torch.Tensor,  # [num_reqs_padded] int32
    out_query_end: torch.Tensor,  # [num_reqs_padded] int32
    num_reqs: int,
    num_reqs_padded: int,
    num_tokens_padded: int,
) -> None:
    """See the module docstring; also every request's prefix length (``seq_lens -
    q_len``) and the end of the rows the tree kernel recomputes in a mixed step
    (``query_end``: the request's last row when ``q_len <= W``, else its first), for
    the ``num_reqs_padded`` requests vLLM's attention metadata covers, and the linear
    positions of every other row up to ``num_tokens_padded``.  One launch on the GPU; no
    host sync (the sizes are host ints)."""
    fill = fill_tree_rows_triton if use_triton(positions) else fill_tree_rows_torch
    fill(query_start, cu_num_logits, idx_mapping, positions, seq_lens, bits_by_state,
         depth_by_state, out_bits, out_positions, out_prefix_lens, out_query_end, num_reqs,
         num_reqs_padded, num_tokens_padded)


def fill_tree_rows_triton(
    query_start: torch.Tensor,  # [num_reqs_padded + 1] int32
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    idx_mapping: torch.Tensor,  # [num_reqs] int32 batch row -> request state
    positions: torch.Tensor,  # [num_tokens_padded] int64 linear positions
    seq_lens: torch.Tensor,  # [num_reqs_padded] int32 KV length after this step's rows
    bits_by_state: torch.Tensor,  # [S, W, NW] int32
    depth_by_state: torch.Tensor,  # [S, W] int64
    out_bits: torch.Tensor,  # [num_tokens, NW] int32
    out_positions: torch.Tensor,  # [num_tokens] int64
    out_prefix_lens: torch.Tensor,  # [num_reqs_padded] int32
    out_query_end: torch.Tensor,  # [num_reqs_padded] int32
    num_reqs: int,
    num_reqs_padded: int,
    num_tokens_padded: int,
) -> None:
    """The Triton launcher of :func:`fill_tree_rows`."""
    max_rows, num_words = bits_by_state.shape[1], bits_by_state.shape[2]
    assert bits_by_state.stride(2) == 1 and out_bits.stride(1) == 1
    _fill_tree_rows_kernel[(num_reqs_padded + 1,)](
        query_start, cu_num_logits, idx_mapping, positions, seq_lens, bits_by_state,
        depth_by_state, out_bits, out_positions, out_prefix_lens, out_query_end, num_reqs,
        num_reqs_padded, num_tokens_padded, bits_by_state.stride(0),
        bits_by_state.stride(1), depth_by_state.stride(0), out_bits.stride(0),
        MAX_ROWS=max_rows, NUM_WORDS=num_words, BLOCK_R=next_pow2(max_rows),
        BLOCK_W=next_pow2(num_words), BLOCK_P=256, num_warps=4)
