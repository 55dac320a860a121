"""Per-node sampling (vllm_ddtree.tree.sampling) in plain torch."""

import pytest
import torch

from vllm_ddtree.tree.sampling import sample_rows, top_k_top_p_torch

scipy_stats = pytest.importorskip("scipy.stats")

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def _draw(n, temperature=1.0, seed=0, **kw):
    torch.manual_seed(seed)
    logits = PROBS.log().expand(n, 4).clone()
    return sample_rows(logits, torch.full((n,), temperature), **kw)


def test_draws_follow_the_distribution_and_the_test_has_power():
    n = 20000
    counts = torch.bincount(_draw(n), minlength=4).tolist()
    assert scipy_stats.chisquare(counts, (PROBS * n).tolist()).pvalue > 1e-3
    hot = torch.bincount(_draw(n, temperature=0.8), minlength=4).tolist()
    assert scipy_stats.chisquare(hot, (PROBS * n).tolist()).pvalue < 1e-3


def test_greedy_rows_and_filters():
    n = 2000
    logits = PROBS.log().expand(n, 4).clone()
    t = torch.ones(n)
    t[::2] = 0.0  # greedy rows
    out = sample_rows(logits, t)
    assert (out[::2] == 0).all() and len(set(out[1::2].tolist())) > 1
    assert set(_draw(n, top_k=torch.full((n,), 2)).tolist()) == {0, 1}
    assert set(_draw(n, top_p=torch.full((n,), 0.75)).tolist()) == {0, 1}
    assert set(_draw(n, min_p=torch.full((n,), 0.4)).tolist()) == {0, 1}  # 0.15 < 0.4*0.5


def test_seeded_rows_reproducible():
    gens = lambda: {i: torch.Generator().manual_seed(i) for i in range(8)}
    logits = torch.randn(8, 50)
    first = sample_rows(logits, torch.ones(8), generators=gens())
    assert torch.equal(first, sample_rows(logits, torch.ones(8), generators=gens()))
    assert len(set(first.tolist())) > 1


def test_top_k_top_p_torch_masks():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert torch.isinf(top_k_top_p_torch(x.clone(), torch.tensor([2]), None)[0, [0, 3]]).all()
    y = top_k_top_p_torch(x.clone(), None, torch.tensor([0.5]))
    assert torch.isfinite(y[0, 1]) and torch.isinf(y[0, [0, 3]]).all()


def test_keyed_generator_depends_only_on_seed_and_position():
    from vllm_ddtree.tree.sampling import keyed_generator

    def draw(seed, pos):
        return torch.rand(4, generator=keyed_generator(seed, pos))

    assert torch.equal(draw(7, 100), draw(7, 100))  # no hidden stream state
    assert not torch.equal(draw(7, 100), draw(7, 101))
    assert not torch.equal(draw(7, 100), draw(8, 100))
    assert not torch.equal(draw(0, 1), draw(1, 0))
