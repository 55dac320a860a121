"""Compaction of the accepted path: the target's KV, and the hidden-state rows the
drafter reads.

After a tree verify, request ``b`` accepted the verify rows ``path[b, 0..k]`` (root
first).  Slots stay linear (row ``i`` of a request wrote KV slot ``c + i``), so the
accepted node at depth ``i`` must move to the place of row ``i``, in every place that
holds one entry per token row:

* the K/V row of each target layer (one KV-cache group: :class:`KVCompactor`);
* the target's hidden-state rows the drafter reads (the aux hidden states, or the last
  hidden states), so vLLM's DFlash drafter reads a linear accepted chain.

The moves go in increasing ``i``: a node's row is never before its depth, so an in-place
copy never reads a row it already overwrote.  One launch does every layer of a group and
up to :data:`MAX_HIDDEN` hidden-state tensors.  The torch reference
(:func:`compact_torch`, the moves of the core's :func:`~vllm_ddtree.tree.compaction_plan`)
is what the tests compare the Triton launcher (:func:`compact_triton`) to;
:class:`KVCompactor` picks one (:func:`~vllm_ddtree.kernels.triton_utils.use_triton`).  No
vLLM import.
"""

from __future__ import annotations

import torch

from vllm_ddtree.kernels.triton_utils import HAS_TRITON, next_pow2, tl, triton, use_triton
from vllm_ddtree.tree import compaction_plan

#: hidden-state tensors one launch compacts (more take further launches)
MAX_HIDDEN = 8


def compact_torch(
    caches: list[torch.Tensor],  # per layer [num_blocks, block_size, ...] (any strides)
    slot_mapping: torch.Tensor,  # [num_tokens] int64 KV slot of every token row
    logits_indices: torch.Tensor,  # [num_logits] token row of every logits row
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    path: torch.Tensor,  # [num_reqs, max_depth + 1] int64 accepted verify rows
    num_accepted: torch.Tensor,  # [num_reqs] int64 or int32
    num_reqs: int,
    hidden: list[torch.Tensor] = (),  # each [num_tokens, width]
) -> None:
    """Reference of :class:`KVCompactor`: the moves of the core's
    :func:`~vllm_ddtree.tree.compaction_plan`, mapped to token rows and KV slots through
    vLLM's rows.  Every source is read before any destination is written, which equals
    the kernel's in-order copy (a destination row never follows its source row)."""
    plan = compaction_plan(path[:num_reqs].long(), num_accepted[:num_reqs].long())
    row_start = cu_num_logits[:num_reqs].long().unsqueeze(1)  # [num_reqs, 1]
    src_rows = logits_indices[(row_start + plan.src_rows)[plan.moves]].long()
    dst_rows = logits_indices[(row_start + plan.dst_rows)[plan.moves]].long()
    for h in hidden:
        h[dst_rows] = h[src_rows]  # the gather copies before the write
    src_slots = slot_mapping[src_rows].long()
    dst_slots = slot_mapping[dst_rows].long()
    moved = src_slots != dst_slots
    src_slots, dst_slots = src_slots[moved], dst_slots[moved]
    for cache in caches:
        block_size = cache.shape[1]
        entries = cache[src_slots // block_size, src_slots % block_size]  # a copy
        cache[dst_slots // block_size, dst_slots % block_size] = entries


if HAS_TRITON:

    @triton.jit
    def _move_rows(base, LI, PATH, row_start, num_accepted, s_row,
                   WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        """Row ``LI[row_start + path[i]]`` of ``base`` to row ``LI[row_start + i]``, for
        ``i = 1 .. num_accepted - 1`` in order (``PATH``: this request's path)."""
        for i in range(1, num_accepted):
            src = tl.load(LI + row_start + tl.load(PATH + i)).to(tl.int64)
            dst = tl.load(LI + row_start + i).to(tl.int64)
            if src != dst:
                for e0 in range(0, WIDTH, BLOCK):
                    e = e0 + tl.arange(0, BLOCK)
                    m = e < WIDTH
                    x = tl.load(base + src * s_row + e, mask=m)
                    tl.store(base + dst * s_row + e, x, mask=m)
            # make this row's writes visible before a later pair reads it
            tl.debug_barrier()

    @triton.jit
    def _compact_kernel(BASE, OFFS, SLOT, LI, CU, PATH, NACC,
                        H0, H1, H2, H3, H4, H5, H6, H7,
                        num_layers, s_path, s_blk, s_off, s_head, s_hid,
                        HEAD2: tl.constexpr, ROW: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        BLOCK_E: tl.constexpr, HID_WIDTH: tl.constexpr,
                        BLOCK_H: tl.constexpr):
        # program (b, l): request b's moves in KV layer l, or in hidden tensor
        # l - num_layers
        b = tl.program_id(0)
        layer = tl.program_id(1)
        row_start = tl.load(CU + b)
        num_accepted = tl.load(NACC + b)
        path = PATH + b * s_path
        if layer < num_layers:
            base_ptr = BASE + tl.load(OFFS + layer)
            for i in range(1, num_accepted):
                src_row = tl.load(LI + row_start + tl.load(path + i))
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
        else:
            # one branch per pointer argument (a kernel picks among its arguments only by
            # branching); unused pointer slots repeat H0 and get no program
            h = layer - num_layers
            if h == 0:
                _move_rows(H0, LI, path, row_start, num_accepted, s_hid, HID_WIDTH, BLOCK_H)
            elif h == 1:
                _move_rows(H1, LI, path, row_start, num_accepted, s_hid, HID_WIDTH, BLOCK_H)
            elif h == 2:
                _move_rows(H2, LI, path, row_start, num_accepted, s_hid, HID_WIDTH, BLOCK_H)
            elif h == 3:
                _move_rows(H3, LI, path, row_start, num_accepted, s_hid, HID_WIDTH, BLOCK_H)
            elif h == 4:
                _move_rows(H4, LI, path, row_start, num_accepted, s_hid, HID_WIDTH, BLOCK_H)
            elif h == 5:
                _move_rows(H5, LI, path, row_start, num_accepted, s_hid, HID_WIDTH, BLOCK_H)
            elif h == 6:
                _move_rows(H6, LI, path, row_start, num_accepted, s_hid, HID_WIDTH, BLOCK_H)
            else:
                _move_rows(H7, LI, path, row_start, num_accepted, s_hid, HID_WIDTH, BLOCK_H)


def compact_triton(
    first: torch.Tensor,  # [num_blocks, block_size, heads, width] the first layer's cache
    offsets: torch.Tensor,  # [num_layers] int64 each layer's element offset from ``first``
    slot_mapping: torch.Tensor,  # [num_tokens] int64 KV slot of every token row
    logits_indices: torch.Tensor,  # [num_logits] token row of every logits row
    cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
    path: torch.Tensor,  # [num_reqs, max_depth + 1] int64 accepted verify rows
    num_accepted: torch.Tensor,  # [num_reqs] int64 or int32
    num_reqs: int,
    hidden: list[torch.Tensor] = (),  # each [num_tokens, width], one shape and stride
) -> None:
    """The Triton launcher of :class:`KVCompactor`: one program per (request, layer) and
    per (request, hidden tensor); a launch per :data:`MAX_HIDDEN` hidden tensors."""
    heads, width = first.shape[2], first.shape[3]
    assert first.stride(3) == 1 and path.stride(1) == 1
    row = heads * width
    hidden = list(hidden)
    for h in hidden:
        assert h.dim() == 2 and h.stride(1) == 1 and h.shape == hidden[0].shape \
            and h.stride(0) == hidden[0].stride(0), "hidden: one [rows, width] layout"
    hid_width = hidden[0].shape[1] if hidden else 1
    num_layers = offsets.shape[0]
    for start in range(0, max(len(hidden), 1), MAX_HIDDEN):
        chunk = hidden[start: start + MAX_HIDDEN]
        ptrs = chunk + [chunk[0] if chunk else first] * (MAX_HIDDEN - len(chunk))
        _compact_kernel[(num_reqs, num_layers + len(chunk))](
            first, offsets, slot_mapping, logits_indices, cu_num_logits, path,
            num_accepted, *ptrs, num_layers, path.stride(0), first.stride(0),
            first.stride(1), first.stride(2), chunk[0].stride(0) if chunk else 0,
            HEAD2=width, ROW=row, BLOCK_SIZE=first.shape[1],
            BLOCK_E=min(4096, next_pow2(row)), HID_WIDTH=hid_width,
            BLOCK_H=min(4096, next_pow2(hid_width)), num_warps=4)
        num_layers = 0  # the next launches do hidden tensors only


class KVCompactor:
    """Compaction over a fixed set of same-shaped layer caches (one KV-cache group),
    and optionally the hidden-state tensors that move with it.

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
        num_accepted: torch.Tensor,  # [num_reqs] int64 or int32
        num_reqs: int,
        hidden: list[torch.Tensor] = (),  # each [num_tokens, width]: rows move too
    ) -> None:
        if num_reqs == 0:
            return
        if use_triton(slot_mapping):
            compact_triton(self.caches[0], self.offsets, slot_mapping, logits_indices,
                           cu_num_logits, path, num_accepted, num_reqs, hidden)
        else:
            compact_torch(self.caches, slot_mapping, logits_indices, cu_num_logits, path,
                          num_accepted, num_reqs, hidden)
