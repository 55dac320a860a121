"""Scheduler side of ``ddtree_adaptive_budget: "online"``, and the one DDTree bound that
needs the scheduler's config (one request's verify rows per step).

See the ``online_budget`` entry of the ledger in ``_patch/__init__.py``.
"""

from __future__ import annotations

import functools

from vllm_ddtree._patch.helper import PatchSet

MODULE = "vllm.v1.core.sched.scheduler"


def check_verify_fits(scheduler) -> None:
    """Refuse a DDTree budget whose ``1 + B`` verify rows never fit one step of this
    scheduler (:func:`vllm_ddtree.config.check_verify_fits`); inert for other configs."""
    from vllm_ddtree.config import check_verify_fits as check
    from vllm_ddtree.config import ddtree_params, is_ddtree

    spec = scheduler.vllm_config.speculative_config
    if not is_ddtree(spec):
        return
    budget, _ = ddtree_params(spec)
    scheduler_config = scheduler.vllm_config.scheduler_config
    token_budget = getattr(scheduler, "max_num_scheduled_tokens", None)
    if token_budget is None:
        token_budget = getattr(scheduler_config, "max_num_scheduled_tokens", None)
    check(budget, spec.max_num_new_slots_for_drafting,
          scheduler_config.max_num_batched_tokens, token_budget)


def attach(scheduler) -> None:
    """Give an online-DDTree scheduler its tuner; inert for every other config.  Without
    a channel (the name is taken, ``/dev/shm`` is not writable) the scheduler keeps
    the static schedule, with a warning."""
    from vllm_ddtree.config import CHANNEL_FIELD, ddtree_params, is_online

    spec = scheduler.vllm_config.speculative_config
    lookup = getattr(scheduler, "dynamic_sd_lookup", None)
    if lookup is None or not is_online(spec):  # (vLLM drops the schedule under DP > 1)
        return
    from vllm_ddtree.adaptive.channel import StatsChannel, channel_dir_name
    from vllm_ddtree.adaptive.online import OnlineSchedule, OnlineTuner
    from vllm_ddtree.logger import init_logger

    budget, depth = ddtree_params(spec)
    policy = OnlineSchedule(budget, depth, len(lookup) - 1)
    name = getattr(spec, CHANNEL_FIELD, None)
    rank = scheduler.vllm_config.parallel_config.data_parallel_rank
    channel, reason = None, f"speculative_config.{CHANNEL_FIELD} is not set"
    if name is not None:
        try:
            channel = StatsChannel.create(channel_dir_name(name, rank), len(policy.budgets))
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
