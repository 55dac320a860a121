"""Per-step verify-row metadata and KV compaction for a batch laid out by vLLM.

vLLM lays a decode step out as one block of query rows per request (``query_start``).
A request whose every row is a logits row (``num_logits == q_len > 1``) is a tree
verify: its row ``i`` is tree row ``i`` (0 = root).  Everything else (prefill chunks,
draft-less decodes) is causal.

* :func:`fill_tree_rows` writes, for every request with ``q_len <= W``, each row's
  ancestor bits over its own request's rows (``[T, NW]`` int32) and, for tree requests,
  the RoPE position ``root position + depth``.  Trees come from per-request-state
  buffers (``bits_by_state [S, W, NW]``, ``depth_by_state [S, W]``) gathered with
  ``idx_mapping`` because vLLM reorders requests between steps.
* :func:`compact_kv` copies, in every layer, the K/V row of accepted tree row
  ``path[i]`` into the slot of row ``i`` (slots stay linear), in increasing ``i`` so an
  in-place copy never reads a row it already overwrote.

Each has a torch reference (``*_torch``) that the tests compare the Triton kernels to.
No vLLM import.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def use_triton(impl: str, tensor: torch.Tensor) -> bool:
    """``impl``: "triton", "torch" (the reference) or "auto" (Triton on CUDA tensors)."""
    return impl == "triton" or (impl == "auto" and triton is not None and tensor.is_cuda)


def causal_words(local: torch.Tensor, num_words: int) -> torch.Tensor:
    """``[N, num_words]`` int32 bits ``{0..local}`` (a causal row)."""
    w = torch.arange(num_words, device=local.device) * 32
    n = (local.to(torch.int64).unsqueeze(1) + 1 - w).clamp(0, 32)  # bits set in the word
    words = torch.where(n >= 32, torch.full_like(n, -1), (1 << n) - 1)
    return words.to(torch.int32)


def fill_tree_rows_torch(query_start, cu_num_logits, idx_mapping, positions, bits_by_state,
                         depth_by_state, out_bits, out_positions, num_reqs):
    W, NW = bits_by_state.shape[1], bits_by_state.shape[2]
    qs, cu = query_start.tolist(), cu_num_logits.tolist()
    for b in range(num_reqs):
        a, e = qs[b], qs[b + 1]
        n = e - a
        if n > W or n == 0:
            continue
        s = int(idx_mapping[b])
        if cu[b + 1] - cu[b] == n and n > 1:
            out_bits[a:e] = bits_by_state[s, :n]
            out_positions[a:e] = positions[a] + depth_by_state[s, :n]
        else:
            out_bits[a:e] = causal_words(torch.arange(n, device=positions.device), NW)


if triton is not None:

    @triton.jit
    def _fill_tree_rows_kernel(QS, CU, IDX, POS, BITS_S, DEPTH_S, OUT_BITS, OUT_POS,
                               s_bs, s_br, s_ds, s_ob,
                               W: tl.constexpr, NW: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_W: tl.constexpr):
        b = tl.program_id(0)
        a = tl.load(QS + b)
        n = tl.load(QS + b + 1) - a
        if n > W or n == 0:
            return
        nlog = tl.load(CU + b + 1) - tl.load(CU + b)
        is_tree = (nlog == n) & (n > 1)
        s = tl.load(IDX + b).to(tl.int64)
        rows = tl.arange(0, BLOCK_R)
        words = tl.arange(0, BLOCK_W)
        r_ok = rows < n
        ok = r_ok[:, None] & (words < NW)[None, :]
        if is_tree:
            bits = tl.load(BITS_S + s * s_bs + rows[:, None] * s_br + words[None, :],
                           mask=ok, other=0)
            depth = tl.load(DEPTH_S + s * s_ds + rows, mask=r_ok, other=0)
            root = tl.load(POS + a)
            tl.store(OUT_POS + a + rows, root + depth, mask=r_ok)
        else:
            nbits = tl.minimum(tl.maximum(rows[:, None] + 1 - words[None, :] * 32, 0), 32)
            low = (tl.full(nbits.shape, 1, tl.int64) << nbits.to(tl.int64)) - 1
            bits = tl.where(nbits >= 32, -1, low.to(tl.int32))
        tl.store(OUT_BITS + (a + rows)[:, None] * s_ob + words[None, :], bits.to(tl.int32),
                 mask=ok)


def fill_tree_rows(query_start, cu_num_logits, idx_mapping, positions, bits_by_state,
                   depth_by_state, out_bits, out_positions, num_reqs, impl="auto"):
    """See the module docstring.  ``out_positions`` must already hold the linear
    positions (only tree rows are rewritten).  No host sync: ``num_reqs`` is a host int."""
    if num_reqs == 0:
        return
    if not use_triton(impl, positions):
        return fill_tree_rows_torch(query_start, cu_num_logits, idx_mapping, positions,
                                    bits_by_state, depth_by_state, out_bits, out_positions,
                                    num_reqs)
    W, NW = bits_by_state.shape[1], bits_by_state.shape[2]
    assert bits_by_state.stride(2) == 1 and out_bits.stride(1) == 1
    _fill_tree_rows_kernel[(num_reqs,)](
        query_start, cu_num_logits, idx_mapping, positions, bits_by_state, depth_by_state,
        out_bits, out_positions, bits_by_state.stride(0), bits_by_state.stride(1),
        depth_by_state.stride(0), out_bits.stride(0),
        W=W, NW=NW, BLOCK_R=triton.next_power_of_2(W), BLOCK_W=triton.next_power_of_2(NW),
        num_warps=4)


# --------------------------------------------------------------------------- KV compaction


def compact_kv_torch(caches, slot_mapping, logits_indices, cu_num_logits, path,
                     num_accepted, num_reqs):
    """``caches``: per layer a ``[num_blocks, block_size, ...]`` view (any strides)."""
    cu, nacc = cu_num_logits.tolist(), num_accepted.tolist()
    for b in range(num_reqs):
        for i in range(1, int(nacc[b])):
            src = int(slot_mapping[logits_indices[cu[b] + int(path[b, i])]])
            dst = int(slot_mapping[logits_indices[cu[b] + i]])
            if src == dst:
                continue
            for c in caches:
                bs = c.shape[1]
                c[dst // bs, dst % bs] = c[src // bs, src % bs]


if triton is not None:

    @triton.jit
    def _compact_kv_kernel(BASE, OFFS, SLOT, LI, CU, PATH, NACC, s_path, s_blk, s_off,
                           s_head, HEAD2: tl.constexpr, ROW: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, BLOCK_E: tl.constexpr):
        b = tl.program_id(0)
        layer = tl.program_id(1)
        base_ptr = BASE + tl.load(OFFS + layer)
        c0 = tl.load(CU + b)
        k = tl.load(NACC + b)
        for i in range(1, k):
            src_row = tl.load(LI + c0 + tl.load(PATH + b * s_path + i))
            dst_row = tl.load(LI + c0 + i)
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

    def __init__(self, caches: list[torch.Tensor], impl: str = "auto"):
        self.caches = caches
        c0 = caches[0]
        for c in caches:
            if c.shape != c0.shape or c.stride() != c0.stride() or c.dtype != c0.dtype:
                raise ValueError("KVCompactor: layer caches differ in shape/stride/dtype")
        self.use_triton = use_triton(impl, c0)
        if self.use_triton:
            esz = c0.element_size()
            deltas = [c.data_ptr() - c0.data_ptr() for c in caches]
            if any(d % esz for d in deltas):
                raise ValueError("KVCompactor: misaligned layer caches")
            self.offsets = torch.tensor([d // esz for d in deltas], dtype=torch.int64,
                                        device=c0.device)

    def __call__(self, slot_mapping, logits_indices, cu_num_logits, path, num_accepted,
                 num_reqs: int) -> None:
        if num_reqs == 0:
            return
        if not self.use_triton:
            return compact_kv_torch(self.caches, slot_mapping, logits_indices,
                                    cu_num_logits, path, num_accepted, num_reqs)
        c0 = self.caches[0]
        heads, width = c0.shape[2], c0.shape[3]
        assert c0.stride(3) == 1 and path.stride(1) == 1
        row = heads * width
        _compact_kv_kernel[(num_reqs, len(self.caches))](
            c0, self.offsets, slot_mapping, logits_indices, cu_num_logits, path,
            num_accepted, path.stride(0), c0.stride(0), c0.stride(1), c0.stride(2),
            HEAD2=width, ROW=row, BLOCK_SIZE=c0.shape[1],
            BLOCK_E=min(4096, triton.next_power_of_2(row)), num_warps=4)


# --------------------------------------------------------------------------- fused walk

if triton is not None:

    @triton.jit
    def _walk_kernel(TGT, CU, IDX, WTOK, PAR, SAMPLED, PATH, NACC, SRC,
                     s_wt, s_par, s_sam, s_path,
                     B: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr):
        b = tl.program_id(0)
        c0 = tl.load(CU + b).to(tl.int64)
        nlog = tl.load(CU + b + 1).to(tl.int64) - c0
        s = tl.load(IDX + b).to(tl.int64)
        j = tl.arange(0, BLOCK_B)
        live = j < tl.minimum(nlog - 1, B)  # scheduled nodes only
        tok = tl.load(WTOK + s * s_wt + j, mask=live, other=-1)
        par = tl.load(PAR + s * s_par + j, mask=live, other=-1)
        cols = tl.arange(0, BLOCK_W)
        path = tl.where(cols == 0, 0, -1).to(tl.int64)
        cur = tl.zeros((), tl.int64)
        k = tl.zeros((), tl.int64)
        for _ in range(D):
            t = tl.load(TGT + c0 + cur)
            hit = live & (par == cur) & (tok == t) & (tok >= 0)
            nxt = tl.min(tl.where(hit, j, BLOCK_B), axis=0)
            found = nxt < BLOCK_B
            cur = tl.where(found, nxt.to(tl.int64) + 1, cur)
            k = tl.where(found, k + 1, k)
            path = tl.where(found & (cols == k), cur, path)
        n_acc = k + 1
        tl.store(NACC + b, n_acc)
        tl.store(PATH + b * s_path + cols, path, mask=cols < D + 1)
        on = cols < n_acc
        row = tl.where(on, path, 0)
        sam = tl.load(TGT + c0 + row, mask=on, other=-1)
        tl.store(SAMPLED + b * s_sam + cols, tl.where(on, sam, -1), mask=cols < W)
        src = tl.where(on, c0 + row, c0 + cols)
        tl.store(SRC + c0 + cols, src, mask=cols < nlog)


def walk_verify(targets, cu_num_logits, idx_mapping, walk_tokens, parents, depth: int,
                num_reqs: int):
    """Fused walk for :meth:`vllm_ddtree.gpu.buffers.TreeBuffers.walk` (same outputs):
    ``sampled [n, 1 + B]``, ``path [n, D + 1]``, ``num_accepted [n]``, ``src [L]``."""
    B = walk_tokens.shape[1]
    W = B + 1
    L = targets.shape[0]
    dev = targets.device
    sampled = torch.empty((num_reqs, W), dtype=torch.int64, device=dev)
    path = torch.empty((num_reqs, depth + 1), dtype=torch.int64, device=dev)
    nacc = torch.empty((num_reqs,), dtype=torch.int64, device=dev)
    src = torch.empty((L,), dtype=torch.int64, device=dev)
    if num_reqs:
        _walk_kernel[(num_reqs,)](
            targets, cu_num_logits, idx_mapping, walk_tokens, parents, sampled, path, nacc,
            src, walk_tokens.stride(0), parents.stride(0), sampled.stride(0), path.stride(0),
            B=B, D=depth, W=W, BLOCK_B=triton.next_power_of_2(B),
            BLOCK_W=triton.next_power_of_2(W), num_warps=4)
    return sampled, path, nacc, src
