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

A run's rows against a reference engine, cell by cell (host ms per step and the methods
that differ most)::

    python3 -m benchmarks.hosttime results.json [--ref dflash@inproc] [--top 12]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import time
from pathlib import Path

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


# the runner's two calls per engine step: their sum is the step's host time
STEP = ("runner.execute_model", "runner.sample_tokens")


def ms_by_method(row: dict) -> dict[str, float]:
    """``role.method -> host ms per step`` of a ``--host-timing`` row."""
    return {k: ms for k, ms, _ in row["host_ms_per_step"]}


def step_host_ms(row: dict) -> float:
    """Host ms per engine step of a ``--host-timing`` row (``execute_model`` plus
    ``sample_tokens``, which contain every other timed method of the runner)."""
    ms = ms_by_method(row)
    return sum(ms.get(k, 0.0) for k in STEP)


def differences(row: dict, ref: dict, top: int) -> list[tuple[str, float, float, float]]:
    """``(role.method, ms of row, ms of ref, difference)`` per step for the ``top``
    methods whose host time differs most between the two rows (a method only one of
    them calls counts 0 in the other)."""
    a, b = ms_by_method(row), ms_by_method(ref)
    rows = [(k, a.get(k, 0.0), b.get(k, 0.0), a.get(k, 0.0) - b.get(k, 0.0))
            for k in a.keys() | b.keys()]
    rows.sort(key=lambda r: (-abs(r[3]), r[0]))
    return rows[:top]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="host time by method against a reference "
                                 "engine, from a throughput.py --host-timing results.json")
    ap.add_argument("results")
    ap.add_argument("--ref", default="dflash@inproc", help="the engine compared with")
    ap.add_argument("--top", type=int, default=12, help="methods listed per cell")
    args = ap.parse_args(argv)
    rows = json.loads(Path(args.results).read_text())["rows"]
    cells = {(r["method"], r["temperature"], r["batch"]): r for r in rows
             if "host_ms_per_step" in r}
    for (method, temp, batch), row in sorted(cells.items()):
        ref = cells.get((args.ref, temp, batch))
        if method == args.ref or ref is None:
            continue
        ms, ref_ms = step_host_ms(row), step_host_ms(ref)
        print(f"{method} T={temp:g} batch={batch}: {ms:.3f} ms host per step, "
              f"{args.ref} {ref_ms:.3f} ({ms - ref_ms:+.3f}); tau {row['tau']:.2f} / "
              f"{ref['tau']:.2f}")
        for key, a, b, diff in differences(row, ref, args.top):
            print(f"  {key:<48} {a:8.3f} {b:8.3f} {diff:+8.3f}")


if __name__ == "__main__":
    main()
