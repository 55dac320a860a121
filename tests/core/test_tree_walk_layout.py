"""walk_tree, verify metadata and compaction plans against plain-Python references."""

import pytest
import torch

from vllm_ddtree.tree import build_tree, compaction_plan, tree_layout, walk_tree
from vllm_ddtree.tree.reference import walk_tree_ref


def _tree(seed, R=6, D=8, V=12, budget=40):
    gen = torch.Generator().manual_seed(seed)
    return build_tree(torch.randn(R, D, V, generator=gen) * 2, budget), gen


def _targets_following_branches(tree, gen, p_follow=0.8):
    """Target tokens that follow a random existing child with probability p_follow."""
    R, W = tree.token_ids.shape
    V = 12
    tgt = torch.randint(0, V, (R, W + 1), generator=gen)
    for r in range(R):
        for row in range(W + 1):
            kids = [j for j in range(W) if int(tree.parents[r, j]) == row]
            if kids and torch.rand((), generator=gen) < p_follow:
                k = kids[int(torch.randint(0, len(kids), (), generator=gen))]
                tgt[r, row] = tree.token_ids[r, k]
    return tgt


@pytest.mark.parametrize("seed", range(8))
def test_walk_matches_reference(seed):
    tree, gen = _tree(seed)
    tgt = _targets_following_branches(tree, gen)
    acc, num, bonus = walk_tree(tree, tgt)
    total_path = 0
    for r in range(tree.token_ids.shape[0]):
        n = int(tree.num_nodes[r])
        nodes = list(zip(tree.token_ids[r, :n].tolist(), tree.parents[r, :n].tolist(),
                         tree.depths[r, :n].tolist()))
        path, b = walk_tree_ref(nodes, tgt[r].tolist())
        assert acc[r, : len(path)].tolist() == path
        assert (acc[r, len(path):] == -1).all()
        assert int(num[r]) == len(path) and int(bonus[r]) == b
        total_path += len(path)
    assert total_path > tree.token_ids.shape[0]  # the fixture really accepts nodes


def test_walk_all_accepted_chain_and_empty_tree():
    V = 5
    x = torch.full((2, 4, V), -10.0)
    x[:, :, 2] = 10.0  # every depth: token 2
    tree = build_tree(x, 4)  # the chain 2,2,2,2
    tgt = torch.full((2, 5), 2)
    acc, num, bonus = walk_tree(tree, tgt)
    assert acc.tolist() == [[0, 1, 2, 3, 4]] * 2 and num.tolist() == [5, 5]
    tgt[1, 2] = 3  # reject at node 1 (its child is rejected)
    acc, num, bonus = walk_tree(tree, tgt)
    assert acc[1].tolist() == [0, 1, 2, -1, -1] and int(bonus[1]) == 3
    empty = build_tree(x, 0)
    acc, num, bonus = walk_tree(empty, torch.tensor([[4], [1]]))
    assert acc.tolist() == [[0, -1, -1, -1, -1]] * 2 and bonus.tolist() == [4, 1]


def test_layout_positions_and_ancestors():
    tree, _ = _tree(1, R=3, D=6, V=9, budget=70)  # 71 rows -> 3 mask words
    root = torch.tensor([5, 100, 0])
    lay = tree_layout(tree, root)
    assert lay.ancestor_bits.shape == (3, 71, 3) and lay.ancestor_bits.dtype == torch.int32
    mask = lay.dense_mask()
    for r in range(3):
        n = int(tree.num_nodes[r])
        par = [-1] + tree.parents[r, :n].tolist()
        for q in range(71):
            expect = set()
            if q <= n:
                a = q
                while a >= 0:
                    expect.add(a)
                    a = par[a] if a > 0 else -1
            else:
                expect = {q}
            assert set(torch.nonzero(mask[r, q]).flatten().tolist()) == expect
            if q <= n:
                depth = len(expect) - 1
                assert int(lay.positions[r, q]) == int(root[r]) + depth


def _apply_compaction(cache, row_base, plan):
    """Compact a flat ``[num_slots, ...]`` cache whose verify row ``i`` of request ``r``
    lives at ``row_base[r] + i``, gathering every source before writing."""
    base = row_base.to(torch.int64).unsqueeze(1)
    src = (base + plan.src_rows)[plan.moves]
    dst = (base + plan.dst_rows)[plan.moves]
    cache[dst] = cache[src]


def test_compaction_plan_and_apply():
    tree, gen = _tree(2)
    tgt = _targets_following_branches(tree, gen, p_follow=1.0)
    acc, num, _ = walk_tree(tree, tgt)
    plan = compaction_plan(acc, num)
    R, W = tree.token_ids.shape
    base = torch.arange(R) * (W + 1) + 3
    cache = torch.arange(R * (W + 1) + 3).float().unsqueeze(1).repeat(1, 2)
    before = cache.clone()
    _apply_compaction(cache, base, plan)
    for r in range(R):
        k = int(num[r])
        rows = acc[r, :k]
        assert torch.equal(cache[base[r] + torch.arange(k)], before[base[r] + rows])
        untouched = [i for i in range(W + 1) if i >= k]
        assert torch.equal(cache[base[r] + torch.tensor(untouched, dtype=torch.long)],
                           before[base[r] + torch.tensor(untouched, dtype=torch.long)])
    assert plan.moves.any()
    assert not (plan.moves & (plan.src_rows == plan.dst_rows)).any()
