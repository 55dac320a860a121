"""build_tree against the Python heap of Algorithm 1, exactly (token, parent, depth)."""

import math

import pytest
import torch

from vllm_ddtree.tree import build_tree
from vllm_ddtree.tree.build import build_tree_torch, build_tree_triton
from vllm_ddtree.tree.reference import build_tree_heap


def _as_lists(tree, r):
    n = int(tree.num_nodes[r])
    return list(zip(tree.token_ids[r, :n].tolist(), tree.parents[r, :n].tolist(),
                    tree.depths[r, :n].tolist()))


def _check(logits, budget):
    tree = build_tree(logits, budget)
    R, D, V = logits.shape
    for r in range(R):
        ref = build_tree_heap(logits[r], budget)
        assert _as_lists(tree, r) == ref, (r, budget)
        n = len(ref)
        # padding
        assert (tree.token_ids[r, n:] == -1).all() and (tree.parents[r, n:] == -1).all()
        assert (tree.depths[r, n:] == 0).all()
    return tree


def _logits(gen, R, D, V, kind):
    if kind == "normal":
        return torch.randn(R, D, V, generator=gen) * 3
    if kind == "peaked":  # realistic drafts: one dominant token per depth
        x = torch.randn(R, D, V, generator=gen)
        x.scatter_(2, torch.randint(0, V, (R, D, 1), generator=gen), 12.0)
        return x
    if kind == "ties":  # few distinct values: massive ties in logits and in path scores
        return torch.randint(0, 3, (R, D, V), generator=gen).float()
    if kind == "flat":
        return torch.zeros(R, D, V)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["normal", "peaked", "ties", "flat"])
@pytest.mark.parametrize("R,D,V,budget", [
    (1, 1, 2, 1), (3, 1, 7, 5), (2, 4, 2, 20), (2, 3, 3, 100),  # budget > D*V
    (4, 6, 50, 1), (4, 6, 50, 6), (4, 15, 64, 60), (2, 16, 300, 240),
    (2, 15, 1000, 1024), (64, 5, 40, 16),
])
def test_build_matches_heap(kind, R, D, V, budget):
    gen = torch.Generator().manual_seed(R * 1000 + D * 100 + V + budget)
    _check(_logits(gen, R, D, V, kind), budget)


def test_large_vocab():
    gen = torch.Generator().manual_seed(7)
    _check(_logits(gen, 2, 15, 50_000, "peaked"), 256)
    _check(_logits(gen, 1, 4, 50_000, "ties"), 64)


def test_topological_order_and_counts():
    gen = torch.Generator().manual_seed(3)
    x = _logits(gen, 8, 15, 200, "normal")
    tree = build_tree(x, 300)
    assert (tree.num_nodes == 300).all()
    j = torch.arange(300)
    assert (tree.parents <= j).all()  # parent (1-based) precedes the node
    par = tree.parents.clamp(min=1) - 1
    pdepth = torch.where(tree.parents == 0, 0, torch.gather(tree.depths, 1, par))
    assert (tree.depths == pdepth + 1).all()
    # best-first: scores never increase along the output order
    assert (tree.scores[:, 1:] <= tree.scores[:, :-1]).all()
    # siblings carry distinct tokens
    for r in range(8):
        seen = set(zip(tree.parents[r].tolist(), tree.token_ids[r].tolist()))
        assert len(seen) == 300


def test_per_request_budget_tensor():
    gen = torch.Generator().manual_seed(11)
    x = _logits(gen, 5, 6, 30, "normal")
    budgets = torch.tensor([0, 1, 7, 30, 64])
    tree = build_tree(x, budgets, max_budget=64)
    assert tree.token_ids.shape == (5, 64)
    assert tree.num_nodes.tolist() == [0, 1, 7, 30, 64]
    for r in range(5):
        assert _as_lists(tree, r) == build_tree_heap(x[r], int(budgets[r]))
    with pytest.raises(ValueError, match="max_budget"):
        build_tree(x, budgets)


def test_empty_and_degenerate():
    x = torch.randn(3, 4, 10)
    t = build_tree(x, 0)
    assert t.token_ids.shape == (3, 0) and t.num_nodes.tolist() == [0, 0, 0]
    t = build_tree(torch.randn(0, 4, 10), 5)
    assert t.token_ids.shape == (0, 5)


def test_nan_inf_logits():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 5, 30, generator=gen)
    x[0, 1, 3] = float("nan")
    x[1, :, :] = float("nan")  # a whole request of NaN
    x[2, 2, 7] = float("inf")
    x[3, 0, :] = float("-inf")
    x[3, 3, 4] = float("-inf")
    tree = _check(x, 40)
    # NaN counts as -inf: the NaN token is ranked after every finite token at its depth
    assert torch.isfinite(tree.scores[0, : int(tree.num_nodes[0])]).all()
    # +inf wins its depth outright
    d3 = (tree.depths[2] == 3) & (tree.parents[2] >= 0)
    assert 7 in tree.token_ids[2][d3].tolist()


def test_budget_larger_than_tree():
    x = torch.randn(2, 3, 2)
    tree = _check(x, 50)
    assert tree.num_nodes.tolist() == [2 + 4 + 8] * 2  # every prefix


def test_path_probabilities_sum_to_depth():
    x = torch.randn(1, 3, 5)
    tree = build_tree(x, 500)  # the whole tree: sum over all prefixes = D
    expected_accepted = tree.scores.exp().sum(dim=1)  # per request, float32
    assert math.isclose(float(expected_accepted[0]), 3.0, rel_tol=1e-5)


_ON_GPU = torch.cuda.is_available()
# The Triton interpreter runs tl.sort slowly: small shapes on CPU, the full set on a GPU.
_TRITON_CASES = ([(3, 1, 7, 5), (2, 4, 2, 20), (4, 15, 64, 60), (2, 6, 300, 128),
                  (5, 15, 1000, 16), (64, 15, 4096, 64)] if _ON_GPU
                 else [(3, 1, 7, 5), (2, 4, 2, 12), (3, 5, 40, 16)])


@pytest.mark.triton
@pytest.mark.parametrize("kind", ["normal", "ties", "flat", "peaked"])
@pytest.mark.parametrize("R,D,V,budget", _TRITON_CASES)
def test_triton_build_matches_torch(kind, R, D, V, budget):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(R + D + V + budget)
    x = _logits(gen, R, D, V, kind).to(dev)  # same device: identical log-softmax values
    ref = build_tree_torch(x, budget)
    per_req = torch.tensor([budget - (r % 3) for r in range(R)], device=dev)
    ref_pr = build_tree_torch(x, per_req, max_budget=budget)
    for want, b in ((ref, budget), (ref_pr, per_req)):
        got = build_tree_triton(x, b, max_budget=budget)
        for f in ("token_ids", "parents", "depths", "num_nodes", "scores"):
            assert torch.equal(getattr(got, f), getattr(want, f)), f


def test_cpu_topk_equals_stable_sort_prefix():
    """The CPU path's top-k (no full sort of the vocabulary) must rank exactly like a
    stable descending sort: ties by lower index, -0.0 == +0.0, -inf entries, k >= V."""
    from vllm_ddtree.tree.build import _topk_exact_ties

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        V = int(torch.randint(2, 300, (1,), generator=g))
        x = torch.randn(2, 3, V, generator=g)
        kind = trial % 5
        if kind == 1:
            x = torch.randint(0, 3, (2, 3, V), generator=g).float()  # massive ties
        elif kind == 2:
            x = torch.full((2, 3, V), float("-inf"))
            x[..., :2] = 1.0
        elif kind == 3:
            x[..., ::3] = float("-inf")
        elif kind == 4:
            x[..., ::2] = 0.0
            x[..., 1::4] = -0.0
        k = int(torch.randint(1, V + 3, (1,), generator=g))
        want_v, want_i = torch.sort(x, dim=-1, descending=True, stable=True)
        got_v, got_i = _topk_exact_ties(x, k)
        assert torch.equal(got_v, want_v[..., :k]) and torch.equal(got_i, want_i[..., :k])


@pytest.mark.triton
@pytest.mark.parametrize("topk_pruned,k", [(False, 5), (False, 16), (True, 5), (True, 16),
                                           (True, 40)])
def test_cuda_candidates_match_cpu_for_each_topk_variant(topk_pruned, k):
    """The per-depth candidates of the CUDA path (the Triton top-k, in the variant that
    build_tree passes down) equal the CPU path's, ties and NaN/inf included."""
    from vllm_ddtree.tree.build import depth_candidates_torch, depth_candidates_triton

    dev = "cuda" if _ON_GPU else "cpu"
    gen = torch.Generator().manual_seed(k)
    x = torch.randint(0, 4, (2, 3, 3000), generator=gen).float()  # heavy ties
    x[0, 1, 17] = float("nan")
    x[1, 2, 2999] = float("inf")
    want_lp, want_tok = depth_candidates_torch(x, k)  # exact top-k with stable ties
    got_lp, got_tok = depth_candidates_triton(x.to(dev), k, topk_pruned=topk_pruned)
    assert torch.equal(got_tok.cpu(), want_tok)
    torch.testing.assert_close(got_lp.cpu(), want_lp, atol=1e-5, rtol=1e-5)


@pytest.mark.triton
@pytest.mark.parametrize("topk_pruned,k", [(False, 5), (True, 5), (True, 40), (True, 70)])
def test_cuda_candidates_flag_nonfinite_depths(topk_pruned, k):
    """The top-k kernel's own pass flags each depth whose logits hold a NaN, +inf or -inf
    (k = 70: beyond the kernel, torch's top-k path), the same as torch.isfinite."""
    from vllm_ddtree.tree.build import depth_candidates_torch, depth_candidates_triton

    dev = "cuda" if _ON_GPU else "cpu"
    x = torch.randn(3, 4, 3000, generator=torch.Generator().manual_seed(k))
    x[0, 1, 17] = float("nan")
    x[1, 2, 2999] = float("inf")  # the last entry of the last chunk
    x[2, 0, 0] = float("-inf")
    x[2, 3, 1500] = float("nan")
    want = ~torch.isfinite(x).all(dim=-1)  # [3, 4]
    assert want.sum() == 4
    *_, got = depth_candidates_triton(x.to(dev), k, topk_pruned=topk_pruned,
                                      with_nonfinite=True)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(depth_candidates_torch(x, k, with_nonfinite=True)[2], want)


@pytest.mark.triton
@pytest.mark.parametrize("topk_pruned,k", [(False, 5), (True, 16), (True, 70)])
def test_cuda_candidates_add_a_shared_term_as_if_written_out(topk_pruned, k):
    """``add`` (a row per request, shared by its D rows, as the conditioned build passes
    the depth's base logits under each parent's Markov bias): the same candidates,
    log-probabilities and non-finite flags as the float32 sum written out, from bf16
    rows with ties (k = 70: beyond the kernel, the written-out fallback, whose torch top-k orders
    ties by index on CUDA only: no ties there)."""
    from vllm_ddtree.tree.build import depth_candidates_torch, depth_candidates_triton

    dev = "cuda" if _ON_GPU else "cpu"
    gen = torch.Generator().manual_seed(k)
    x = (torch.randint(-2, 3, (2, 3, 3000), generator=gen).bfloat16() if k <= 64  # ties
         else torch.randn(2, 3, 3000, generator=gen))
    # a depth's row of [R, D', V] base logits, as the conditioned build passes it
    base = (torch.randint(0, 3, (2, 4, 3000), generator=gen) / 2)[:, 1, :]
    x[0, 1, 17] = float("nan")
    base[1, 2999] = float("inf")  # every row of request 1 gets it
    written = x.float() + base.unsqueeze(1)
    want = depth_candidates_torch(written, k, with_nonfinite=True)  # the reference
    assert torch.equal(want[2], torch.tensor([[False, True, False], [True, True, True]]))
    assert all(torch.equal(c, w) for c, w in
               zip(depth_candidates_torch(x, k, with_nonfinite=True, add=base), want))
    got = depth_candidates_triton(x.to(dev), k, topk_pruned=topk_pruned,
                                  with_nonfinite=True, add=base.to(dev))
    same = depth_candidates_triton(written.to(dev), k, topk_pruned=topk_pruned,
                                   with_nonfinite=True)
    for g, w in zip(got, same):  # the same numbers as the sum written out
        assert torch.equal(g, w)
    assert torch.equal(got[1].cpu(), want[1]) and torch.equal(got[2].cpu(), want[2])


@pytest.mark.parametrize("build", [build_tree_torch, pytest.param(
    build_tree_triton, marks=pytest.mark.triton)])
def test_build_keeps_each_depths_best_token_and_nonfinite_requests(build):
    """build_tree's by-products: ``top1`` is the drafter's chain (argmax per depth, ties
    to the lower id), ``nonfinite`` the requests drop_nonfinite empties, which then reads
    the flag instead of the logits."""
    from vllm_ddtree.tree import drop_nonfinite

    dev = "cuda" if _ON_GPU and build is build_tree_triton else "cpu"  # Triton's device
    x = torch.randint(0, 5, (4, 3, 300), generator=torch.Generator().manual_seed(1)).float()
    x[2, 1, 7] = float("nan")
    tree = build(x.to(dev), 8)
    sane = torch.nan_to_num(x, nan=float("-inf"))
    assert torch.equal(tree.top1.cpu(), sane.argmax(dim=-1))
    assert tree.nonfinite.tolist() == [False, False, True, False]
    bad = drop_nonfinite(tree, torch.zeros_like(x, device=dev))  # the flag decides
    assert bad.tolist() == [False, False, True, False]
    assert (tree.token_ids[2] == -1).all() and int(tree.num_nodes[2]) == 0
    assert int(tree.num_nodes[0]) == 8


def test_triton_build_refuses_what_one_program_cannot_sort():
    """Budget 600 at depth 8: the global selection (1024 x 8 keys) does not fit one
    program's sort, which the launcher says (the dispatching build_tree uses torch)."""
    from vllm_ddtree.kernels.tree_build import triton_build_supported

    x = torch.randn(2, 8, 30, generator=torch.Generator().manual_seed(0))
    assert not triton_build_supported(8, 30, 600)
    with pytest.raises(ValueError, match="build_tree_triton: does not support D=8, K=30, "
                                         "width=600"):
        build_tree_triton(x, 600)
    assert build_tree_triton(x, 0).token_ids.shape == (2, 0)  # nothing to select: no error


def test_build_tree_picks_triton_on_the_gpu_where_the_width_fits(monkeypatch):
    """build_tree's one rule: build_tree_triton where use_triton holds (Triton, a GPU
    tensor) and the width fits one program, else build_tree_torch; the same arguments
    pass through."""
    from vllm_ddtree.kernels.tree_build import triton_build_supported
    from vllm_ddtree.tree import build as build_module

    calls = []
    for name in ("build_tree_torch", "build_tree_triton"):
        monkeypatch.setattr(build_module, name,
                            lambda *args, name=name: calls.append((name, args[1:])))
    x = torch.zeros(2, 8, 30)
    for on_gpu in (True, False):
        monkeypatch.setattr(build_module, "use_triton", lambda t, on_gpu=on_gpu: on_gpu)
        build_tree(x, 15)
        build_tree(x, 600)
        build_tree(x, torch.tensor([3, 5]), 15, True, False)
    fits = "build_tree_triton" if triton_build_supported(8, 15, 15) else "build_tree_torch"
    t = torch.tensor([3, 5])
    want = [(fits, (15, None, False, True)), ("build_tree_torch", (600, None, False, True)),
            (fits, (t, 15, True, False))] + [
        ("build_tree_torch", (15, None, False, True)),
        ("build_tree_torch", (600, None, False, True)),
        ("build_tree_torch", (t, 15, True, False))]
    assert [n for n, _ in calls] == [n for n, _ in want]
    for (_, got), (_, exp) in zip(calls, want):
        assert len(got) == len(exp) and all(
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            for a, b in zip(got, exp))
