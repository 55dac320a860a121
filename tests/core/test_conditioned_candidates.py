"""The conditioned (DSpark) build's per-depth candidate kernel against its torch
reference: each parent's ``need`` best children (ids and log-probabilities), and its
non-finite flag, straight from the Markov factors.

Half-integer inputs and a small rank keep every logit exact in float32 whatever the
summation order, so any difference is the kernel's (its pruning bound, its merge)."""

import pytest
import torch

from vllm_ddtree.tree.conditioned import (
    MarkovHead,
    conditioned_candidates_torch,
    parent_needs,
)

pytestmark = pytest.mark.triton
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton kernels run


def _inputs(seed: int, R: int, P: int, V: int, spread: int, rank: int = 3):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-spread, spread + 1, (R, V), generator=g).float() / 2
    w1 = torch.randint(-2, 3, (V, rank), generator=g).float() / 2
    w2 = torch.randint(-2, 3, (V, rank), generator=g).float() / 2
    parents = torch.randint(0, V, (R, P), generator=g)
    return base, MarkovHead(w1, w2, 0.5), parents


def _triton(base, parents, need, top_ids, head, k: int, tuning=None, **pruned):
    """The kernel on the GPU where there is one (else under the interpreter), its
    results back on the CPU."""
    from vllm_ddtree.kernels.conditioned_candidates import conditioned_candidates_triton

    to = lambda t: t.to(DEV)
    out = conditioned_candidates_triton(
        to(base), to(parents), to(need), to(top_ids.contiguous()), to(head.w1),
        to(head.w2), head.scale, k, tuning, **{n: to(t) for n, t in pruned.items()})
    return tuple(t.cpu() for t in out)


def _run(base, head, parents, k: int, width: int, top_ids=None, tuning=None):
    need = torch.tensor(parent_needs(k, width, parents.shape[1] - 1))
    if top_ids is None:  # the depth's best base tokens, as the build passes them
        top_ids = torch.sort(base, dim=1, descending=True, stable=True).indices[:, :64]
    return need, _triton(base, parents, need, top_ids, head, k, tuning)


def _assert_same_needed(need, got, want):
    """The first ``need[p]`` children of every parent and every flag equal; their
    log-probabilities to float32 rounding (the kernel's log-sum-exp merges per-chunk
    sums, ``torch.logsumexp`` sums the row)."""
    for p, n in enumerate(need.tolist()):
        assert torch.equal(got[1][:, p, :n], want[1][:, p, :n]), p
        torch.testing.assert_close(got[0][:, p, :n], want[0][:, p, :n], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[2], want[2])


def _tuning(tile: int = 8192, group: int = 1, sort: bool = False):
    from vllm_ddtree.kernels.conditioned_candidates import ConditionedTuning

    return ConditionedTuning(tile=tile, warps=8, group=group, bound_sort=sort,
                             merge_sort=sort)


# spread 1: ties everywhere; 8: few.  Five chunks in groups of two (the last group's
# second chunk past the vocabulary); the bound's and the merge's sort (slow here) once
@pytest.mark.parametrize("seed,spread,tile,group,sort", [
    (0, 1, 8192, 1, False), (1, 8, 8192, 1, False), (2, 8, 4096, 2, False),
    (0, 1, 8192, 1, True)])
def test_candidates_match_the_reference_over_several_chunks(seed, spread, tile, group,
                                                            sort):
    """1100 draft tokens: three vocabulary chunks per request (five of the smaller tile),
    8 parents of a budget-15 tree (needs 15, 7, 5, 3, 3, 2, 2 and the chain's 1)."""
    base, head, parents = _inputs(seed, 2, 8, 1100, spread)
    need, got = _run(base, head, parents, 15, 15, tuning=_tuning(tile, group, sort))
    _assert_same_needed(need, got, conditioned_candidates_torch(base, parents, head, 15))


def test_any_bound_tokens_give_the_same_candidates():
    """The bound's tokens only prune: the worst base tokens (a loose bound, nearly every
    entry kept) and the best give the same children."""
    base, head, parents = _inputs(3, 2, 6, 700, 8)
    worst = torch.sort(base, dim=1, stable=True).indices[:, :15]
    need, loose = _run(base, head, parents, 15, 31, top_ids=worst)
    _, tight = _run(base, head, parents, 15, 31)
    want = conditioned_candidates_torch(base, parents, head, 15)
    _assert_same_needed(need, loose, want)
    _assert_same_needed(need, tight, want)


def test_nonfinite_logits_are_flagged_per_parent_and_sanitized():
    """A NaN base logit flags every parent of its request; a Markov bias that overflows
    to inf only the parent whose embedding makes it; children ranked on the sanitized
    logits."""
    base, head, parents = _inputs(5, 2, 4, 300, 4)
    base[0, 17] = float("nan")
    head.w1[:, 0] = 0.0
    head.w1[int(parents[1, 2]), 0] = 3e38  # times w2[40, 0] = 4: inf; elsewhere finite
    head.w2[40, 0] = 4.0
    need, got = _run(base, head, parents, 7, 7)
    want = conditioned_candidates_torch(base, parents, head, 7)
    assert got[2].tolist() == [[True] * 4, [p == int(parents[1, 2]) for p in
                                            parents[1].tolist()]]
    _assert_same_needed(need, got, want)


def test_grouped_and_sorted_over_masked_logits():
    """The GPU's grouped setting with both sorts: eight chunks a program over a
    vocabulary of five (one group, its last three chunks past the end); 60% of the base
    logits -inf, so some parents have fewer finite children than they need (bound -inf);
    40 bound tokens, fewer than the kernel's block of them."""
    base, head, parents = _inputs(6, 2, 8, 1100, 8)
    g = torch.Generator().manual_seed(7)
    base[torch.rand(base.shape, generator=g) < 0.6] = float("-inf")
    base[1, :1090] = float("-inf")  # request 1: ten finite tokens, parent 0 needs 15
    top_ids = torch.sort(base, dim=1, descending=True, stable=True).indices[:, :40]
    need, got = _run(base, head, parents, 15, 15, top_ids=top_ids,
                     tuning=_tuning(4096, 8, True))
    _assert_same_needed(need, got, conditioned_candidates_torch(base, parents, head, 15))


@pytest.mark.parametrize("tile,group", [(8192, 1), (4096, 2)])
def test_only_parents_at_or_above_the_threshold_get_children(tile, group):
    """With parent scores and a threshold per request: parents scoring at least the
    threshold, and the chain's parent (the last), get the reference's children and
    flags; the others -inf log-probabilities and no flag, even where their bias is not
    finite.  Request 1 has no parent at the threshold: its chunks do the chain's row
    alone, which still flags a NaN base logit."""
    base, head, parents = _inputs(8, 3, 6, 900, 8)
    base[1, 33] = float("nan")
    head.w1[:, 0] = 0.0
    head.w1[int(parents[0, 3]), 0] = 3e38  # an inf bias in a parent below the threshold
    head.w2[40, 0] = 4.0
    scores = torch.tensor([[-1.0, -2.0, -2.5, -3.0, -4.0],
                           [-5.0, -6.0, -6.5, -7.0, -8.0],
                           [-1.0, -1.5, -2.0, -2.5, -3.0]])
    theta = torch.tensor([-2.5, -4.0, float("-inf")])
    need = torch.tensor(parent_needs(9, 15, 5))
    top_ids = torch.sort(base, dim=1, descending=True, stable=True).indices[:, :64]
    lp, ids, bad = _triton(base, parents, need, top_ids, head, 9, _tuning(tile, group),
                           parent_scores=scores, theta=theta)
    want = conditioned_candidates_torch(base, parents, head, 9)
    use = torch.cat([scores >= theta[:, None], torch.ones(3, 1, dtype=torch.bool)], 1)
    assert use.tolist() == [[True, True, True, False, False, True],
                            [False] * 5 + [True], [True] * 6]
    for r in range(3):
        for p, n in enumerate(need.tolist()):
            if use[r, p]:
                assert torch.equal(ids[r, p, :n], want[1][r, p, :n]), (r, p)
                torch.testing.assert_close(lp[r, p, :n], want[0][r, p, :n], rtol=1e-6,
                                           atol=1e-6)
            else:
                assert (lp[r, p] == float("-inf")).all(), (r, p)
    assert want[2][0, 3] and want[2][1].all()
    assert torch.equal(bad, want[2] & use)


@pytest.mark.parametrize("R,D,V,nb", [(2, 3, 200, 64), (1, 2, 64, 64), (3, 2, 100, 63),
                                      (2, 2, 1000, 17), (1, 2, 5, 5)])
def test_bound_tokens_are_each_spans_best_token(R, D, V, nb):
    """The bound's tokens (the build's): per request and depth, the best base token of
    each of ``nb`` vocabulary spans (the last one to the end; V = 100 over 63 spans
    leaves it 38 tokens), ties to the lower id (logits of three values), a NaN ranked
    last; so ``nb`` distinct tokens, which the kernel needs."""
    from vllm_ddtree.kernels.conditioned_candidates import (
        bound_tokens_torch,
        bound_tokens_triton,
    )

    g = torch.Generator().manual_seed(R * V + nb)
    base = torch.randint(0, 3, (R, D, V), generator=g).float()
    base[0, 0, : V // nb] = float("nan")  # the first span all NaN but one 0
    base[0, 0, 1] = 0.0
    got = bound_tokens_triton(base.to(DEV), nb).cpu()
    want = bound_tokens_torch(base, nb)
    assert got.shape == (D, R, nb) and torch.equal(got, want)
    assert int(got[0, 0, 0]) == (1 if V // nb > 1 else 0)
    for d in range(D):
        for r in range(R):
            ids = got[d, r]
            assert len(set(ids.tolist())) == nb
            span = V // nb
            for j, t in enumerate(ids.tolist()):
                end = V if j == nb - 1 else (j + 1) * span
                row = torch.nan_to_num(base[r, d, j * span:end], nan=float("-inf"))
                assert t == j * span + int(torch.argmax(row))
