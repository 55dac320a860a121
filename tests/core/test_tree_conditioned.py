"""Trees with parent-conditioned children (DSpark-style Markov head): the batched
level-by-level build against the heap oracle, token for token, ties included.

Inputs are multiples of 1/2 (logits) and 1/2 (Markov factors) with small rank, so every
bias is exact in float32 whatever the summation order: the oracle's per-node bias and
the batched one are the same numbers, and any difference is the build's."""

import pytest
import torch

from vllm_ddtree.tree.build import build_tree_torch
from vllm_ddtree.tree.conditioned import (
    MarkovHead,
    build_conditioned_tree,
    build_conditioned_tree_torch,
    build_conditioned_tree_triton,
    markov_bias,
)
from vllm_ddtree.tree.reference import build_conditioned_tree_heap

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton kernels run


def _builds_by_seed(seeds: int, triton_seeds: int) -> list:
    """(seed, build) pairs: the torch build for every seed, the Triton build (its kernels
    under Triton's interpreter on CPU, seconds a case) for the first ``triton_seeds``."""
    return ([(s, build_conditioned_tree_torch) for s in range(seeds)]
            + [pytest.param(s, build_conditioned_tree_triton, marks=pytest.mark.triton)
               for s in range(triton_seeds)])


def _case(seed: int, R: int, D: int, V: int, rank: int, spread: int, v_target: int):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-spread, spread + 1, (R, D, V), generator=g).float() / 2
    w1 = torch.randint(-2, 3, (v_target, rank), generator=g).float() / 2
    w2 = torch.randint(-2, 3, (V, rank), generator=g).float() / 2
    roots = torch.randint(0, v_target, (R,), generator=g)
    return base, w1, w2, roots


def _run(build, base, roots, w1, w2, budget: int, draft_to_target=None):
    """``build`` on the inputs, moved to the GPU for the Triton selection where there is
    one (the oracle keeps the CPU tensors)."""
    dev = DEV if build is build_conditioned_tree_triton else "cpu"
    d2t = None if draft_to_target is None else draft_to_target.to(dev)
    return build(base.to(dev), roots.to(dev), MarkovHead(w1.to(dev), w2.to(dev)), budget,
                 draft_to_target=d2t)


def _nodes(tree, r: int) -> list[tuple[int, int, int]]:
    n = int(tree.num_nodes[r])
    return list(zip(tree.token_ids[r, :n].tolist(), tree.parents[r, :n].tolist(),
                    tree.depths[r, :n].tolist()))


@pytest.mark.parametrize("D,V,budget", [(1, 7, 3), (3, 12, 7), (4, 9, 15), (5, 40, 30),
                                        (6, 5, 63), (3, 24, 1)])
@pytest.mark.parametrize("spread", [1, 8])  # 1: ties everywhere; 8: few
@pytest.mark.parametrize("seed,build", _builds_by_seed(6, 1))
def test_conditioned_build_matches_heap_oracle(seed, D, V, budget, spread, build):
    base, w1, w2, roots = _case(seed, 3, D, V, rank=3, spread=spread, v_target=V)
    tree = _run(build, base, roots, w1, w2, budget)
    for r in range(3):
        want = build_conditioned_tree_heap(base[r], int(roots[r]), w1, w2, budget)
        assert _nodes(tree, r) == want
        n = len(want)
        assert (tree.token_ids[r, n:] == -1).all() and (tree.parents[r, n:] == -1).all()


@pytest.mark.parametrize("budget", [4, 7, 15])
@pytest.mark.parametrize("seed,build", _builds_by_seed(4, 4))
def test_deep_trees_match_the_heap_oracle(seed, budget, build):
    """Peaked distributions (one likely token per depth, as a trained drafter's): deep,
    narrow trees, where the Triton build skips the parents that cannot have descendants
    in the tree and requests with none left do only the chain's row."""
    base, w1, w2, roots = _case(seed, 3, 6, 24, rank=2, spread=2, v_target=24)
    hot = torch.randint(0, 24, (3, 6), generator=torch.Generator().manual_seed(seed))
    base.scatter_(2, hot[..., None], 6.0)
    tree = _run(build, base, roots, w1, w2, budget)
    for r in range(3):
        assert _nodes(tree, r) == build_conditioned_tree_heap(base[r], int(roots[r]), w1,
                                                              w2, budget)
        assert tree.top1[r].tolist() == _greedy_chain(base[r], int(roots[r]), w1, w2)


@pytest.mark.parametrize("seed,build", _builds_by_seed(4, 2))
def test_reduced_draft_vocabulary_maps_tokens_and_conditions_on_target_ids(seed, build):
    """A draft vocabulary of 10 ids inside a target vocabulary of 32: node tokens are
    target ids, and each child distribution is conditioned on its parent's target id."""
    base, w1, w2, roots = _case(seed, 2, 4, 10, rank=2, spread=4, v_target=32)
    d2t = torch.randperm(32, generator=torch.Generator().manual_seed(seed))[:10]
    tree = _run(build, base, roots, w1, w2, 20, draft_to_target=d2t)
    for r in range(2):
        want = build_conditioned_tree_heap(base[r], int(roots[r]), w1, w2, 20,
                                           draft_to_target=d2t.tolist())
        assert _nodes(tree, r) == want
        assert set(tree.token_ids[r, : len(want)].tolist()) <= set(d2t.tolist())


@pytest.mark.parametrize("seed", range(4))
def test_without_markov_bias_it_is_the_dflash_tree(seed):
    """Zero Markov factors: every node's children share their depth's distribution,
    and the tree is build_tree's, field for field."""
    base, w1, w2, roots = _case(seed, 3, 5, 30, rank=2, spread=6, v_target=30)
    zero = MarkovHead(torch.zeros_like(w1), torch.zeros_like(w2))
    got = build_conditioned_tree(base, roots, zero, 31)
    want = build_tree_torch(base, 31)
    for field in ("token_ids", "parents", "depths", "num_nodes", "scores"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


def test_markov_head_steers_the_branches():
    """Flat base logits and a Markov head that puts +8 on the token after ``t`` being
    ``t + 1``: the best path from root 3 is 4, 5, 6, 7 (a DFlash tree over the same
    base logits has no preference at all), each node's best child follows it."""
    V, D = 16, 4
    w1 = torch.eye(V)  # rank V: exact
    w2 = torch.roll(torch.eye(V), 1, dims=0) * 8.0  # bias(t)[t + 1] = 8
    assert int(markov_bias(MarkovHead(w1, w2), torch.tensor([3]))[0].argmax()) == 4
    tree = build_conditioned_tree(torch.zeros(1, D, V), torch.tensor([3]), MarkovHead(w1, w2), 8)
    nodes = _nodes(tree, 0)
    path, cur = [], 0
    for _ in range(D):  # follow each node's first child in best-first order
        cur = next(j + 1 for j, (_, p, _) in enumerate(nodes) if p == cur)
        path.append(nodes[cur - 1][0])
    assert path == [4, 5, 6, 7]
    assert nodes == build_conditioned_tree_heap(torch.zeros(D, V), 3, w1, w2, 8)


def test_budget_zero_and_shape_errors():
    base, w1, w2, roots = _case(0, 2, 3, 8, rank=2, spread=2, v_target=8)
    empty = build_conditioned_tree(base, roots, MarkovHead(w1, w2), 0)
    assert empty.token_ids.shape == (2, 0) and (empty.num_nodes == 0).all()
    with pytest.raises(ValueError, match=r"\[R, D, V\]"):
        build_conditioned_tree(base[0], roots, MarkovHead(w1, w2), 4)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        build_conditioned_tree(base, roots, MarkovHead(w1, w2), -1)


def test_triton_build_refuses_what_one_program_cannot_sort():
    """Budget 2000 over 30 draft tokens: depth 3's ~7200 pairs do not fit one program's
    sort, which the launcher says before any work (build_conditioned_tree uses torch)."""
    from vllm_ddtree.kernels.tree_build import select_children_supported

    base, w1, w2, roots = _case(0, 2, 3, 30, rank=2, spread=2, v_target=30)
    assert not select_children_supported(3, 30, 2000)
    with pytest.raises(ValueError, match="build_conditioned_tree_triton: needs Triton and a "
                                         "pair sort that fits one program"):
        build_conditioned_tree_triton(base, roots, MarkovHead(w1, w2), 2000)
    empty = build_conditioned_tree_triton(base, roots, MarkovHead(w1, w2), 0)  # nothing to select
    assert empty.token_ids.shape == (2, 0)


def test_build_conditioned_tree_picks_triton_on_the_gpu_where_the_sort_fits(monkeypatch):
    """The one rule: build_conditioned_tree_triton where use_triton holds (Triton, a GPU
    tensor) and every depth's pair sort fits one program, else the torch reference; the
    same arguments pass through."""
    from vllm_ddtree.kernels.tree_build import select_children_supported
    from vllm_ddtree.tree import conditioned

    calls = []
    for name in ("build_conditioned_tree_torch", "build_conditioned_tree_triton"):
        monkeypatch.setattr(conditioned, name,
                            lambda *args, name=name: calls.append((name, args[3:])))
    base, w1, w2, roots = _case(0, 2, 3, 30, rank=2, spread=2, v_target=30)
    d2t = torch.arange(30)
    for on_gpu in (True, False):
        monkeypatch.setattr(conditioned, "use_triton", lambda t, on_gpu=on_gpu: on_gpu)
        build_conditioned_tree(base, roots, MarkovHead(w1, w2), 15, d2t)
        build_conditioned_tree(base, roots, MarkovHead(w1, w2), 2000)
    fits = ("build_conditioned_tree_triton" if select_children_supported(3, 15, 15)
            else "build_conditioned_tree_torch")
    torch_ = "build_conditioned_tree_torch"
    assert [n for n, _ in calls] == [fits, torch_, torch_, torch_]
    assert [a[0] for _, a in calls] == [15, 2000, 15, 2000]
    assert all(a[1] is (d2t if a[0] == 15 else None) for _, a in calls)


def _greedy_chain(base, root, w1, w2, d2t=None):
    """The drafter's own left-to-right argmax chain (lowest draft id on ties)."""
    to_target = (lambda i: i) if d2t is None else (lambda i: int(d2t[i]))
    prev, chain = root, []
    for d in range(base.shape[0]):
        logits = base[d] + markov_bias(MarkovHead(w1, w2), torch.tensor([prev]))[0]
        prev = to_target(int(torch.nonzero(logits == logits.max())[0]))
        chain.append(prev)
    return chain


@pytest.mark.parametrize("budget", [1, 4, 31])
@pytest.mark.parametrize("seed,build", _builds_by_seed(6, 2))
def test_top1_is_the_drafters_greedy_chain(seed, budget, build):
    """``top1`` (the chain fallback) follows the Markov head from the root, even where
    the tree dropped the chain's nodes (budget 1 keeps one node)."""
    base, w1, w2, roots = _case(seed, 3, 5, 16, rank=2, spread=3, v_target=24)
    d2t = torch.randperm(24, generator=torch.Generator().manual_seed(seed))[:16]
    tree = _run(build, base, roots, w1, w2, budget, draft_to_target=d2t)
    for r in range(3):
        assert tree.top1[r].tolist() == _greedy_chain(base[r], int(roots[r]), w1, w2, d2t)
    assert not tree.nonfinite.any()


def test_nonfinite_flags_only_the_request_with_nan_or_inf():
    base, w1, w2, roots = _case(1, 3, 4, 12, rank=2, spread=3, v_target=12)
    base[1, 2, 5] = float("nan")
    base[2, 0, 0] = float("inf")
    tree = build_conditioned_tree(base, roots, MarkovHead(w1, w2), 7)
    assert tree.nonfinite.tolist() == [False, True, True]
