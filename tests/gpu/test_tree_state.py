"""The V2 (GPU) path's device state on CPU: a simulated verify step through
:class:`TreeStates` (add_request -> store_batch -> chain fallback -> fill_rows
into :class:`StepRows` -> walk) against the Python reference walk, with vLLM's batch
layout (requests reordered between steps, a tree cut short by the scheduler, a prefill
chunk and a chain-fallback request in the same batch)."""

import numpy as np
import torch

from vllm_ddtree.gpu.rows import causal_words
from vllm_ddtree.gpu.step_rows import StepRows
from vllm_ddtree.gpu.tree_state import TreeStates
from vllm_ddtree.tree import build_tree
from vllm_ddtree.tree.reference import walk_tree_ref

B, D, V = 12, 4, 30
STATES = [3, 0, 5]  # the request states of the proposing batch's rows; state 5: a chain


def _step(seed, device="cpu"):
    """Three requests take states 3, 0, 5 (5 verified as a chain) and propose trees."""
    g = torch.Generator().manual_seed(seed)
    ts = TreeStates(max_num_reqs=6, budget=B, max_depth=D, device=device)
    for state in STATES:
        ts.add_request(state, as_chain=state == 5)
    logits = (torch.randn(3, D, V, generator=g) * 3).to(device)
    tree = build_tree(logits, B)
    draft_tokens = torch.zeros(6, B, dtype=torch.int64, device=device)
    idx_propose = torch.tensor(STATES, dtype=torch.int32, device=device)  # request states
    ts.store_batch(tree, logits, draft_tokens, idx_propose.long())
    chain = ts.chain_rows(np.array(STATES))  # batch row 2: a chain
    ts.apply_chain_fallback(torch.from_numpy(chain).to(device),
                            idx_propose.long()[torch.from_numpy(chain).to(device)], draft_tokens)
    state_tokens = torch.zeros(6, B, dtype=torch.int64, device=device)
    state_tokens[idx_propose.long()] = draft_tokens[:3]
    return g, ts, tree, state_tokens, logits


def test_store_and_chain_fallback():
    _, ts, tree, state_tokens, logits = _step(0)
    assert ts.chain_rows(np.array(STATES)).tolist() == [2]
    assert ts.chain_rows(np.array([5, 1, 5])).tolist() == [0, 2]
    assert torch.equal(state_tokens[3], tree.token_ids[0].clamp(min=0))
    assert torch.equal(ts.parents[0], tree.parents[1].clamp(min=0))
    chain = logits[2].argmax(-1)
    assert torch.equal(state_tokens[5, :D], chain)
    assert torch.equal(ts.walk_tokens[5, D:], torch.full((B - D,), -1))
    assert torch.equal(ts.parents[5], torch.arange(B))
    num_words = (B + 1 + 31) // 32
    assert torch.equal(ts._ancestor_bits[5], causal_words(torch.arange(B + 1), num_words))


def test_add_request_clears_a_slot():
    """A request that takes a state drops its predecessor's tree (a step before its
    own first tree accepts nothing: the bonus token only) and sets the state's chain
    flag; the other states keep theirs."""
    g, ts, _, _, _ = _step(2)
    before = ts.walk_tokens.clone(), ts.parents.clone()
    assert (before[0][3] >= 0).any()
    ts.add_request(3, as_chain=True)
    assert (ts.walk_tokens[3] == -1).all()
    assert torch.equal(ts.walk_tokens[[0, 5]], before[0][[0, 5]])
    assert torch.equal(ts.parents, before[1])  # only the tokens are cleared
    assert ts.chain_rows(np.array(STATES)).tolist() == [0, 2]
    ts.add_request(5, as_chain=False)
    assert (ts.walk_tokens[5] == -1).all()
    assert torch.equal(ts.walk_tokens[0], before[0][0])
    assert ts.chain_rows(np.array(STATES)).tolist() == [0]
    # the target says the old tree's tokens: state 3 accepts nothing, state 0 does
    W = B + 1
    cu = torch.arange(3, dtype=torch.int32) * W
    idx = torch.tensor([3, 0], dtype=torch.int32)
    targets = torch.randint(0, V, (2 * W,), generator=g)
    for b, state in enumerate((3, 0)):
        first = int((before[1][state] == 0).nonzero()[0])  # a child of the root
        targets[cu[b]] = before[0][state, first]
    sampled, acc = ts.walk(targets, cu, idx, 2)
    assert acc.num_accepted.tolist()[0] == 1 and int(acc.num_accepted[1]) >= 2
    assert int(sampled[0, 0]) == int(targets[0])  # the bonus token


def test_verify_step_matches_reference_walk():
    g, ts, tree, state_tokens, _ = _step(1)
    rows = StepRows(max_num_reqs=6, max_num_tokens=64, budget=B, device="cpu")
    # next step, new order: state 5 (chain, all B drafts), a prefill chunk of 4 rows
    # (state 1), state 0 (tree cut to 7 drafts), state 3 (full tree)
    order = [5, 1, 0, 3]
    n_drafts = [B, 0, 7, B]
    q_lens = [B + 1, 4, 8, B + 1]
    n_logits = [n + 1 for n in n_drafts]
    qs = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    cu = torch.tensor([0] + torch.tensor(n_logits).cumsum(0).tolist(), dtype=torch.int32)
    T, L = int(qs[-1]), int(cu[-1])
    pos = torch.cat([c + torch.arange(q) for c, q in zip([40, 0, 9, 70], q_lens)])
    idx = torch.tensor(order, dtype=torch.int32)
    seq_lens = torch.tensor([53, 4, 17, 83], dtype=torch.int32)
    ts.fill_rows(rows, qs, cu, idx, pos, seq_lens, 4, 4, T, has_trees=True)
    assert rows.has_trees
    assert rows.prefix_lens[:4].tolist() == [40, 0, 9, 70]  # seq_len - q_len
    # RoPE: tree rows at root + depth; chain rows linear; the prefill chunk untouched
    assert torch.equal(rows.positions[qs[3]:qs[4]], 70 + ts._depths[3])
    assert torch.equal(rows.positions[qs[0]:qs[1]], pos[qs[0]:qs[1]])
    assert torch.equal(rows.positions[qs[1]:qs[2]], pos[qs[1]:qs[2]])
    assert torch.equal(rows.bits[qs[1]:qs[2]], causal_words(torch.arange(4), rows.num_words))
    # the target follows the tree for a while at every request, then deviates
    targets = torch.randint(0, V, (L,), generator=g)
    for b in (0, 2, 3):
        s = order[b]
        toks = ts.walk_tokens[s].tolist()
        par = ts.parents[s].tolist()
        cur = 0
        for _ in range(3):  # pick a child of the current row and make the target say it
            kids = [j for j in range(n_drafts[b]) if par[j] == cur and toks[j] >= 0]
            if not kids:
                break
            targets[cu[b] + cur] = toks[kids[-1]]
            cur = kids[-1] + 1
    sampled, acc = ts.walk(targets, cu, idx, 4)
    for b in range(4):
        s = order[b]
        row_targets = targets[cu[b]:cu[b + 1]].tolist()
        nd = n_drafts[b]
        nodes = list(zip(ts.walk_tokens[s].tolist(), ts.parents[s].tolist(),
                         ts._depths[s, 1:].tolist()))[:nd]  # the scheduled nodes
        path, bonus = walk_tree_ref(nodes, row_targets)
        k = len(path)
        assert int(acc.num_accepted[b]) == k
        assert acc.path[b, :k].tolist() == path
        assert sampled[b, :k].tolist() == [row_targets[p] for p in path]
        assert int(sampled[b, k - 1]) == bonus
        for i in range(n_logits[b]):  # row moves: accepted row i <- path[i]
            want = cu[b] + (path[i] if i < k else i)
            assert int(acc.src_logit_row[cu[b] + i]) == int(want)
    assert int(acc.num_accepted[0]) >= 2 and int(acc.num_accepted[3]) >= 2
    ts.fill_rows(rows, qs, cu, idx, pos, seq_lens, 4, 4, T, has_trees=False)
    assert not rows.has_trees


def test_dropped_trees_accept_the_root_only():
    """``drop_trees`` (after a warm-up pass stored its dummy batch's trees): those
    states' next walk keeps the target's own token at the root only, whatever the target
    says; the other states keep their trees."""
    g, ts, _, _, _ = _step(4)
    before = ts.walk_tokens.clone()
    ts.drop_trees(torch.tensor([3], dtype=torch.int32))
    assert (ts.walk_tokens[3] == -1).all()
    assert torch.equal(ts.walk_tokens[[0, 5]], before[[0, 5]])
    W = B + 1
    cu = torch.arange(3, dtype=torch.int32) * W
    idx = torch.tensor([3, 0], dtype=torch.int32)
    targets = torch.randint(0, V, (2 * W,), generator=g)
    for b, state in enumerate((3, 0)):  # the target follows each old tree's first child
        first = int((ts.parents[state] == 0).nonzero()[0])
        targets[cu[b]] = before[state, first]
    sampled, acc = ts.walk(targets, cu, idx, 2)
    assert acc.num_accepted.tolist()[0] == 1 and int(acc.num_accepted[1]) >= 2
    assert int(sampled[0, 0]) == int(targets[0])


def test_nonfinite_draft_logits_give_bonus_only_steps():
    """A request whose draft logits hold NaN/inf gets an empty tree (and an empty chain when
    it falls back): every draft slot holds a valid token id but none can be accepted, so
    the step commits the target's bonus token; the store returns their mask."""
    ts = TreeStates(max_num_reqs=4, budget=B, max_depth=D, device="cpu")
    logits = torch.randn(3, D, V, generator=torch.Generator().manual_seed(3))
    logits[1, 2, 5] = float("nan")
    logits[2, 0, 7] = float("inf")
    tree = build_tree(logits, B)
    draft_tokens = torch.full((4, B), -7, dtype=torch.int64)
    bad = ts.store_batch(tree, logits, draft_tokens, torch.arange(3))
    # request 2 verified as a chain
    ts.apply_chain_fallback(torch.tensor([2]), torch.tensor([2]), draft_tokens)
    assert bad.tolist() == [False, True, True]
    assert (ts.walk_tokens[0] >= 0).any()  # the finite request keeps its tree
    assert (ts.walk_tokens[1:3] == -1).all()  # nothing of requests 1, 2 can be accepted
    assert (draft_tokens[:3] >= 0).all()  # but the target is fed real token ids
    idx = torch.arange(3, dtype=torch.int32)
    W = B + 1
    cu = torch.arange(4, dtype=torch.int32) * W
    targets = torch.randint(0, V, (3 * W,), generator=torch.Generator().manual_seed(4))
    sampled, acc = ts.walk(targets, cu, idx, 3)
    assert acc.num_accepted[1:].tolist() == [1, 1]  # root only
    assert sampled[1:, 0].tolist() == [int(targets[W]), int(targets[2 * W])]  # the bonus


def test_kernel_rows_follow_the_step_width():
    """Tree attention in a uniform (decode) batch covers the step's own width, rounded up
    to one the engine captures: an adaptive engine (budgets 63 / 31 / 15) verifying 16
    rows a request launches over 16, not 64; a mixed batch (never captured) over the
    widest, whose tilings start-up compiles; a fixed engine always over 1 + budget."""
    adaptive = StepRows(max_num_reqs=2, max_num_tokens=8, budget=63, device="cpu",
                        step_budgets=[63, 31, 15, 31])
    assert adaptive.verify_widths == [16, 32, 64]
    assert [adaptive.kernel_rows(n, True) for n in (1, 9, 16, 17, 32, 33, 64)] == \
        [16, 16, 16, 32, 32, 64, 64]
    assert [adaptive.kernel_rows(n, False) for n in (1, 16, 17, 32, 64)] == [64] * 5
    fixed = StepRows(max_num_reqs=2, max_num_tokens=8, budget=B, device="cpu")
    assert fixed.verify_widths == [B + 1]
    assert [fixed.kernel_rows(n, u) for n in (1, B, B + 1) for u in (True, False)] == \
        [B + 1] * 6
    assert (fixed.max_rows, fixed.num_words, adaptive.num_words) == (B + 1, 1, 2)
    assert fixed.bits.shape == (8, 1) and fixed.prefix_lens.shape == (2,)


def test_nonfinite_count_reaches_the_host_a_report_later():
    """The NaN/inf count is added on the device and read from the previous report's
    copy (no sync); warm-up passes' counts are dropped."""
    from vllm_ddtree.gpu.nonfinite_count import NonfiniteCount

    count = NonfiniteCount("cpu")
    count.add(torch.tensor([True, False, True]))
    assert count.seen == 0  # nothing copied yet
    count.report()
    count.add(torch.tensor([True]))
    assert count.seen == 2
    count.report()
    assert count.seen == 3
    count.reset()
    count.report()
    assert count.seen == 0
