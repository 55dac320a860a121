"""Adaptive tree budget (``ddtree_adaptive_budget``): the cost-model schedule, its config
plumbing into vLLM's dynamic speculative decoding, and an engine run on CPU showing the
budget follows the batch size (on the tree-beats-chain fixture only a tree with > 15
nodes accepts anything) with output identical to no speculation."""

from __future__ import annotations

import gc

import pytest

from vllm_ddtree.adaptive.schedule import (
    STEP_COST,
    best_budget,
    budget_schedule,
    candidates,
    drafter_budgets,
    step_cost,
    tau,
)
from vllm_ddtree.testing.metrics import spec_counts


def test_schedule_shape():
    s = budget_schedule(256, 15)
    assert s[0][0] == 1 and all(a[1] + 1 == b[0] for a, b in zip(s, s[1:]))
    budgets = [b for _, _, b in s]
    assert budgets == sorted(budgets, reverse=True)  # never grows with the batch
    assert budgets[0] == 63  # batch 1 on the measured H200 8B-shape step costs
    assert budgets[-1] == 15  # large batches: the chain's width, a D-node tree
    assert budget_schedule(15, 15) == [(1, 1 << 20, 15)]
    assert max(b for _, _, b in budget_schedule(40, 15)) <= 40


def test_model_pieces():
    # whole 16-row attention blocks: 2**k - 1 nodes and the largest 16 m - 1
    assert candidates(256, 15) == [15, 31, 63, 127, 255]
    assert candidates(100, 15) == [15, 31, 63, 95]
    assert candidates(32, 15) == [15, 31]
    assert candidates(12, 7) == [7, 12] and candidates(15, 15) == [15]
    # measured widths as measured; wider trees grow as the target's verify does
    assert step_cost(2, 32) == pytest.approx(STEP_COST[2][32])
    assert step_cost(1, 128) == pytest.approx(STEP_COST[1][64] * 1.35 / 1.27)
    assert step_cost(16, 65) > step_cost(1, 65) > step_cost(1, 16)
    assert step_cost(1, 8) == step_cost(1, 16)  # narrower than measured: clamped
    assert tau(512, 15) > tau(64, 15) > tau(15, 15)
    # never below the chain's width when the batch is large
    assert best_budget(512, 256, 15) == 15


def test_schedule_takes_the_measured_fastest_budget():
    """At every measured batch size the model's pick is the budget with the most
    modelled tokens per measured step time (no interpolation in between)."""
    for batch, cost in STEP_COST.items():
        fastest = max((15, 31, 63), key=lambda b: tau(b, 15) / cost[1 + b])
        assert best_budget(batch, 63, 15) == fastest, batch
    assert [b for _, _, b in budget_schedule(63, 15)] == [63, 31, 15]


@pytest.mark.parametrize("sizes", [[1, 2, 4, 8, 16, 24, 32], [2, 8], [3], []])
@pytest.mark.parametrize("step", [
    [0, 63, 31, 31] + [15] * 37,  # the adaptive schedule (never grows with the batch)
    [0, 7, 7, 15, 15, 3, 3, 3, 31] + [15] * 32,  # a user's schedule that grows and falls
])
def test_drafter_budgets_cover_every_step_of_their_graph(sizes, step):
    """A drafter pass replays the graph of the smallest size holding its requests: the
    tree captured in it has at least every budget a step it serves verifies, and no more
    than the largest of them; passes beyond the largest graph build their own step's
    budget, or the largest graph's where that is more (a width compiled at capture)."""
    out = drafter_budgets(step, sizes)
    assert len(out) == len(step) and out[0] == 0
    for n in range(1, len(step)):
        graph = min((s for s in sizes if s >= n), default=None)
        if graph is None:  # eager
            assert out[n] == (max(step[n], out[max(sizes)]) if sizes else step[n])
            continue
        served = [m for m in range(1, graph + 1)
                  if min(s for s in sizes if s >= m) == graph]
        assert out[n] == out[graph] == max(step[m] for m in served)
    if sizes == [1, 2, 4, 8, 16, 24, 32] and step[3] == 31:
        assert out[1:10] == [63, 31, 31, 31, 15, 15, 15, 15, 15]  # batch 3 pads to 4


def test_config_sets_vllm_schedule(root):
    vllm = pytest.importorskip("vllm")  # noqa: F841
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.config.speculative import SpeculativeConfig

    import vllm_ddtree
    from vllm_ddtree.config import DDTreeConfigError
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    vllm_ddtree.register()
    t, d = make_tiny_pair(root, "random", "float32")
    kw = dict(model=str(d), target_model_config=ModelConfig(model=str(t), dtype="float32"),
              target_parallel_config=ParallelConfig())
    s = SpeculativeConfig(method="ddtree", num_speculative_tokens=64,
                          ddtree_adaptive_budget=True, **kw)
    assert s.num_speculative_tokens == 64
    assert s.num_speculative_tokens_per_batch_size == budget_schedule(64, 15)
    plain = SpeculativeConfig(method="ddtree", num_speculative_tokens=64, **kw)
    assert plain.num_speculative_tokens_per_batch_size is None
    with pytest.raises(Exception, match="both set"):
        SpeculativeConfig(method="ddtree", num_speculative_tokens=64, ddtree_adaptive_budget=True,
                          num_speculative_tokens_per_batch_size=[(1, 8, 4)], **kw)
    with pytest.raises(Exception, match="only applies to method='ddtree'"):
        SpeculativeConfig(method="dflash", num_speculative_tokens=15,
                          ddtree_adaptive_budget=True, **kw)
    assert issubclass(DDTreeConfigError, ValueError)


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_budget_follows_batch(root):
    pytest.importorskip("vllm")
    from vllm import LLM, SamplingParams

    from vllm_ddtree.testing.fixtures import make_tiny_pair

    t, d = make_tiny_pair(root, "tree_beats_chain", "float32")
    prompts = ["hello world", "the quick brown fox", "def f(x):", "a", "12345", "zz",
               "import os", "Once upon a time"]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def engine(spec):
        return LLM(model=str(t), dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
                   max_num_seqs=8, gpu_memory_utilization=0.2, disable_log_stats=False,
                   speculative_config=spec)

    def counts(llm):
        c = spec_counts(llm, strict=True)
        return c.drafts, c.accepted

    ref_llm = engine(None)
    ref = [[o.outputs[0].token_ids for o in ref_llm.generate(prompts[:n], sp, use_tqdm=False)]
           for n in (1, 8)]
    del ref_llm
    gc.collect()
    llm = engine({"method": "ddtree", "model": str(d), "num_speculative_tokens": 64,
                  "ddtree_adaptive_budget": True})
    taus = []
    for i, n in enumerate((1, 8)):
        d0, a0 = counts(llm)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts[:n], sp, use_tqdm=False)]
        d1, a1 = counts(llm)
        assert out == ref[i]
        taus.append(1 + (a1 - a0) / (d1 - d0))
    del llm
    gc.collect()
    # batch 1 -> budget 63: the tree holds the target's path (tau 2); batch 8 -> budget 15:
    # a 15-node tree here is the drafter's wrong chain (tau 1)
    assert taus[0] == pytest.approx(2.0, abs=0.1)
    assert taus[1] < 1.3
