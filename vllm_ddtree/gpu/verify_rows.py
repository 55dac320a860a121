"""Per-step verify-row metadata and KV compaction for a batch laid out by vLLM.

vLLM lays a decode step out as one block of query rows per request (``query_start``).
A request whose every row is a logits row (``num_logits == q_len > 1``) is a tree
verify: its row ``i`` is tree row ``i`` (0 = root).  Everything else (prefill chunks,
draft-less decodes) is causal.

* :func:`fill_tree_rows` writes, for every request with ``q_len <= W`` (``W = 1 +
  budget``), each row's ancestor bits over its own request's rows (``[T, NW]`` int32,
  ``NW = ceil(W / 32)``), every row's RoPE position (tree rows: ``root position +
  depth``; the rest: vLLM's), and each request's prefix length and recompute range for
  the tree attention.  Trees come from per-request-state
  buffers (``bits_by_state [S, W, NW]``, ``depth_by_state [S, W]``) gathered with
  ``idx_mapping`` because vLLM reorders requests between steps.
* :class:`KVCompactor` copies, in every layer, the K/V row of accepted tree row
  ``path[i]`` into the slot of row ``i`` (slots stay linear), in increasing ``i`` so an
  in-place copy never reads a row it already overwrote;
* :func:`walk_verify` is the fused twin of the core walk
  (:func:`vllm_ddtree.tree.walk_tree`) on this layout.

Each has a torch reference that the tests compare the Triton kernels to (the compaction's
and the walk's use the core's :func:`~vllm_ddtree.tree.compaction_plan` and
:func:`~vllm_ddtree.tree.walk_tree`).  No vLLM import.
"""

from __future__ import annotations

import torch

from vllm_ddtree.kernels.triton_utils import HAS_TRITON, next_pow2, tl, triton
from vllm_ddtree.tree import compaction_plan


def use_triton(impl: str, tensor: torch.Tensor) -> bool:
    """``impl``: "triton", "torch" (the reference) or "auto" (Triton on CUDA tensors)."""
    return impl == "triton" or (impl == "auto" and HAS_TRITON and tensor.is_cuda)


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
    impl: str = "auto",
) -> None:
    """See the module docstring; also every request's prefix length (``seq_lens -
    q_len``) and the end of the rows the tree kernel recomputes in a mixed step
    (``query_end``: the request's last row when ``q_len <= W``, else its first), for
    the ``num_reqs_padded`` requests vLLM's attention metadata covers, and the linear
    positions of every other row up to ``num_tokens_padded``.  One launch; no host
    sync (the sizes are host ints)."""
    if not use_triton(impl, positions):
        return fill_tree_rows_torch(query_start, cu_num_logits, idx_mapping, positions,
                                    seq_lens, bits_by_state, depth_by_state, out_bits,
                                    out_positions, out_prefix_lens, out_query_end, num_reqs,
                                    num_reqs_padded, num_tokens_padded)
    max_rows, num_words = bits_by_state.shape[1], bits_by_state.shape[2]
    assert bits_by_state.stride(2) == 1 and out_bits.stride(1) == 1
    _fill_tree_rows_kernel[(num_reqs_padded + 1,)](
        query_start, cu_num_logits, idx_mapping, positions, seq_lens, bits_by_state,
        depth_by_state, out_bits, out_positions, out_prefix_lens, out_query_end, num_reqs,
        num_reqs_padded, num_tokens_padded, bits_by_state.stride(0),
        bits_by_state.stride(1), depth_by_state.stride(0), out_bits.stride(0),
        MAX_ROWS=max_rows, NUM_WORDS=num_words, BLOCK_R=next_pow2(max_rows),
        BLOCK_W=next_pow2(num_words), BLOCK_P=256, num_warps=4)


# --------------------------------------------------------------------------- commit


def commit_states_torch(
    idx_mapping: torch.Tensor,  # [num_reqs] int32 batch row -> request state
    pairs: list[tuple[torch.Tensor, torch.Tensor]],  # (batch [S, ...], by state [S, ...])
    num_reqs: int,
) -> None:
    """Reference of :func:`commit_states`."""
    states = idx_mapping[:num_reqs].long()
    for src, dst in pairs:
        dst[states] = src[:num_reqs]


if HAS_TRITON:

    @triton.jit
    def _commit_states_kernel(IDX, S0, D0, S1, D1, S2, D2, S3, D3,
                              LEN0: tl.constexpr, LEN1: tl.constexpr, LEN2: tl.constexpr,
                              LEN3: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        s = tl.load(IDX + r).to(tl.int64)
        _copy_span(S0 + r * LEN0, D0 + s * LEN0, LEN0, BLOCK)
        _copy_span(S1 + r * LEN1, D1 + s * LEN1, LEN1, BLOCK)
        _copy_span(S2 + r * LEN2, D2 + s * LEN2, LEN2, BLOCK)
        _copy_span(S3 + r * LEN3, D3 + s * LEN3, LEN3, BLOCK)


def commit_states(
    idx_mapping: torch.Tensor,  # [num_reqs] int32 batch row -> request state
    pairs: list[tuple[torch.Tensor, torch.Tensor]],  # 4 x (batch [S, ...], by state [S, ...])
    num_reqs: int,
    impl: str = "auto",
) -> None:
    """Copy rows ``0..num_reqs`` of each batch buffer to the rows of their request
    states: one launch for the four buffers (the torch path: an index_put per buffer).
    Every buffer is contiguous and each pair has one shape and dtype."""
    if num_reqs == 0:
        return
    if not use_triton(impl, idx_mapping) or len(pairs) != 4:
        return commit_states_torch(idx_mapping, pairs, num_reqs)
    args, lens = [], []
    for src, dst in pairs:
        assert src.is_contiguous() and dst.is_contiguous() and src.shape == dst.shape
        args += [src, dst]
        lens.append(src.stride(0))  # elements per row (contiguous)
    block = min(1024, next_pow2(max(lens)))
    _commit_states_kernel[(num_reqs,)](idx_mapping, *args, LEN0=lens[0], LEN1=lens[1],
                                       LEN2=lens[2], LEN3=lens[3], BLOCK=block, num_warps=4)


# --------------------------------------------------------------------------- KV compaction


def compact_kv_torch(
    caches: list[torch.Tensor],  # per layer [num_blocks, block_size, ...] (any strides)
    slot_mapping: torch.Tensor,  # [num_tokens] int64 KV slot of every token row
    logits_indices: torch.Tensor,  # [num_logits] token row of every logits row
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    path: torch.Tensor,  # [num_reqs, max_depth + 1] int64 accepted verify rows
    num_accepted: torch.Tensor,  # [num_reqs] int64
    num_reqs: int,
) -> None:
    """Reference of :class:`KVCompactor`: the moves of the core's
    :func:`~vllm_ddtree.tree.compaction_plan`, mapped to KV slots through vLLM's rows.
    Every source is read before any destination is written, which equals the kernel's
    in-order copy (a destination row never follows its source row)."""
    plan = compaction_plan(path[:num_reqs].long(), num_accepted[:num_reqs].long())
    row_start = cu_num_logits[:num_reqs].long().unsqueeze(1)  # [num_reqs, 1]
    src_rows = (row_start + plan.src_rows)[plan.moves]
    dst_rows = (row_start + plan.dst_rows)[plan.moves]
    src_slots = slot_mapping[logits_indices[src_rows].long()].long()
    dst_slots = slot_mapping[logits_indices[dst_rows].long()].long()
    moved = src_slots != dst_slots
    src_slots, dst_slots = src_slots[moved], dst_slots[moved]
    for cache in caches:
        block_size = cache.shape[1]
        entries = cache[src_slots // block_size, src_slots % block_size]  # a copy
        cache[dst_slots // block_size, dst_slots % block_size] = entries


if HAS_TRITON:

    @triton.jit
    def _compact_kv_kernel(BASE, OFFS, SLOT, LI, CU, PATH, NACC, s_path, s_blk, s_off,
                           s_head, HEAD2: tl.constexpr, ROW: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, BLOCK_E: tl.constexpr):
        b = tl.program_id(0)
        layer = tl.program_id(1)
        base_ptr = BASE + tl.load(OFFS + layer)
        row_start = tl.load(CU + b)
        num_accepted = tl.load(NACC + b)
        for i in range(1, num_accepted):
            src_row = tl.load(LI + row_start + tl.load(PATH + b * s_path + i))
            dst_row = tl.load(LI + row_start + i)
            src = tl.load(SLOT + src_row).to(tl.int64)
            dst = tl.load(SLOT + dst_row).to(tl.int64)
            if src != dst:
                src_base = (src // BLOCK_SIZE) * s_blk + (src % BLOCK_SIZE) * s_off
                dst_base = (dst // BLOCK_SIZE) * s_blk + (dst % BLOCK_SIZE) * s_off
                for e0 in range(0, ROW, BLOCK_E):
                    e = e0 + tl.arange(0, BLOCK_E)
                    m = e < ROW
                    off = (e // HEAD2) * s_head + e % HEAD2
                    x = tl.load(base_ptr + src_base + off, mask=m)
                    tl.store(base_ptr + dst_base + off, x, mask=m)
            # make this row's writes visible before a later pair reads it
            tl.debug_barrier()


class KVCompactor:
    """Compaction over a fixed set of same-shaped layer caches (one KV-cache group).

    ``caches``: per layer the ``[num_blocks, block_size, heads, width]`` view of its
    cache; the Triton kernel addresses every layer from the first one's pointer, so the
    set is fixed at construction (vLLM allocates KV caches once).
    """

    def __init__(self, caches: list[torch.Tensor], impl: str = "auto") -> None:
        self.caches = caches
        first = caches[0]
        for cache in caches:
            if (cache.shape != first.shape or cache.stride() != first.stride()
                    or cache.dtype != first.dtype):
                raise ValueError("KVCompactor: layer caches differ in shape/stride/dtype")
        self.use_triton = use_triton(impl, first)
        if self.use_triton:
            element_size = first.element_size()
            deltas = [cache.data_ptr() - first.data_ptr() for cache in caches]
            if any(delta % element_size for delta in deltas):
                raise ValueError("KVCompactor: misaligned layer caches")
            # [num_layers] int64 element offset of each layer's cache from the first's
            self.offsets = torch.tensor([delta // element_size for delta in deltas],
                                        dtype=torch.int64, device=first.device)

    def __call__(
        self,
        slot_mapping: torch.Tensor,  # [num_tokens] int64 KV slot of every token row
        logits_indices: torch.Tensor,  # [num_logits] token row of every logits row
        cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
        path: torch.Tensor,  # [num_reqs, max_depth + 1] int64 accepted verify rows
        num_accepted: torch.Tensor,  # [num_reqs] int64
        num_reqs: int,
    ) -> None:
        if num_reqs == 0:
            return
        if not self.use_triton:
            return compact_kv_torch(self.caches, slot_mapping, logits_indices,
                                    cu_num_logits, path, num_accepted, num_reqs)
        first = self.caches[0]
        heads, width = first.shape[2], first.shape[3]
        assert first.stride(3) == 1 and path.stride(1) == 1
        row = heads * width
        _compact_kv_kernel[(num_reqs, len(self.caches))](
            first, self.offsets, slot_mapping, logits_indices, cu_num_logits, path,
            num_accepted, path.stride(0), first.stride(0), first.stride(1), first.stride(2),
            HEAD2=width, ROW=row, BLOCK_SIZE=first.shape[1],
            BLOCK_E=min(4096, next_pow2(row)), num_warps=4)


# --------------------------------------------------------------------------- row permutation


def hidden_row_perm_torch(
    logits_indices: torch.Tensor,  # [num_logits] token row of every logits row
    src_logit_row: torch.Tensor,  # [num_logits] int64 logits row whose state moves here
    num_rows: int,
) -> torch.Tensor:  # [num_rows] int64
    """Reference of :func:`hidden_row_perm`."""
    perm = torch.arange(num_rows, device=logits_indices.device)
    rows = logits_indices.long()
    perm[rows] = rows[src_logit_row]
    return perm


if HAS_TRITON:

    # num_rows and num_logits change every step: one compiled variant for all of them
    @triton.jit(do_not_specialize=["num_rows", "num_logits"])
    def _hidden_row_perm_kernel(LI, SRC, PERM, num_rows, num_logits,
                                LOG2_LOGITS: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        # the logits row at token row t, if any: binary search in the increasing LI
        lo = tl.zeros((BLOCK,), tl.int64)
        hi = tl.zeros((BLOCK,), tl.int64) + num_logits
        for _ in range(LOG2_LOGITS + 1):
            mid = (lo + hi) // 2
            open_ = lo < hi
            v = tl.load(LI + mid, mask=open_ & (mid < num_logits), other=0).to(tl.int64)
            below = v < t
            lo = tl.where(open_ & below, mid + 1, lo)
            hi = tl.where(open_ & ~below, mid, hi)
        hit = lo < num_logits
        at = tl.load(LI + lo, mask=hit, other=-1).to(tl.int64)
        hit = hit & (at == t)
        src = tl.load(SRC + lo, mask=hit, other=0)
        moved = tl.load(LI + src, mask=hit, other=0).to(tl.int64)
        tl.store(PERM + t, tl.where(hit, moved, t), mask=t < num_rows)


def hidden_row_perm(
    logits_indices: torch.Tensor,  # [num_logits] increasing token row of every logits row
    src_logit_row: torch.Tensor,  # [num_logits] int64 logits row whose state moves here
    num_rows: int,
    max_num_rows: int,
    impl: str = "auto",
) -> torch.Tensor:  # [num_rows] int64
    """The token row whose hidden state moves to each token row: logits row ``i``
    (token row ``logits_indices[i]``) takes the one of logits row ``src_logit_row[i]``
    (the accepted path first), every other row keeps its own.  One launch on CUDA (a
    binary search of each row in ``logits_indices``, which vLLM lays out in increasing
    order) instead of an arange, a gather and an index_put.  ``max_num_rows`` (the
    engine's token budget) sets the search's steps, so every step takes one compiled
    variant."""
    if not use_triton(impl, logits_indices):
        return hidden_row_perm_torch(logits_indices, src_logit_row, num_rows)
    num_logits = logits_indices.shape[0]
    assert src_logit_row.shape[0] == num_logits  # the kernel reads SRC at logits rows
    perm = torch.empty(num_rows, dtype=torch.int64, device=logits_indices.device)
    if num_rows:
        block = 256
        _hidden_row_perm_kernel[(triton.cdiv(num_rows, block),)](
            logits_indices, src_logit_row, perm, num_rows, num_logits,
            LOG2_LOGITS=max(max_num_rows, num_logits, 2).bit_length(), BLOCK=block,
            num_warps=4)
    return perm


# --------------------------------------------------------------------------- fused walk

if HAS_TRITON:

    @triton.jit
    def _walk_kernel(TGT, CU, IDX, WTOK, PAR, SAMPLED, PATH, NACC, SRC,
                     s_wt, s_par, s_sam, s_path,
                     BUDGET: tl.constexpr, MAX_DEPTH: tl.constexpr, MAX_ROWS: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr):
        b = tl.program_id(0)
        row_start = tl.load(CU + b).to(tl.int64)
        num_logits = tl.load(CU + b + 1).to(tl.int64) - row_start
        state = tl.load(IDX + b).to(tl.int64)
        j = tl.arange(0, BLOCK_B)
        live = j < tl.minimum(num_logits - 1, BUDGET)  # scheduled nodes only
        tok = tl.load(WTOK + state * s_wt + j, mask=live, other=-1)
        par = tl.load(PAR + state * s_par + j, mask=live, other=-1)
        cols = tl.arange(0, BLOCK_W)
        path = tl.where(cols == 0, 0, -1).to(tl.int64)
        cur = tl.zeros((), tl.int64)
        k = tl.zeros((), tl.int64)
        for _ in range(MAX_DEPTH):
            t = tl.load(TGT + row_start + cur)
            hit = live & (par == cur) & (tok == t) & (tok >= 0)
            nxt = tl.min(tl.where(hit, j, BLOCK_B), axis=0)
            found = nxt < BLOCK_B
            cur = tl.where(found, nxt.to(tl.int64) + 1, cur)
            k = tl.where(found, k + 1, k)
            path = tl.where(found & (cols == k), cur, path)
        num_accepted = k + 1
        tl.store(NACC + b, num_accepted)
        tl.store(PATH + b * s_path + cols, path, mask=cols < MAX_DEPTH + 1)
        on = cols < num_accepted
        row = tl.where(on, path, 0)
        sam = tl.load(TGT + row_start + row, mask=on, other=-1)
        tl.store(SAMPLED + b * s_sam + cols, tl.where(on, sam, -1), mask=cols < MAX_ROWS)
        src = tl.where(on, row_start + row, row_start + cols)
        tl.store(SRC + row_start + cols, src, mask=cols < num_logits)


def walk_verify(
    targets: torch.Tensor,  # [num_logits] int64 the target's token at every logits row
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    idx_mapping: torch.Tensor,  # [num_reqs] int32 batch row -> request state
    walk_tokens: torch.Tensor,  # [S, budget] int64 node tokens by request state
    parents: torch.Tensor,  # [S, budget] int64 node parents (verify rows) by state
    max_depth: int,
    num_reqs: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused twin of the torch branch of
    :meth:`vllm_ddtree.gpu.buffers.TreeBuffers.walk` (the core walk), same outputs:
    ``sampled [num_reqs, 1 + budget]``, ``path [num_reqs, max_depth + 1]``,
    ``num_accepted [num_reqs]``, ``src_logit_row [num_logits]``."""
    budget = walk_tokens.shape[1]
    max_rows = budget + 1
    total_logits = targets.shape[0]
    device = targets.device
    sampled = torch.empty((num_reqs, max_rows), dtype=torch.int64, device=device)
    path = torch.empty((num_reqs, max_depth + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty((num_reqs,), dtype=torch.int64, device=device)
    src_logit_row = torch.empty((total_logits,), dtype=torch.int64, device=device)
    if num_reqs:
        _walk_kernel[(num_reqs,)](
            targets, cu_num_logits, idx_mapping, walk_tokens, parents, sampled, path,
            num_accepted, src_logit_row, walk_tokens.stride(0), parents.stride(0),
            sampled.stride(0), path.stride(0),
            BUDGET=budget, MAX_DEPTH=max_depth, MAX_ROWS=max_rows,
            BLOCK_B=next_pow2(budget), BLOCK_W=next_pow2(max_rows),
            num_warps=4)
    return sampled, path, num_accepted, src_logit_row
