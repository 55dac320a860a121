"""The walk of a verify batch (:mod:`vllm_ddtree.gpu.walk`): the one-launch Triton walk
(``walk_rows_triton``, TRITON_INTERPRET=1 on CPU) against the torch walk
(``walk_rows_torch``, the core's walk on this layout; its semantics are tested against
the Python reference walk in test_tree_state.py)."""


import numpy as np
import pytest
import torch

from vllm_ddtree.gpu.tree_state import TreeStates
from vllm_ddtree.gpu.walk import walk_rows_torch, walk_rows_triton
from vllm_ddtree.tree import build_tree

B, D, V = 12, 4, 30
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton walk runs


def _states(seed):
    """Request states 3, 0, 5 hold the trees of a proposing batch (state 5 verified as
    a chain), stored as the engine stores them."""
    g = torch.Generator().manual_seed(seed)
    ts = TreeStates(max_num_reqs=6, budget=B, max_depth=D, device=DEV)
    states = [3, 0, 5]
    for state in states:
        ts.add_request(state, as_chain=state == 5)
    logits = (torch.randn(3, D, V, generator=g) * 3).to(DEV)
    draft_tokens = torch.zeros(6, B, dtype=torch.int64, device=DEV)
    ts.store_batch(build_tree(logits, B), logits, draft_tokens,
                   torch.tensor(states, device=DEV))
    chain = ts.chain_rows(np.array(states))
    ts.apply_chain_fallback(torch.from_numpy(chain).to(DEV),
                            torch.tensor(states)[chain].to(DEV), draft_tokens)
    return g, ts


@pytest.mark.triton
@pytest.mark.parametrize("seed", range(3))
def test_fused_walk_kernel_matches_torch_walk(seed):
    """A batch with a chain fallback, a cut tree, a draft-less request and deep matches:
    the same sampled tokens, path, accepted counts and row moves."""
    g, ts = _states(seed)
    order = [5, 1, 0, 3]
    n_logits = [B + 1, 1, 8, B + 1]
    cu = torch.tensor([0] + torch.tensor(n_logits).cumsum(0).tolist(), dtype=torch.int32)
    idx = torch.tensor(order, dtype=torch.int32)
    targets = torch.randint(0, V, (int(cu[-1]),), generator=g)
    for b in (0, 2, 3):  # follow the tree as deep as it goes at each request
        s, cur = order[b], 0
        toks, par = ts.walk_tokens[s].tolist(), ts.parents[s].tolist()
        while True:
            kids = [j for j in range(n_logits[b] - 1) if par[j] == cur and toks[j] >= 0]
            if not kids:
                break
            targets[cu[b] + cur] = toks[kids[0]]
            cur = kids[0] + 1
    args = (targets.to(DEV), cu.to(DEV), idx.to(DEV), ts.walk_tokens, ts.parents,
            ts._depths, D, 4)
    ref_sampled, ref = walk_rows_torch(*args)
    got_sampled, got = walk_rows_triton(*args)
    assert torch.equal(got_sampled, ref_sampled)
    assert torch.equal(got.num_accepted, ref.num_accepted)
    assert torch.equal(got.path, ref.path)
    assert torch.equal(got.src_logit_row, ref.src_logit_row)
    assert int(ref.num_accepted.max()) >= 3
