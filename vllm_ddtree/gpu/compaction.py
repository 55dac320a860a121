"""KV compaction of the accepted path, and the hidden-state rows the drafter reads.

After a tree verify, request ``b`` accepted the verify rows ``path[b, 0..k]`` (root
first).  Slots stay linear (row ``i`` of a request wrote KV slot ``c + i``), so the
accepted node at depth ``i`` must move to slot ``c + i``:

* :class:`KVCompactor` copies, in every layer of one KV-cache group, the K/V row of
  accepted tree row ``path[i]`` into the slot of row ``i``, in increasing ``i`` so an
  in-place copy never reads a row it already overwrote;
* :func:`hidden_row_perm` gives the token row whose hidden state moves to each token
  row (the accepted path first), so vLLM's DFlash drafter reads a linear accepted chain.

Each has a torch reference (``*_torch``, the compaction's from the core's
:func:`~vllm_ddtree.tree.compaction_plan`) that the tests compare its Triton launcher
(``*_triton``) to; the plain call picks one
(:func:`~vllm_ddtree.kernels.triton_utils.use_triton`).  No vLLM import.
"""

from __future__ import annotations

import torch

from vllm_ddtree.kernels.triton_utils import HAS_TRITON, next_pow2, tl, triton, use_triton
from vllm_ddtree.tree import compaction_plan


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


def compact_kv_triton(
    first: torch.Tensor,  # [num_blocks, block_size, heads, width] the first layer's cache
    offsets: torch.Tensor,  # [num_layers] int64 each layer's element offset from ``first``
    slot_mapping: torch.Tensor,  # [num_tokens] int64 KV slot of every token row
    logits_indices: torch.Tensor,  # [num_logits] token row of every logits row
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    path: torch.Tensor,  # [num_reqs, max_depth + 1] int64 accepted verify rows
    num_accepted: torch.Tensor,  # [num_reqs] int64
    num_reqs: int,
) -> None:
    """The Triton launcher of :class:`KVCompactor`: one program per (request, layer)."""
    heads, width = first.shape[2], first.shape[3]
    assert first.stride(3) == 1 and path.stride(1) == 1
    row = heads * width
    _compact_kv_kernel[(num_reqs, offsets.shape[0])](
        first, offsets, slot_mapping, logits_indices, cu_num_logits, path,
        num_accepted, path.stride(0), first.stride(0), first.stride(1), first.stride(2),
        HEAD2=width, ROW=row, BLOCK_SIZE=first.shape[1],
        BLOCK_E=min(4096, next_pow2(row)), num_warps=4)


class KVCompactor:
    """Compaction over a fixed set of same-shaped layer caches (one KV-cache group).

    ``caches``: per layer the ``[num_blocks, block_size, heads, width]`` view of its
    cache; the Triton kernel addresses every layer from the first one's pointer, so the
    set is fixed at construction (vLLM allocates KV caches once).
    """

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches
        first = caches[0]
        for cache in caches:
            if (cache.shape != first.shape or cache.stride() != first.stride()
                    or cache.dtype != first.dtype):
                raise ValueError("KVCompactor: layer caches differ in shape/stride/dtype")
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
        if use_triton(slot_mapping):
            compact_kv_triton(self.caches[0], self.offsets, slot_mapping, logits_indices,
                              cu_num_logits, path, num_accepted, num_reqs)
        else:
            compact_kv_torch(self.caches, slot_mapping, logits_indices, cu_num_logits, path,
                             num_accepted, num_reqs)


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
) -> torch.Tensor:  # [num_rows] int64
    """The token row whose hidden state moves to each token row: logits row ``i``
    (token row ``logits_indices[i]``) takes the one of logits row ``src_logit_row[i]``
    (the accepted path first), every other row keeps its own.  On the GPU one launch (a
    binary search of each row in ``logits_indices``, which vLLM lays out in increasing
    order) instead of an arange, a gather and an index_put.  ``max_num_rows`` (the
    engine's token budget) sets the search's steps, so every step takes one compiled
    variant."""
    if use_triton(logits_indices):
        return hidden_row_perm_triton(logits_indices, src_logit_row, num_rows, max_num_rows)
    return hidden_row_perm_torch(logits_indices, src_logit_row, num_rows)


def hidden_row_perm_triton(
    logits_indices: torch.Tensor,  # [num_logits] increasing token row of every logits row
    src_logit_row: torch.Tensor,  # [num_logits] int64 logits row whose state moves here
    num_rows: int,
    max_num_rows: int,
) -> torch.Tensor:  # [num_rows] int64
    """The Triton launcher of :func:`hidden_row_perm`."""
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
