"""``store_trees``: the one-launch Triton kernel (``store_trees_triton``,
TRITON_INTERPRET=1 on CPU) equals its torch reference (``store_trees_torch``) exactly,
writes each row's tree to its request state and nothing for a row of state -1, and
``TreeStates.store_batch`` (which passes it the tree build's own NaN/inf mask and chain)
writes what the logits themselves say."""


import pytest
import torch

from vllm_ddtree.gpu.tree_state import TreeStates
from vllm_ddtree.gpu.tree_store import store_trees, store_trees_torch, store_trees_triton
from vllm_ddtree.tree import build_tree

DEV = "cuda" if torch.cuda.is_available() else "cpu"
V = 48
SENTINEL = -7


def _logits(R: int, D: int, seed: int) -> torch.Tensor:  # [R, D, V]
    """Peaked rows (deep trees) and flat rows (wide trees)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([8.0, 0.5, 3.0, 8.0, 1.0, 20.0])[torch.arange(R) % 6]
    return torch.randn(R, D, V, generator=g) * scale.view(R, 1, 1)


def _budgets(R: int, B: int) -> torch.Tensor:  # [R] some requests below the width
    return torch.tensor([B, B // 2, 0, B, 1, max(B - 3, 0)])[torch.arange(R) % 6]


def _outputs(S: int, B: int, D: int, draft_dtype: torch.dtype) -> list[torch.Tensor]:
    """Outputs of ``S`` rows, every entry the sentinel."""
    W = B + 1
    NW = (W + 31) // 32

    def full(shape, dtype=torch.int64):
        return torch.full(shape, SENTINEL, dtype=dtype, device=DEV)

    return [full((S, B), draft_dtype), full((S, B)), full((S, B)), full((S, W)),
            full((S, W, NW), torch.int32), full((S, D))]


def _run(store, tree, bad, top1, outs, states=None):
    """``store`` into ``outs``; row ``r``'s state is ``states[r]`` (default ``r``)."""
    if states is None:
        states = torch.arange(tree.token_ids.shape[0])
    args = [t.to(DEV) for t in (tree.token_ids, tree.parents, tree.depths, bad, top1, states)]
    store(*args, *outs)


def _strided_states(states: list[int], stride: int) -> torch.Tensor:
    """``states`` as a strided view, as the speculator reads them from vLLM's sample
    rows (one entry every ``stride``)."""
    buf = torch.full((len(states) * stride,), 99, dtype=torch.int64)
    buf[::stride] = torch.tensor(states)
    return buf.to(DEV)[::stride]


@pytest.mark.triton
@pytest.mark.parametrize("draft_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("D", [1, 4, 16])
@pytest.mark.parametrize("B", [1, 15, 31, 63, 100])
def test_triton_matches_reference(B, D, draft_dtype):
    R, extra = 6, 3
    logits = _logits(R, D, seed=B * 100 + D)
    tree = build_tree(logits, _budgets(R, B), max_budget=B)
    bad = torch.tensor([False, True, False, False, False, True])
    top1 = tree.top1  # the build's own: a strided view of its candidates
    assert torch.equal(top1, logits.argmax(dim=-1))
    assert B == 1 or not top1.is_contiguous()  # one candidate per depth: contiguous
    inputs = [t.clone() for t in (tree.token_ids, tree.parents, tree.depths)]
    order = [4, 0, 7, -1, 2, 8]  # row 3: a padding row; states 1, 3, 5, 6 not written
    states = _strided_states(order, B)
    ref, got = (_outputs(R + extra, B, D, draft_dtype) for _ in range(2))
    _run(store_trees_torch, tree, bad, top1, ref, states)
    _run(store_trees_triton, tree, bad, top1, got, states)
    for r, g in zip(ref, got):
        assert torch.equal(r, g)
    assert torch.all(got[0][R:] == SENTINEL)  # draft tokens: rows >= R untouched
    for g in got[1:]:  # by state: the states no row names untouched
        assert torch.all(g[[1, 3, 5, 6]] == SENTINEL)
    # the inputs are not modified
    for before, t in zip(inputs, (tree.token_ids, tree.parents, tree.depths)):
        assert torch.equal(before, t)
    # the cases exercise what they claim: bad rows empty, short trees, deep trees
    draft, walk, _, depths, _, chain = (t.cpu() for t in ref)
    walk, chain, depths = (t[[s for s in order if s >= 0]] for t in (walk, chain, depths))
    live_bad = bad[[r for r, s in enumerate(order) if s >= 0]]
    assert torch.all(walk[live_bad] == -1) and torch.all(chain[live_bad] == -1)
    assert torch.all(draft[:R] >= 0)
    assert int((walk == -1).sum()) > int(live_bad.sum()) * B
    if D > 1 and B > 1:
        assert int(depths.max()) > 1


@pytest.mark.parametrize(("N", "B"), [(15, 63), (31, 63), (1, 15), (15, 15)])
def test_narrow_tree_fills_the_first_slots(N, B, triton_runs):
    """A tree of ``N`` nodes stored into outputs of ``B`` slots (a drafter pass building
    less than the engine's budget): its rows equal the first ``N + 1`` rows of the
    budget-``B`` tree (best-first: the first ``N`` nodes are the best ``N``-node tree),
    the other slots are never accepted and see only themselves."""
    R, D = 6, 8
    logits = _logits(R, D, seed=N * 7 + B)
    bad = torch.tensor([False, True, False, False, False, False])
    wide_tree, tree = build_tree(logits, B), build_tree(logits, N)
    assert tree.width == N
    wide = _outputs(R, B, D, torch.int64)
    _run(store_trees_torch, wide_tree, bad, wide_tree.top1, wide)
    stores = [store_trees_torch] + ([store_trees_triton] if triton_runs else [])
    for store in stores:
        got = _outputs(R, B, D, torch.int64)
        _run(store, tree, bad, tree.top1, got)
        draft, walk, parents, depths, bits, chain = (t.cpu() for t in got)
        assert torch.equal(walk[:, :N], wide[1].cpu()[:, :N]), store.__name__
        assert torch.equal(draft[:, :N], wide[0].cpu()[:, :N])
        assert torch.equal(parents[:, :N], wide[2].cpu()[:, :N])
        assert torch.equal(depths[:, :N + 1], wide[3].cpu()[:, :N + 1])
        assert torch.equal(bits[:, :N + 1], wide[4].cpu()[:, :N + 1])
        assert torch.equal(chain, wide[5].cpu())
        assert torch.all(walk[:, N:] == -1) and torch.all(draft[:, N:] == 0)
        assert torch.all(parents[:, N:] == 0) and torch.all(depths[:, N + 1:] == 0)
        own = torch.zeros_like(bits[0])
        for i in range(N + 1, B + 1):
            own[i, i // 32] = torch.tensor(1 << (i % 32), dtype=torch.int64).to(torch.int32)
        assert torch.equal(bits[:, N + 1:], own[N + 1:].expand(R, -1, -1))
    assert int((wide[1][:, N:] >= 0).sum()) > 0 or N == B  # the wide tree has more nodes


@pytest.mark.triton
def test_chain_sets_the_sign_bit():
    """A 40-node chain: row i sees rows 0..i (a full word 0 is -1: bit 31 is the sign)."""
    B, D = 40, 40
    tree = build_tree(torch.zeros(1, D, V), 0, max_budget=B)
    tree.token_ids[0] = torch.arange(B)
    tree.parents[0] = torch.arange(B)  # node j's parent is row j (node j - 1)
    tree.depths[0] = torch.arange(1, B + 1)
    bad = torch.tensor([False])
    top1 = torch.arange(D).unsqueeze(0)
    for store in (store_trees_torch, store_trees_triton):
        outs = _outputs(2, B, D, torch.int64)
        _run(store, tree, bad, top1, outs)
        bits = outs[4].cpu()
        assert bits[0, 0].tolist() == [1, 0]
        assert bits[0, 30].tolist() == [2**31 - 1, 0]
        assert bits[0, 31].tolist() == [-1, 0]
        assert bits[0, 32].tolist() == [-1, 1]
        assert bits[0, B].tolist() == [-1, 2**9 - 1]
        assert torch.equal(outs[3][0].cpu(), torch.arange(B + 1))


@pytest.mark.parametrize("D", [1, 4])
@pytest.mark.parametrize("B", [1, 15, 100])
def test_reference_matches_store_batch(B, D, triton_runs):
    """``TreeStates.store_batch`` passes ``store_trees`` the build's by-products
    (``tree.nonfinite``, ``tree.top1``): its buffers equal ``store_trees_torch`` given the
    mask and the argmax read from the logits themselves (``store_trees_triton`` too,
    where it runs)."""
    R, S = 5, 7
    logits = _logits(R, D, seed=7 * B + D)
    logits[1, D - 1, 3] = float("nan")
    logits[4, 0, 0] = float("inf")
    tree = build_tree(logits, _budgets(R, B), max_budget=B)
    bad = ~torch.isfinite(logits).flatten(1).all(dim=1)
    top1 = logits.argmax(dim=-1)
    tokens = [t.clone() for t in (tree.token_ids, tree.parents, tree.depths)]

    ts = TreeStates(max_num_reqs=S, budget=B, max_depth=D, device="cpu")
    by_state = (ts._walk_tokens, ts._parents, ts._depths, ts._ancestor_bits,
                ts._chain)  # what store_batch writes
    fresh = [t.clone() for t in by_state]
    states = torch.tensor([6, 2, 0, 5, 3])
    draft_tokens = torch.full((S, B), SENTINEL, dtype=torch.int32)
    assert ts.store_batch(tree, logits, draft_tokens, states).tolist() == bad.tolist()
    want = [draft_tokens, *by_state]
    assert int(bad.sum()) == 2

    stores = [store_trees_torch]
    if triton_runs:
        stores.append(store_trees_triton)
    for store in stores:
        outs = [torch.full((S, B), SENTINEL, dtype=torch.int32)] + [t.clone() for t in fresh]
        outs = [t.to(DEV) for t in outs]
        store(*(t.to(DEV) for t in (*tokens, bad, top1, states)), *outs)
        for w, o in zip(want, outs):
            assert torch.equal(w, o.cpu()), store.__name__


def test_rejects_mismatched_outputs():
    tree = build_tree(_logits(2, 3, seed=0), 7)
    args = (tree.token_ids, tree.parents, tree.depths, torch.zeros(2, dtype=torch.bool),
            torch.zeros(2, 3, dtype=torch.int64), torch.arange(2))
    outs = _outputs(2, 7, 3, torch.int64)
    outs[3] = outs[3][:, :-1]  # depths must have B + 1 columns
    with pytest.raises(ValueError, match="not"):
        store_trees(*args, *outs)
    with pytest.raises(ValueError, match="do not fit"):  # a tree wider than the outputs
        store_trees(*args, *_outputs(2, 5, 3, torch.int64))
    outs = _outputs(2, 7, 3, torch.int64)
    outs[5] = torch.zeros(3, 3, dtype=torch.int64, device=DEV)  # by state: one length
    with pytest.raises(ValueError, match="differ in length"):
        store_trees(*args, *outs)
    with pytest.raises(ValueError, match="states"):
        store_trees(*args[:5], torch.arange(3), *_outputs(2, 7, 3, torch.int64))
