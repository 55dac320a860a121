"""No device-to-host sync in the plugin's per-step GPU work: one simulated step of every
piece the speculator, the model state and the verifier launch (tree build, tree store at
the request states, chain fallback from host flags, verify rows, walk, T > 0 choice and
stop draw, KV and hidden-row compaction, the NaN/inf count's copy to pinned memory), run
under ``torch.cuda.set_sync_debug_mode("error")``, where any synchronizing call raises.
The first pass compiles the Triton kernels; the second is the one checked.  The
conditioned (DSpark) tree build's check, which needs no vLLM:
``test_conditioned_no_sync.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_ddtree.gpu.compaction import KVCompactor
from vllm_ddtree.gpu.nonfinite_count import NonfiniteCount
from vllm_ddtree.gpu.step_rows import StepRows
from vllm_ddtree.gpu.tree_state import TreeStates
from vllm_ddtree.gpu.verify_sampling import choose_children, draw_stop_tokens
from vllm_ddtree.tree import build_tree

pytestmark = pytest.mark.gpu

S, B, D, V = 8, 15, 6, 4096  # request states, budget, depth, vocabulary
R = 4  # requests in the step
W = B + 1


def _inputs(seed: int) -> dict:
    """What vLLM and the models hand the pieces in one step (made before the check)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    n = R * W
    idx_np = np.array([3, 0, 5, 1], dtype=np.int32)
    idx_mapping = torch.from_numpy(idx_np).to(dev)
    return dict(
        g=g, n=n, idx_np=idx_np, idx_mapping=idx_mapping,
        draft_logits=torch.randn(R, D, V, device=dev, generator=g) * 4,
        draft_tokens=torch.zeros(S, B, dtype=torch.int64, device=dev),
        query_start=torch.arange(R + 1, dtype=torch.int32, device=dev) * W,
        positions=torch.arange(n, device=dev) + 100,
        seq_lens=torch.full((R,), 100 + W, dtype=torch.int32, device=dev),
        target_logits=torch.randn(n, V, device=dev, generator=g),
        expanded=idx_mapping.repeat_interleave(W),
        local=torch.arange(W, dtype=torch.int32, device=dev).repeat(R),
        temperature=torch.ones(S, device=dev),
        seeds=torch.arange(S, dtype=torch.int64, device=dev),
        logits_indices=torch.arange(n, device=dev),
        slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
        hidden=torch.randn(n, 64, device=dev, generator=g),
        hidden2=torch.randn(n, 64, device=dev, generator=g))


def _step(trees: TreeStates, rows: StepRows, compactor: KVCompactor,
          nonfinite: NonfiniteCount, x: dict) -> None:
    dev = torch.device("cuda")
    n, cu, idx = x["n"], x["query_start"], x["idx_mapping"]
    # drafter pass: the trees, stored at their states; a chain fallback from host flags
    tree = build_tree(x["draft_logits"], B)
    nonfinite.add(trees.store_batch(tree, x["draft_logits"], x["draft_tokens"],
                                    idx.long()))
    chain = trees.chain_rows(x["idx_np"])  # host flags only
    assert chain.tolist() == [2]
    # as the speculator copies it: pinned memory, non_blocking
    rows_states = torch.from_numpy(np.stack([chain, x["idx_np"][chain].astype(np.int64)]))
    rows_states = rows_states.pin_memory().to(dev, non_blocking=True)
    trees.apply_chain_fallback(rows_states[0], rows_states[1], x["draft_tokens"])
    nonfinite.report()  # the host reads the last copy, the next one starts

    # target step: verify rows, W per request
    trees.fill_rows(rows, cu, cu, idx, x["positions"], x["seq_lens"], R, R, n,
                    has_trees=True)
    logits = x["target_logits"]
    # greedy: the target's argmax, the walk
    trees.walk(logits.argmax(dim=-1), cu, idx, R)
    # T > 0: the choice rule, the walk, the stop draws
    choices = choose_children(logits, x["expanded"], x["local"], rows.positions[:n],
                              x["temperature"], x["seeds"], trees.walk_tokens, trees.parents)
    sampled, accepted = trees.walk(choices, cu, idx, R)
    draw_stop_tokens(logits, choices, sampled, accepted.path, accepted.num_accepted, cu, idx,
                     rows.positions[:n], trees.walk_tokens, trees.parents, x["seeds"])

    # next drafter pass: KV compaction, the hidden rows of the accepted path first
    compactor(x["slot_mapping"], x["logits_indices"], cu, accepted.path,
              accepted.num_accepted, R, [x["hidden"], x["hidden2"]])


def test_a_step_has_no_device_to_host_sync():
    dev = torch.device("cuda")
    trees = TreeStates(S, B, D, dev)
    for state in range(S):
        trees.add_request(state, as_chain=state == 5)
    rows = StepRows(S, 4 * R * W, B, dev)
    caches = [torch.zeros(64, 16, 2, 128, dtype=torch.bfloat16, device=dev)
              for _ in range(3)]
    compactor = KVCompactor(caches)
    nonfinite = NonfiniteCount(dev)
    _step(trees, rows, compactor, nonfinite, _inputs(0))  # compiles the kernels
    x = _inputs(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(trees, rows, compactor, nonfinite, x)
        # the mode catches a sync: the check can fail
        with pytest.raises(RuntimeError, match="synchroniz"):
            int(trees.walk_tokens[0, 0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert nonfinite.seen == 0
