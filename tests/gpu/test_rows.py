"""Per-step verify-row metadata (ancestor bits, tree RoPE positions, prefix lengths;
:mod:`vllm_ddtree.gpu.rows`): the Triton launcher (``*_triton``, TRITON_INTERPRET=1 on
CPU) against the torch reference (``*_torch``), and the reference against first
principles."""


import pytest
import torch

from vllm_ddtree.gpu.rows import (
    causal_words,
    fill_tree_rows_torch,
    fill_tree_rows_triton,
)
from vllm_ddtree.tree import build_tree, tree_layout

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


def _fill(args, fill, device="cpu"):
    a = {k: v.to(device) for k, v in args.items()}
    NW, T = a["bits_by_state"].shape[2], a["positions"].shape[0]
    out = dict(out_bits=torch.full((T, NW), 123, dtype=torch.int32, device=device),
               out_positions=torch.full((T,), -7, dtype=torch.int64, device=device),
               out_prefix_lens=torch.full((8,), -7, dtype=torch.int32, device=device),
               out_query_end=torch.full((8,), -7, dtype=torch.int32, device=device))
    fill(**a, **out, num_reqs=5, num_reqs_padded=7, num_tokens_padded=T)
    return {k: v.cpu() for k, v in out.items()}


def test_fill_reference_semantics():
    args, lay, q_lens, T = _batch()
    NW = lay.ancestor_bits.shape[2]
    out = _fill(args, fill_tree_rows_torch)
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


@pytest.mark.triton
@pytest.mark.parametrize("seed", [1, 2])
def test_fill_triton_matches_reference(seed):
    args, _, _, _ = _batch(seed)
    want, got = _fill(args, fill_tree_rows_torch), _fill(args, fill_tree_rows_triton, DEV)
    for name in want:
        assert torch.equal(want[name], got[name]), name
