"""KV compaction of the accepted path on a fake paged cache, and the hidden-state row
permutation the drafter reads (:mod:`vllm_ddtree.gpu.compaction`): the Triton launchers
(``*_triton``, TRITON_INTERPRET=1 on CPU) against the torch references (``*_torch``), and
the references against first principles."""


import pytest
import torch

from vllm_ddtree.gpu.compaction import (
    KVCompactor,
    compact_kv_torch,
    compact_kv_triton,
    hidden_row_perm_torch,
    hidden_row_perm_triton,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.triton
@pytest.mark.parametrize("num_rows", [1, 17, 300])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_hidden_row_perm_triton_matches_reference(num_rows, dtype):
    """The one-launch permutation (a binary search in the increasing logits indices)
    against the arange/gather/index_put reference: logits rows scattered among other
    rows (prefill rows, padding), each taking a random logits row's token row."""
    g = torch.Generator().manual_seed(num_rows)
    num_logits = max(1, num_rows // 3)
    li = torch.randperm(num_rows, generator=g)[:num_logits].sort().values.to(dtype)
    src = torch.randint(0, num_logits, (num_logits,), generator=g)
    want = hidden_row_perm_torch(li, src, num_rows)
    got = hidden_row_perm_triton(li.to(DEV), src.to(DEV), num_rows, 512).cpu()
    assert torch.equal(want, got)
    other = torch.ones(num_rows, dtype=torch.bool)
    other[li.long()] = False
    assert torch.equal(got[other], torch.arange(num_rows)[other])  # untouched rows


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
    compact_kv_torch(caches, slots, li, cu, path, nacc, 3)

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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compaction_triton_matches_reference(dtype):
    ref = _paged(1, dtype=dtype)
    got = [c.clone().to(DEV) for c in ref]
    slots, li, cu, path, nacc = _plan()
    compact_kv_torch(ref, slots, li, cu, path, nacc, 3)
    comp = KVCompactor(got)
    compact_kv_triton(got[0], comp.offsets, slots.to(DEV), li.to(DEV), cu.to(DEV),
                      path.to(DEV), nacc.to(DEV), 3)
    for r, g in zip(ref, got):
        assert torch.equal(r, g.cpu())
