"""Worker side of ``ddtree_adaptive_budget: "online"`` (policy: :mod:`vllm_ddtree.adaptive.online`).

Per step, each request's expected accepted draft tokens for every candidate budget ``n``
(``E_n``: the sum of its best ``n`` nodes' path probabilities under the drafter; the tree
is best-first, so those are its first ``n`` nodes) is written by :meth:`store`, inside
vLLM's CUDA graph on the GPU.  :meth:`publish`, once per step outside the graph, sums
the batch's rows into pinned memory with an asynchronous copy and folds the previous
step's copy into the shared-memory channel once its event has completed: no
device-to-host sync.  Only tensor-parallel rank 0 publishes (every rank builds the same
trees).  Imports vLLM lazily (:func:`make_publisher`, the refusal warning).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_ddtree.adaptive.channel import (
    ChannelAddress,
    ChannelRefused,
    StatsChannel,
    channel_dir_name,
)
from vllm_ddtree.adaptive.schedule import candidates

ATTACH_TRIES = 64  # steps to wait for the scheduler's channel before giving up


def _warn(message: str, *args: Any) -> None:
    from vllm_ddtree.logger import init_logger

    init_logger(__name__).warning(message, *args)


class ExpectationPublisher:
    """``address``: the scheduler's channel, None to publish nothing."""

    def __init__(self, max_budget: int, depth: int, max_reqs: int,
                 device: torch.device | str, address: ChannelAddress | None):
        self.budgets = candidates(max_budget, depth)
        device = torch.device(device)
        self.idx = torch.tensor([b - 1 for b in self.budgets], device=device)
        self.rows = torch.zeros(max_reqs, len(self.budgets), dtype=torch.float32,
                                device=device)
        cuda = device.type == "cuda"
        self.host = torch.zeros(len(self.budgets), dtype=torch.float32, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.address = address
        self.channel: StatsChannel | None = None
        self._pending = 0
        self._tries = 0

    def store(self, scores: torch.Tensor) -> None:
        """``scores``: ``[R, >= max budget]`` node log-probabilities, best-first (rows of
        :class:`~vllm_ddtree.tree.DraftTree`).  Graph-capturable."""
        n = scores.shape[0]
        self.rows[:n].copy_(scores.exp().cumsum(dim=1).index_select(1, self.idx))

    def publish(self, num_reqs: int) -> None:
        if self.address is None:
            return
        if self._pending and (self.event is None or self.event.query()):
            channel = self._attach()
            if channel is not None:
                channel.add(self._pending, self.host.tolist())
            self._pending = 0
        if not self._pending and num_reqs > 0:
            self.host.copy_(self.rows[:num_reqs].sum(dim=0), non_blocking=True)
            if self.event is not None:
                self.event.record()
            self._pending = num_reqs

    def _attach(self) -> StatsChannel | None:
        if self.channel is None and self.address is not None:
            try:
                self.channel = StatsChannel.attach(self.address, len(self.budgets))
            except FileNotFoundError:
                self._tries += 1
                if self._tries == ATTACH_TRIES:
                    self.address = None  # no scheduler side: stop publishing
            except ChannelRefused as refusal:
                _warn("vllm-ddtree: ddtree_adaptive_budget='online': refusing the "
                      "statistics channel (%s); the budget schedule stays static.", refusal)
                self.address = None
        return self.channel

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


def replica_index(parallel_config: Any) -> int:
    """The data-parallel replica an engine core (and its workers) serves, for its channel
    name.  vLLM 0.32 runs each replica of a dense model as an independent engine: its
    config then says ``data_parallel_rank=0`` on every replica and keeps the replica in
    ``data_parallel_index`` (older vLLMs: only ``data_parallel_rank``)."""
    index = getattr(parallel_config, "data_parallel_index", None)
    return parallel_config.data_parallel_rank if index is None else index


def make_publisher(vllm_config: Any, device: torch.device | str,
                   max_reqs: int) -> ExpectationPublisher | None:
    """The worker's :class:`~vllm_ddtree.adaptive.publisher.ExpectationPublisher` for
    ``ddtree_adaptive_budget: "online"`` (else None).  Publishes on tensor-parallel rank 0
    only, to the scheduler's process: this process with vLLM's in-process executor
    (``uni``), the parent with its multiprocess one (``mp``); other executors (Ray) get
    the static schedule, with a warning.  The channel is the one named by the config's
    ``online_channel`` (:class:`~vllm_ddtree.config.DDTreeParams`) for this data-parallel
    replica, and it must have been
    created by that scheduler process (:meth:`StatsChannel.attach`).  None as well where
    vLLM dropped the per-batch-size schedule (data parallelism; the scheduler says so)."""
    from vllm_ddtree.config import ddtree_params, is_online

    spec = vllm_config.speculative_config
    if not is_online(spec) or not spec.num_speculative_tokens_per_batch_size:
        return None  # (no schedule to tune: vLLM drops it under data parallelism)
    import os

    from vllm.distributed import get_tensor_model_parallel_rank

    parallel = vllm_config.parallel_config
    backend = parallel.distributed_executor_backend
    pid = {"uni": os.getpid(), "mp": os.getppid()}.get(backend) \
        if isinstance(backend, str) else None
    params = ddtree_params(spec)
    name = params.online_channel
    address = None
    if get_tensor_model_parallel_rank() != 0:
        pass  # every rank builds the same trees: rank 0 speaks for all
    elif pid is None:
        _warn("vllm-ddtree: ddtree_adaptive_budget='online' needs vLLM's 'uni' or 'mp' "
              "executor (got %r): the budget schedule stays static.", backend)
    elif name is not None:  # (without one the scheduler has no channel either, and says so)
        address = ChannelAddress(channel_dir_name(name, replica_index(parallel)), pid)
    return ExpectationPublisher(params.budget, params.depth, max_reqs, device, address)
