"""Host time per engine step, by method of vLLM's model runner and its parts, without
the profiler (``throughput.py --host-timing``).

With vLLM's engine core in the benchmark's own engine process (``@inproc`` methods),
every method that vLLM or this plugin defines on the model runner, its speculator or
drafter, its model state, its samplers, the attention-metadata builders of the target
(``attn_builder``) and of the drafter (``draft_attn_builder``), each role summed over
its builders, DDTree's ``trees`` and ``step_rows`` (its speculator's device state) and
the engine core's scheduler is wrapped on the instance with a ``perf_counter_ns``
accumulator. Times are inclusive (a method's time contains the wrapped methods it calls)
and host-only: no synchronization is added, so a method that launches GPU work is
charged only for the launch, unless it waits. That is the cost that matters when a step
is host-bound, as the SmolLM2-135M pair's is. The same roles (``runner``,
``speculator``, ...) exist for DFlash and DDTree engines, so their rows compare method
by method. A wrapper adds ~0.25 µs per call (measured on this project's CPU machine), to
every engine alike.
"""

from __future__ import annotations

import functools
import inspect
import time

ROLES = ("speculator", "drafter", "model_state", "sampler", "rejection_sampler")
OWN_MODULES = ("vllm.", "vllm_ddtree.")


def model_runner(llm):
    """The model runner of an ``LLM`` whose engine core is in-process (else ValueError)."""
    client = llm.llm_engine.engine_core
    if type(client).__name__ != "InprocClient":
        raise ValueError("--host-timing needs the engine core in-process: add @inproc to "
                         f"every method (this engine's core client is {type(client).__name__})")
    return client.engine_core.model_executor.driver_worker.worker.model_runner


class HostTimer:
    """Wraps the methods of ``objs`` (role -> object, or a list of objects that share
    the role's counters) defined in ``modules`` on their instances; ``acc`` maps
    ``role.method`` to ``[ns, calls]`` since the last :meth:`reset`."""

    def __init__(self, objs: dict, modules: tuple = OWN_MODULES):
        self.acc: dict[str, list[int]] = {}
        for role, obj_or_list in objs.items():
            for obj in (obj_or_list if isinstance(obj_or_list, list) else [obj_or_list]):
                self._wrap_methods(role, obj, modules)

    def _wrap_methods(self, role: str, obj, modules: tuple) -> None:
        for name in dir(type(obj)):
            if name.startswith("__"):
                continue
            raw = inspect.getattr_static(type(obj), name, None)
            if not (inspect.isfunction(raw)
                    and getattr(raw, "__module__", "").startswith(modules)):
                continue  # properties, static/class methods, torch's nn.Module methods
            setattr(obj, name, self._wrap(f"{role}.{name}", getattr(obj, name)))

    def _wrap(self, label: str, bound):
        slot = self.acc.setdefault(label, [0, 0])

        @functools.wraps(bound)
        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return bound(*args, **kwargs)
            finally:
                slot[0] += time.perf_counter_ns() - t0
                slot[1] += 1

        return timed

    def reset(self) -> None:
        for slot in self.acc.values():
            slot[0] = slot[1] = 0

    def snapshot(self) -> dict[str, tuple[int, int]]:
        return {k: (ns, n) for k, (ns, n) in self.acc.items() if n}


def attention_builders(owner) -> list:
    """The distinct attention-metadata builders of ``owner``'s attention groups
    (``attn_groups``: per KV-cache group, a list of groups), [] where it has none."""
    builders: dict[int, object] = {}
    for groups in getattr(owner, "attn_groups", None) or []:
        for group in groups:
            for builder in getattr(group, "metadata_builders", None) or []:
                builders[id(builder)] = builder
    return list(builders.values())


def timer_for(llm) -> HostTimer:
    runner = model_runner(llm)
    objs: dict = {"runner": runner}
    for role in ROLES:
        part = getattr(runner, role, None)
        if part is not None and part is not runner:
            objs[role] = part
    # DDTree's device state (fill_rows, walk, ...), shared by its runner's parts
    for role in ("trees", "step_rows"):
        state = getattr(getattr(runner, "speculator", None), role, None)
        if state is not None:
            objs[role] = state
    for role, owner in (("attn_builder", runner),
                        ("draft_attn_builder", getattr(runner, "speculator", None))):
        if builders := attention_builders(owner):
            objs[role] = builders
    objs["scheduler"] = llm.llm_engine.engine_core.engine_core.scheduler
    return HostTimer(objs)


def per_step(snaps: list[dict], steps: int,
             top: int | None = None) -> list[tuple[str, float, float]]:
    """``(role.method, ms per step, calls per step)`` over the runs' snapshots, largest
    first: the ``top`` largest, or all."""
    total: dict[str, list[int]] = {}
    for snap in snaps:
        for k, (ns, n) in snap.items():
            t = total.setdefault(k, [0, 0])
            t[0] += ns
            t[1] += n
    steps = max(steps, 1)
    rows = [(k, ns / 1e6 / steps, n / steps) for k, (ns, n) in total.items()]
    rows.sort(key=lambda r: r[1], reverse=True)
    return [(k, round(ms, 4), round(c, 2)) for k, ms, c in rows[:top]]
