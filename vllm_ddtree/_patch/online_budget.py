"""Scheduler side of ``ddtree_adaptive_budget: "online"``.

See the ``online_budget`` entry of the ledger in ``_patch/__init__.py``.
"""

from __future__ import annotations

import functools
import os

from vllm_ddtree._patch.helper import PatchSet

MODULE = "vllm.v1.core.sched.scheduler"


def attach(scheduler) -> None:
    """Give an online-DDTree scheduler its tuner; inert for every other config."""
    from vllm_ddtree.config import ddtree_params, is_online

    spec = scheduler.vllm_config.speculative_config
    lookup = getattr(scheduler, "dynamic_sd_lookup", None)
    if lookup is None or not is_online(spec):  # (vLLM drops the schedule under DP > 1)
        return
    from vllm_ddtree.adaptive.channel import StatsChannel
    from vllm_ddtree.adaptive.online import OnlineSchedule, OnlineTuner

    budget, depth = ddtree_params(spec)
    policy = OnlineSchedule(budget, depth, len(lookup) - 1)
    channel = StatsChannel(StatsChannel.name_for(os.getpid()), len(policy.budgets),
                           create=True)
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
        attach(self)

    return __init__


def apply(patches: PatchSet) -> None:
    import importlib

    cls = importlib.import_module(MODULE).Scheduler
    patches.setattr(cls, "__init__", make_init(cls.__dict__["__init__"]))
