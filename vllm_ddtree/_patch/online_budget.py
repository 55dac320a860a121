"""Scheduler side of ``ddtree_adaptive_budget: "online"``, and the one DDTree bound that
needs the scheduler's config (one request's verify rows per step).

See the ``online_budget`` entry of the ledger in ``_patch/__init__.py``.
"""

from __future__ import annotations

import functools

from vllm_ddtree._patch.helper import PatchSet

MODULE = "vllm.v1.core.sched.scheduler"
# the start of the warning of an online config whose schedule vLLM dropped (DP > 1)
ONLINE_UNDER_DP = "ddtree_adaptive_budget='online' under data parallelism"


def check_verify_fits(scheduler) -> None:
    """Refuse a DDTree budget whose ``1 + B`` verify rows never fit one step of this
    scheduler (:func:`vllm_ddtree.config.check_verify_fits`); inert for other configs."""
    from vllm_ddtree.config import check_verify_fits as check
    from vllm_ddtree.config import ddtree_params, is_ddtree

    spec = scheduler.vllm_config.speculative_config
    if not is_ddtree(spec):
        return
    budget = ddtree_params(spec).budget
    scheduler_config = scheduler.vllm_config.scheduler_config
    token_budget = getattr(scheduler, "max_num_scheduled_tokens", None)
    if token_budget is None:
        token_budget = getattr(scheduler_config, "max_num_scheduled_tokens", None)
    check(budget, spec.max_num_new_slots_for_drafting,
          scheduler_config.max_num_batched_tokens, token_budget)


def attach(scheduler) -> None:
    """Give an online-DDTree scheduler its tuner; inert for every other config.  Without
    a channel (the name is taken, ``/dev/shm`` is not writable) the scheduler keeps
    the static schedule, with a warning; without a schedule (vLLM drops it under data
    parallelism) it keeps the static budget, with a warning."""
    from vllm_ddtree.config import ddtree_params, is_online

    spec = scheduler.vllm_config.speculative_config
    if not is_online(spec):
        return
    from vllm_ddtree.adaptive.publisher import replica_index
    from vllm_ddtree.logger import init_logger

    replica = replica_index(scheduler.vllm_config.parallel_config)
    lookup = getattr(scheduler, "dynamic_sd_lookup", None)
    if lookup is None:
        # The plugin always gives an online config its schedule; vLLM drops every
        # per-batch-size schedule under data parallelism (replicas that picked different
        # draft counts could diverge in collective steps), and a dense model's replica
        # then runs as an independent engine whose config says data_parallel_size=1.
        # Nothing to re-tune: the replica runs the largest budget, and its workers see
        # the same config and publish nothing (make_publisher).
        init_logger(__name__).warning(
            "vllm-ddtree: %s (replica %d): vLLM dropped the per-batch-size schedule, so "
            "the budget stays static at num_speculative_tokens=%d and is not re-tuned.",
            ONLINE_UNDER_DP, replica, spec.num_speculative_tokens)
        return
    from vllm_ddtree.adaptive.channel import StatsChannel, channel_dir_name
    from vllm_ddtree.adaptive.online import OnlineSchedule, OnlineTuner

    params = ddtree_params(spec)
    policy = OnlineSchedule(params.budget, params.depth, len(lookup) - 1)
    name = params.online_channel
    channel, reason = None, "the config names no channel"
    if name is not None:
        try:
            channel = StatsChannel.create(channel_dir_name(name, replica), len(policy.budgets))
        except OSError as e:  # FileExistsError: something already has that name
            reason = str(e)
    if channel is None:
        init_logger(__name__).warning(
            "vllm-ddtree: ddtree_adaptive_budget='online' cannot create its statistics "
            "channel (%s); the budget schedule stays static.", reason)
        return
    tuner = OnlineTuner(policy, channel)
    scheduler.ddtree_online = tuner
    schedule, shutdown = scheduler.schedule, scheduler.shutdown

    @functools.wraps(schedule)
    def schedule_online(*args, **kwargs):
        tuner.tick(lookup)
        return schedule(*args, **kwargs)

    @functools.wraps(shutdown)
    def shutdown_online(*args, **kwargs):
        try:
            return shutdown(*args, **kwargs)
        finally:
            channel.close()

    scheduler.schedule = schedule_online
    scheduler.shutdown = shutdown_online


def make_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        check_verify_fits(self)
        attach(self)

    return __init__


def apply(patches: PatchSet) -> None:
    import importlib

    cls = importlib.import_module(MODULE).Scheduler
    patches.setattr(cls, "__init__", make_init(cls.__dict__["__init__"]))
