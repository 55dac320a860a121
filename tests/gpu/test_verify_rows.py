"""Per-step verify-row metadata (ancestor bits, tree RoPE positions) and KV compaction on
a fake paged cache: Triton kernels (TRITON_INTERPRET=1 on CPU) against torch references,
and the references against first principles."""

import os

import pytest
import torch

from vllm_ddtree.gpu.verify_rows import (
    KVCompactor,
    causal_words,
    commit_states,
    compact_kv_torch,
    fill_tree_rows,
    hidden_row_perm,
)
from vllm_ddtree.tree import build_tree, tree_layout

needs_interp = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="runs under TRITON_INTERPRET=1 (set by .ci/run) or on a GPU")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_causal_words():
    w = causal_words(torch.tensor([0, 30, 31, 32, 40]), 2)
    full = -1
    assert w.tolist() == [[1, 0], [2**31 - 1, 0], [full, 0], [full, 1], [full, 2**9 - 1]]


def _batch(seed=0, B=40, D=4, S=6):
    """Per-state trees for S request slots, then a batch mixing: a full tree, a tree
    truncated to 7 drafts, a prefill chunk of 5 rows, a draft-less decode, a long prefill
    chunk (> W rows: untouched), in a shuffled state order; two padding requests and
    three padding token rows after them (a FULL CUDA graph's batch)."""
    g = torch.Generator().manual_seed(seed)
    tree = build_tree(torch.randn(S, D, 50, generator=g), B)
    lay = tree_layout(tree, torch.zeros(S, dtype=torch.long))
    W = B + 1
    q_lens = [W, 8, 5, 1, W + 300]
    n_logits = [W, 8, 1, 1, 1]
    idx = torch.tensor([4, 0, 2, 5, 1], dtype=torch.int32)
    qs = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    T = int(qs[-1])
    qs = torch.cat([qs, torch.full((2,), T, dtype=torch.int32)])  # vLLM's padding
    cu = torch.tensor([0] + torch.tensor(n_logits).cumsum(0).tolist(), dtype=torch.int32)
    pos = torch.randint(0, 1000, (T + 3,), generator=g)  # padding rows: any value
    for b, c in enumerate([100, 7, 30, 55, 0]):
        pos[qs[b]:qs[b + 1]] = c + torch.arange(q_lens[b])
    seq_lens = torch.tensor([300, 40, 35, 56, W + 300, 0, 0], dtype=torch.int32)
    return dict(query_start=qs, cu_num_logits=cu, idx_mapping=idx, positions=pos,
                seq_lens=seq_lens, bits_by_state=lay.ancestor_bits.contiguous(),
                depth_by_state=lay.depths.contiguous()), lay, q_lens, T


def _fill(args, impl, device="cpu"):
    a = {k: v.to(device) for k, v in args.items()}
    NW, T = a["bits_by_state"].shape[2], a["positions"].shape[0]
    out = dict(out_bits=torch.full((T, NW), 123, dtype=torch.int32, device=device),
               out_positions=torch.full((T,), -7, dtype=torch.int64, device=device),
               out_prefix_lens=torch.full((8,), -7, dtype=torch.int32, device=device),
               out_query_end=torch.full((8,), -7, dtype=torch.int32, device=device))
    fill_tree_rows(**a, **out, num_reqs=5, num_reqs_padded=7, num_tokens_padded=T,
                   impl=impl)
    return {k: v.cpu() for k, v in out.items()}


def test_fill_reference_semantics():
    args, lay, q_lens, T = _batch()
    NW = lay.ancestor_bits.shape[2]
    out = _fill(args, "torch")
    bits, rope = out["out_bits"], out["out_positions"]
    qs = args["query_start"].tolist()
    # request 0: state 4's full tree; positions root + depth
    assert torch.equal(bits[0:qs[1]], lay.ancestor_bits[4])
    assert torch.equal(rope[0:qs[1]], 100 + lay.depths[4])
    # request 1: first 8 rows of state 0's tree (a valid prefix: parents come first)
    assert torch.equal(bits[qs[1]:qs[2]], lay.ancestor_bits[0, :8])
    assert torch.equal(rope[qs[1]:qs[2]], 7 + lay.depths[0, :8])
    # requests 2, 3: causal rows, linear positions
    assert torch.equal(bits[qs[2]:qs[3]], causal_words(torch.arange(5), NW))
    assert torch.equal(bits[qs[3]:qs[4]], causal_words(torch.arange(1), NW))
    # request 4 (longer than a tree): bits untouched; its rows and the padding rows keep
    # vLLM's positions
    assert torch.all(bits[qs[4]:] == 123)
    assert torch.equal(rope[qs[2]:], args["positions"][qs[2]:])
    # per request (padding requests included): prefix = seq_len - q_len; the rows a mixed
    # step recomputes end at the last row (q_len <= W) or at the first (none)
    assert out["out_prefix_lens"].tolist() == [300 - q_lens[0], 32, 30, 55, 0, 0, 0, -7]
    assert out["out_query_end"].tolist() == qs[1:5] + [qs[4], T, T, -7]


@needs_interp
@pytest.mark.parametrize("seed", [1, 2])
def test_fill_triton_matches_reference(seed):
    args, _, _, _ = _batch(seed)
    want, got = _fill(args, "torch"), _fill(args, "triton", DEV)
    for name in want:
        assert torch.equal(want[name], got[name]), name


@needs_interp
@pytest.mark.parametrize("budget", [15, 40, 600])  # 600: rows past one 1024-wide block
def test_commit_states_triton_matches_reference(budget):
    """The one-launch commit against the per-buffer index_put: the batch rows land in
    their states' rows (shuffled, not all states), every other state row untouched."""
    g = torch.Generator().manual_seed(budget)
    S, W, NW, n = 7, budget + 1, (budget + 32) // 32, 4
    shapes = [((S, W, NW), torch.int32), ((S, W), torch.int64), ((S, budget), torch.int64),
              ((S, budget), torch.int64)]
    srcs = [torch.randint(-2**30, 2**30, shape, generator=g).to(dt) for shape, dt in shapes]
    dsts = [torch.randint(-2**30, 2**30, shape, generator=g).to(dt) for shape, dt in shapes]
    # int64 as vLLM 0.32 passes it; a longer mapping than the batch (its tail unused)
    idx_long = torch.tensor([5, 0, 3, 6, 1], dtype=torch.int64)
    idx = idx_long[:n]
    outs = []
    for impl in ("torch", "triton"):
        pairs = [(a.to(DEV), b.to(DEV).clone()) for a, b in zip(srcs, dsts)]
        commit_states(idx_long.to(DEV), pairs, n, impl=impl)
        outs.append([d.cpu() for _, d in pairs])
    for want, got, src, dst in zip(outs[0], outs[1], srcs, dsts):
        assert torch.equal(want, got)
        assert torch.equal(got[idx.long()], src[:n])
        rest = torch.tensor([s not in idx.tolist() for s in range(S)])
        assert torch.equal(got[rest], dst[rest])


@needs_interp
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
    want = hidden_row_perm(li, src, num_rows, 512, impl="torch")
    got = hidden_row_perm(li.to(DEV), src.to(DEV), num_rows, 512, impl="triton").cpu()
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


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compaction_triton_matches_reference(dtype):
    ref = _paged(1, dtype=dtype)
    got = [c.clone().to(DEV) for c in ref]
    got = [g for g in got]
    slots, li, cu, path, nacc = _plan()
    compact_kv_torch(ref, slots, li, cu, path, nacc, 3)
    comp = KVCompactor(got, impl="triton")
    comp(slots.to(DEV), li.to(DEV), cu.to(DEV), path.to(DEV), nacc.to(DEV), 3)
    for r, g in zip(ref, got):
        assert torch.equal(r, g.cpu())
