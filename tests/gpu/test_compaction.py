"""Compaction of the accepted path on a fake paged cache and hidden-state rows
(:mod:`vllm_ddtree.gpu.compaction`): the Triton launcher (``compact_triton``,
TRITON_INTERPRET=1 on CPU) against the torch reference (``compact_torch``), and the
reference against first principles."""


import pytest
import torch

from vllm_ddtree.gpu.compaction import MAX_HIDDEN, KVCompactor, compact_torch, compact_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _paged(seed, L=3, nblocks=12, bs=16, H=2, width=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # vLLM's FlashAttention cache: logical [blocks, H, bs, 2*hd] stored as [blocks, bs, H, 2*hd]
    raws = [torch.randn(nblocks, bs, H, width, generator=g).to(dtype) for _ in range(L)]
    return [r.permute(0, 2, 1, 3).transpose(1, 2) for r in raws]  # views [blocks, bs, H, w]


def _plan():
    # two tree requests (8 and 6 rows) and a 1-row request; slots scattered over blocks
    slots = torch.tensor([17, 18, 19, 20, 21, 22, 23, 24, 100, 101, 102, 103, 104, 105, 60])
    li = torch.arange(15)
    cu = torch.tensor([0, 8, 14, 15], dtype=torch.int32)
    path = torch.tensor([[0, 2, 3, 7, -1], [0, 1, 4, -1, -1], [0, -1, -1, -1, -1]])
    nacc = torch.tensor([4, 3, 1])
    return slots, li, cu, path, nacc


def test_compaction_reference_semantics():
    caches = _paged(0)
    before = [c.clone() for c in caches]
    slots, li, cu, path, nacc = _plan()
    hidden = torch.arange(20.0).unsqueeze(1).repeat(1, 3)  # row r holds r
    slots = torch.cat([torch.tensor([200, 201]), slots])
    compact_torch(caches, slots, li + 2, cu, path, nacc, 3, [hidden])
    # token rows = logits rows + 2 (two rows before the batch's logits rows keep theirs):
    # request 0 moves rows 2+[0, 2, 3, 7] to 2+[0..3], request 1 rows 10+[0, 1, 4]
    want = list(range(20))
    want[2:6] = [2, 4, 5, 9]
    want[10:13] = [10, 11, 14]
    assert hidden[:, 0].tolist() == want
    assert torch.equal(hidden[:, 0], hidden[:, 2])

    def row(c, s):
        return c[s // 16, s % 16]

    for c, b in zip(caches, before):
        for i, src in enumerate([17, 19, 20, 24]):  # request 0: rows 0,2,3,7 -> 0..3
            assert torch.equal(row(c, 17 + i), row(b, src))
        for i, src in enumerate([100, 101, 104]):
            assert torch.equal(row(c, 100 + i), row(b, src))
        for s in [21, 22, 23, 24, 103, 104, 105, 60]:  # past the path: untouched
            assert torch.equal(row(c, s), row(b, s))


@pytest.mark.triton
@pytest.mark.parametrize("num_hidden", [0, 1, 3, MAX_HIDDEN + 2])  # the last: 2 launches
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compaction_triton_matches_reference(dtype, num_hidden):
    """Every KV layer and every hidden tensor (rows of 40 elements, some rows before
    the logits rows, int32 accepted counts as the walk's are read too) equal the
    reference's; the hidden rows a step does not move keep their values."""
    ref = _paged(1, dtype=dtype)
    got = [c.clone().to(DEV) for c in ref]
    slots, li, cu, path, nacc = _plan()
    li = li + 3  # three rows (a prefill chunk) before the trees
    slots = torch.cat([torch.tensor([150, 151, 152]), slots])
    g = torch.Generator().manual_seed(num_hidden)
    hid_ref = [torch.randn(20, 40, generator=g).to(dtype) for _ in range(num_hidden)]
    hid_got = [h.clone().to(DEV) for h in hid_ref]
    before = [h.clone() for h in hid_ref]
    compact_torch(ref, slots, li, cu, path, nacc, 3, hid_ref)
    comp = KVCompactor(got)
    compact_triton(got[0], comp.offsets, slots.to(DEV), li.to(DEV), cu.to(DEV),
                   path.to(DEV), nacc.to(torch.int32).to(DEV), 3, hid_got)
    for r, g in zip(ref, got):
        assert torch.equal(r, g.cpu())
    for r, h, b in zip(hid_ref, hid_got, before):
        assert torch.equal(r, h.cpu())
        assert not torch.equal(r, b)  # rows moved
        assert torch.equal(r[[0, 1, 2, 8, 9, 10, 16, 17]], b[[0, 1, 2, 8, 9, 10, 16, 17]])
