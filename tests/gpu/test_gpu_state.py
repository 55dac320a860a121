"""The V2 (GPU) path's device state on CPU: a simulated verify step through
TreeBuffers (store -> commit -> fill_rows -> walk) against the Python reference walk,
with vLLM's batch layout (requests reordered between steps, a tree cut short by the
scheduler, a prefill chunk and a chain-fallback request in the same batch)."""

import pytest
import torch

from vllm_ddtree.gpu.buffers import TreeBuffers, needs_chain
from vllm_ddtree.gpu.verify_rows import causal_words
from vllm_ddtree.tree import build_tree
from vllm_ddtree.tree.reference import walk_tree_ref

B, D, V = 12, 4, 30
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton walk runs


def _step(seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    tb = TreeBuffers(max_num_reqs=6, max_num_tokens=64, budget=B, max_depth=D, device=device)
    logits = (torch.randn(3, D, V, generator=g) * 3).to(device)
    tree = build_tree(logits, B)
    draft_tokens = torch.zeros(6, B, dtype=torch.int64, device=device)
    tb.store_batch(tree, logits, draft_tokens)
    # batch row 2: a chain
    tb.apply_chain_fallback(torch.tensor([2], device=device), draft_tokens)
    idx_propose = torch.tensor([3, 0, 5], dtype=torch.int32, device=device)  # request states
    tb.commit(idx_propose, 3)
    state_tokens = torch.zeros(6, B, dtype=torch.int64, device=device)
    state_tokens[idx_propose.long()] = draft_tokens[:3]
    return g, tb, tree, state_tokens, logits


def test_store_commit_and_chain_fallback():
    _, tb, tree, state_tokens, logits = _step(0)
    assert torch.equal(state_tokens[3], tree.token_ids[0].clamp(min=0))
    assert torch.equal(tb.parents[0], tree.parents[1].clamp(min=0))
    chain = logits[2].argmax(-1)
    assert torch.equal(state_tokens[5, :D], chain)
    assert torch.equal(tb.walk_tokens[5, D:], torch.full((B - D,), -1))
    assert torch.equal(tb.parents[5], torch.arange(B))
    assert torch.equal(tb.ancestor_bits[5], causal_words(torch.arange(B + 1), tb.num_words))


def test_verify_step_matches_reference_walk():
    g, tb, tree, state_tokens, _ = _step(1)
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
    tb.fill_rows(qs, cu, idx, pos, seq_lens, 4, 4, T)
    assert tb.prefix_lens[:4].tolist() == [40, 0, 9, 70]  # seq_len - q_len
    li = torch.cat([qs[b + 1] - n_logits[b] + torch.arange(n_logits[b]) for b in range(4)])
    # RoPE: tree rows at root + depth; chain rows linear; the prefill chunk untouched
    assert torch.equal(tb.row_positions[qs[3]:qs[4]], 70 + tb.depths[3])
    assert torch.equal(tb.row_positions[qs[0]:qs[1]], pos[qs[0]:qs[1]])
    assert torch.equal(tb.row_positions[qs[1]:qs[2]], pos[qs[1]:qs[2]])
    assert torch.equal(tb.row_bits[qs[1]:qs[2]], causal_words(torch.arange(4), tb.num_words))
    # the target follows the tree for a while at every request, then deviates
    targets = torch.randint(0, V, (L,), generator=g)
    for b in (0, 2, 3):
        s = order[b]
        toks = tb.walk_tokens[s].tolist()
        par = tb.parents[s].tolist()
        cur = 0
        for _ in range(3):  # pick a child of the current row and make the target say it
            kids = [j for j in range(n_drafts[b]) if par[j] == cur and toks[j] >= 0]
            if not kids:
                break
            targets[cu[b] + cur] = toks[kids[-1]]
            cur = kids[-1] + 1
    sampled, acc = tb.walk(targets, cu, idx, 4)
    for b in range(4):
        s = order[b]
        rows = targets[cu[b]:cu[b + 1]].tolist()
        nd = n_drafts[b]
        nodes = list(zip(tb.walk_tokens[s].tolist(), tb.parents[s].tolist(),
                         tb.depths[s, 1:].tolist()))[:nd]  # the scheduled nodes
        path, bonus = walk_tree_ref(nodes, rows)
        k = len(path)
        assert int(acc.num_accepted[b]) == k
        assert acc.path[b, :k].tolist() == path
        assert sampled[b, :k].tolist() == [rows[p] for p in path]
        assert int(sampled[b, k - 1]) == bonus
        for i in range(n_logits[b]):  # row moves: accepted row i <- path[i]
            want = cu[b] + (path[i] if i < k else i)
            assert int(acc.src_logit_row[cu[b] + i]) == int(want)
    assert int(acc.num_accepted[0]) >= 2 and int(acc.num_accepted[3]) >= 2
    assert tb.take_accepted() is acc and tb.take_accepted() is None
    del li


def test_needs_chain():
    class P:
        structured_outputs = None
        repetition_penalty = 1.0
        presence_penalty = 0.0
        frequency_penalty = 0.0
        bad_words = None

    assert needs_chain(P()) is None
    p = P()
    p.presence_penalty = 0.5
    assert "penalties" in needs_chain(p)
    p = P()
    p.bad_words = ["x"]
    assert needs_chain(p) == "bad words"
    p = P()
    p.thinking_token_budget = 0  # 0 is a budget (end thinking at once), not "unset"
    assert needs_chain(p) == "a thinking-token budget"


def test_fused_walk_kernel_matches_torch_walk():
    """The one-launch Triton walk (TRITON_INTERPRET=1 on CPU) against the torch walk, on
    a batch with a chain fallback, a cut tree, a draft-less request and deep matches."""
    import os

    import pytest

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("runs under TRITON_INTERPRET=1 (set by .ci/run) or on a GPU")
    for seed in range(3):
        g, tb, tree, _, _ = _step(seed, DEV)
        order = [5, 1, 0, 3]
        n_logits = [B + 1, 1, 8, B + 1]
        cu = torch.tensor([0] + torch.tensor(n_logits).cumsum(0).tolist(), dtype=torch.int32)
        idx = torch.tensor(order, dtype=torch.int32)
        targets = torch.randint(0, V, (int(cu[-1]),), generator=g)
        for b in (0, 2, 3):  # follow the tree as deep as it goes at each request
            s, cur = order[b], 0
            toks, par = tb.walk_tokens[s].tolist(), tb.parents[s].tolist()
            while True:
                kids = [j for j in range(n_logits[b] - 1) if par[j] == cur and toks[j] >= 0]
                if not kids:
                    break
                targets[cu[b] + cur] = toks[kids[0]]
                cur = kids[0] + 1
        targets, cu, idx = targets.to(DEV), cu.to(DEV), idx.to(DEV)
        ref_sampled, ref = tb.walk(targets, cu, idx, 4, impl="torch")
        got_sampled, got = tb.walk(targets, cu, idx, 4, impl="triton")
        assert torch.equal(got_sampled, ref_sampled)
        assert torch.equal(got.num_accepted, ref.num_accepted)
        assert torch.equal(got.path, ref.path)
        assert torch.equal(got.src_logit_row, ref.src_logit_row)
        assert int(ref.num_accepted.max()) >= 3


def test_nonfinite_draft_logits_give_bonus_only_steps():
    """A request whose draft logits hold NaN/inf gets an empty tree (and an empty chain when
    it falls back): every draft slot holds a valid token id but none can be accepted, so
    the step commits the target's bonus token; the device counter counts it."""
    tb = TreeBuffers(max_num_reqs=4, max_num_tokens=64, budget=B, max_depth=D, device="cpu")
    logits = torch.randn(3, D, V, generator=torch.Generator().manual_seed(3))
    logits[1, 2, 5] = float("nan")
    logits[2, 0, 7] = float("inf")
    tree = build_tree(logits, B)
    draft_tokens = torch.full((4, B), -7, dtype=torch.int64)
    tb.store_batch(tree, logits, draft_tokens)
    tb.apply_chain_fallback(torch.tensor([2]), draft_tokens)  # request 2 verified as a chain
    assert int(tb.num_nonfinite) == 2
    assert (tb.batch_walk_tokens[0] >= 0).any()  # the finite request keeps its tree
    assert (tb.batch_walk_tokens[1:3] == -1).all()  # nothing of requests 1, 2 can be accepted
    assert (draft_tokens[:3] >= 0).all()  # but the target is fed real token ids
    idx = torch.arange(3, dtype=torch.int32)
    tb.commit(idx, 3)
    W = B + 1
    cu = torch.arange(4, dtype=torch.int32) * W
    targets = torch.randint(0, V, (3 * W,), generator=torch.Generator().manual_seed(4))
    sampled, acc = tb.walk(targets, cu, idx, 3, impl="torch")
    assert acc.num_accepted[1:].tolist() == [1, 1]  # root only
    assert sampled[1:, 0].tolist() == [int(targets[W]), int(targets[2 * W])]  # the bonus


def test_verifier_calls_vllm_methods_by_parameter_name_once_per_function():
    pytest.importorskip("vllm")
    import vllm_ddtree.gpu.verifier as verifier

    class Sampler:
        def sample(self, logits, idx_mapping=None, pos=None):
            return logits, idx_mapping, pos

    s = Sampler()
    verifier._param_names.cache_clear()
    assert verifier._call_by_name(s.sample, logits=1, pos=3, unknown=9) == (1, None, 3)
    assert verifier._call_by_name(s.sample, logits=2, idx_mapping=5) == (2, 5, None)
    info = verifier._param_names.cache_info()
    assert (info.misses, info.hits) == (1, 1)  # the signature is read once, not per step


def test_kernel_rows_follow_the_step_width():
    """Tree attention covers the step's own width, rounded up to one the engine captures:
    an adaptive engine (budgets 63 / 31 / 15) verifying 16 rows a request launches over
    16, not 64; a fixed engine always over 1 + budget."""
    adaptive = TreeBuffers(max_num_reqs=2, max_num_tokens=8, budget=63, max_depth=D,
                           device="cpu", step_budgets=[63, 31, 15, 31])
    assert adaptive.verify_widths == [16, 32, 64]
    assert [adaptive.kernel_rows(n) for n in (1, 9, 16, 17, 32, 33, 64)] == \
        [16, 16, 16, 32, 32, 64, 64]
    fixed = TreeBuffers(max_num_reqs=2, max_num_tokens=8, budget=B, max_depth=D, device="cpu")
    assert fixed.verify_widths == [B + 1]
    assert [fixed.kernel_rows(n) for n in (1, B, B + 1)] == [B + 1] * 3
