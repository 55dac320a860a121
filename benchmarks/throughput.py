"""Autoregressive vs vLLM's DFlash chain vs DDTree, side by side on one device.

    python3 -m benchmarks.throughput --target T --drafter D --out DIR \
        [--budgets 16,32,64] [--batches 1,2,4,8,16,32,64] [--temps 0,1] [--max-tokens 128]
        [--repeats 3] [--profile [--trace]]
    python3 -m benchmarks.throughput --fixture tree_beats_chain --cpu --out DIR   # CPU smoke
    python3 -m benchmarks.throughput --target T --drafter D --dspark-drafter S --out DIR \
        --methods dflash,ddtree-15,dspark,dspark-ddtree-15      # both drafter families (GPU)

One engine per method (same target, same drafter, same prompts, same device), each in its
own child process.  By default every engine is started (one at a time) and the cells are
interleaved: for each batch size and temperature, every engine runs once per repeat, in
alternating order, so that drift of the machine (the same DFlash cell has measured 3.1
and 4.7 ms per step in two calls ten minutes apart) falls on all methods alike;
``--gpu-mem`` is then shared by the engines.  ``--sequential`` runs one engine after
another instead (the whole ``--gpu-mem`` each).  For every batch size and temperature it
reports, over all repeats of the cell, the acceptance length tau (tokens per verify
step), the mean step time, output tokens/s per request and in total, and the ratios to
DFlash and to autoregressive (``vs DFlash``: of those totals; ``paired``: the median over
repeats of the ratio within one repeat, interleaved runs only).  Each repeat takes the
next ``batch`` prompts, the same for every engine (so batch 1 is not one prompt), and
prefix caching is off (a repeat's prompts are not cached by an earlier one).  Shows a
progress bar, prints a table last and writes ``results.json`` plus ``throughput.png``.

Step counts come from vLLM's own spec-decode counters (one draft per request per step);
autoregressive steps = output tokens / batch.  Timings are wall-clock around
``LLM.generate`` (prefill included; use --max-tokens large against the prompt length).
``req/it``: requests advanced per engine step (vLLM's iteration count, prefill steps
included); well below the batch size, the scheduler did not fit every request's rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

from benchmarks.pooled import INPROC, reference

# method suffix: the engine runs the package copy in --base-src
BASE = "@base"


def has_suffix(name: str, suffix: str) -> bool:
    """Whether method ``name`` carries ``suffix``; suffixes combine in any order
    (``ddtree-15@base@inproc``)."""
    return suffix.lstrip("@") in name.split("@")[1:]


def check_base_modules(name: str, base_src: Path) -> None:
    """Every loaded ``vllm_ddtree`` module of an ``@base`` engine comes from
    ``base_src`` (RuntimeError naming the others): a before/after run must not time the
    installed package under the base's name."""
    base = Path(base_src).resolve()
    others = sorted(k for k, m in list(sys.modules.items())
                    if (k == "vllm_ddtree" or k.startswith("vllm_ddtree."))
                    and getattr(m, "__file__", None)
                    and not Path(m.__file__).resolve().is_relative_to(base))
    if others:
        raise RuntimeError(f"{name}: modules {others[:5]} not from the copy in "
                           f"--base-src {base_src}")

DEFAULT_PROMPTS = [
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "for i in range(10):\n    print(",
    "The capital of France is",
    "def fibonacci(n):\n",
]


def load_prompts(path: str | None, limit: int = 0) -> list:
    """Text prompts, or token-id prompts from a ``.json`` file: a list of token-id lists,
    or a drafter's ``training_log.json`` (its held-out evaluation prompts, never trained
    on)."""
    if not path:
        return DEFAULT_PROMPTS
    text = Path(path).read_text()
    if path.endswith(".json"):
        data = json.loads(text)
        ids = data if isinstance(data, list) else data["heldout_eval_prompts"]
        return [{"prompt_token_ids": p} for p in ids[:limit or None]]
    if path.endswith(".jsonl"):
        return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    return [p for p in text.split("\n\n\n") if p.strip()]


class Run(NamedTuple):
    wall: float  # s
    tokens: int  # output tokens
    drafts: int  # request verify steps (0 without speculation)
    accepted: int  # accepted draft tokens
    iterations: int  # engine steps (vLLM's iteration_tokens histogram, prefill included)
    gaps: tuple = ()  # s from the start, then between successive engine outputs received
    host: dict | None = None  # --host-timing: role.method -> (ns, calls) during the run


# A gap between two engine outputs longer than STALL_FACTOR x the run's median gap (and
# than STALL_MIN_S) is a stall: the "trimmed" wall time counts it as that cap.  Each cell
# reports its stalls, so a method that stalls more than DFlash is visible rather than
# trimmed away unseen.  (On the H200 stalls were rare and moved no ratio by
# more than 0.02: the A/A floor comes from the median gap's per-run level instead.)
STALL_FACTOR = 5.0
STALL_MIN_S = 0.02


def trim_stalls(gaps) -> tuple[float, int]:
    """``(seconds above the cap, number of stalls)`` of one run's output gaps; the first
    gap (prefill) is never a stall."""
    rest = list(gaps[1:])
    if not rest:
        return 0.0, 0
    cap = max(STALL_FACTOR * statistics.median(rest), STALL_MIN_S)
    over = [g - cap for g in rest if g > cap]
    return sum(over), len(over)


def mark_outputs(llm) -> list:
    """Record when each engine output reaches ``llm`` (``LLM.generate`` pulls one per
    ``llm_engine.step()``): the returned list gets a ``perf_counter`` per output."""
    marks, step = [], llm.llm_engine.step

    def timed_step():
        out = step()
        marks.append(time.perf_counter())
        return out

    llm.llm_engine.step = timed_step
    return marks


def timed_generate(llm, batch, sp, within=None, marks=None, timer=None) -> Run:
    """One timed ``generate`` and what vLLM's counters saw during it (all zero drafts
    without speculation).  ``within``: a context manager around the ``generate`` call
    only (the profiler: vLLM's metrics are read outside it); ``marks``: the list of
    :func:`mark_outputs`, for the run's output gaps; ``timer``: a
    :class:`hosttime.HostTimer`, for the run's host time by method."""
    from vllm_ddtree.testing.metrics import engine_steps, spec_counts

    c0, i0 = spec_counts(llm), engine_steps(llm)
    if marks is not None:
        marks.clear()
    if timer is not None:
        timer.reset()
    with within or contextlib.nullcontext():
        t0 = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    c = spec_counts(llm) - c0
    gaps = tuple(b - a for a, b in zip([t0, *marks], marks)) if marks else ()
    return Run(wall, toks, c.drafts, c.accepted, engine_steps(llm) - i0, gaps,
               timer.snapshot() if timer is not None else None)


def make_engine(args, spec, width):
    from vllm import LLM

    kw = dict(model=str(args.target), dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
              max_num_seqs=max(args.batches), gpu_memory_utilization=args.gpu_mem,
              disable_log_stats=False, enforce_eager=args.eager, speculative_config=spec,
              tensor_parallel_size=args.tp, enable_prefix_caching=False)
    if args.jit_verbose:  # vLLM logs every Triton compilation after its warm-up
        kw["jit_monitor_verbose"] = True
    if not args.eager:
        kw["compilation_config"] = {"max_cudagraph_capture_size":
                                    min(graph_tokens(spec, width, max(args.batches)),
                                        args.max_num_batched_tokens)}
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    return LLM(**kw)


def graph_tokens(spec: dict | None, width: int, max_batch: int) -> int:
    """Tokens of the widest verify step up to ``max_batch`` requests: ``max_batch``
    requests of ``width`` rows, or under ``ddtree_adaptive_budget: true`` the widest
    step of its schedule (63 nodes at batch 1, 15 from batch 4 up: the engine captures
    the same graphs as a fixed engine of the width it picks, not 64 rows at every
    batch size)."""
    if not spec or spec.get("ddtree_adaptive_budget") is not True:
        return max_batch * width
    from vllm_ddtree.adaptive.schedule import budget_schedule
    from vllm_ddtree.drafter import load_drafter_config

    # a DFlash drafter's depth (ddtree-auto runs the --drafter), as the plugin resolves it
    cfg = load_drafter_config(spec["model"]) or {}
    block = cfg.get("block_size") or (cfg.get("dflash_config") or {}).get("block_size", 16)
    budget = spec["num_speculative_tokens"]
    depth = min(block - 1, budget, spec.get("ddtree_max_depth") or budget)
    return max(min(hi, max_batch) * (1 + b)
               for lo, hi, b in budget_schedule(budget, depth) if lo <= max_batch)


def _cell(prompts, n: int, rep: int = 0) -> list:
    """The ``n`` prompts of repeat ``rep``: each repeat takes the next ``n`` (so a batch-1
    cell's tau is not one prompt's), and every engine gets the same ones per repeat."""
    return [prompts[(rep * n + i) % len(prompts)] for i in range(n)]


def cpu_sets(cpus, n: int) -> list:
    """``cpus`` split into ``n`` contiguous, disjoint, near-equal sets (one per engine),
    or ``n`` times ``None`` (no pinning) when there are fewer than two CPUs per engine."""
    cpus = sorted(cpus)
    if n < 1 or len(cpus) < 2 * n:
        return [None] * n
    q, r = divmod(len(cpus), n)
    sizes = [q + (i < r) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    return [cpus[a:a + m] for a, m in zip(starts, sizes)]


def pin_process_tree(cpus: list[int]) -> None:
    """Every thread of this process and of the processes it started onto ``cpus``
    (``sched_setaffinity`` moves one thread; threads started later inherit it).  Reads
    Linux's ``/proc``; a thread or process that ended meanwhile is skipped."""
    pids = [os.getpid()]
    for pid in pids:  # grows with each process's children
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cpus)
                    with open(f"/proc/{pid}/task/{tid}/children") as f:
                        pids += [int(c) for c in f.read().split()]


def rotated(sets: list, rep: int) -> list:
    """The CPU sets of repeat ``rep``: engine ``i`` takes set ``(i + rep) mod n``, so over
    ``n`` repeats every engine runs once on every set (CPUs of one machine can differ in
    speed: the sets are not assumed equal)."""
    n = len(sets)
    return [sets[(i + rep) % n] for i in range(n)]


def engine_worker(args, name, spec, width, prompts, conn, cpus=None) -> None:
    """Child process: one engine, driven by the parent through ``conn``.  Commands
    ``(what, temperature, batch, repeat)``, what = "warm" (two short generates, timed:
    a first call at a new shape may JIT-compile kernels -> their wall times), "run" (a
    timed generate -> :class:`Run`), "profile" (-> :func:`profile_generate`'s dict);
    ``None`` stops; ``("pin", cpus)`` moves the engine's processes to ``cpus``.  Every
    reply is ``(ok, value)``; a failure replies ``(False, traceback)``.  ``cpus``: the
    CPUs this engine's processes start on (``--pin-cpus``)."""
    import traceback

    try:
        base = has_suffix(name, BASE)
        if base:  # the copy in --base-src before the installed package
            base_src = str(Path(args.base_src).resolve())
            sys.path.insert(0, base_src)
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [base_src] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        if cpus:  # this process and every process it starts (the engine core) stay there
            os.sched_setaffinity(0, cpus)
        if args.profile or has_suffix(name, INPROC):  # the profiler sees only this process
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import SamplingParams

        from vllm_ddtree.testing.engines import shutdown

        llm = make_engine(args, spec, width)
        if base:
            check_base_modules(name, args.base_src)
        marks = mark_outputs(llm)
        if args.host_timing:
            from benchmarks.hosttime import timer_for

            timer = timer_for(llm)
        else:
            timer = None
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        import vllm_ddtree

        # ready: the core client and the package this engine runs
        conn.send((True, (type(llm.llm_engine.engine_core).__name__,
                          str(Path(vllm_ddtree.__file__).resolve().parent))))
        while (cmd := conn.recv()) is not None:
            if cmd[0] == "pin":
                pin_process_tree(cmd[1])
                conn.send((True, None))
                continue
            what, temp, n, rep = cmd
            batch = _cell(prompts, n, rep)
            if what == "warm":
                sp = SamplingParams(temperature=temp, max_tokens=16, ignore_eos=True)
                walls = []
                for _ in range(2):
                    t0 = time.perf_counter()
                    llm.generate(batch, sp, use_tqdm=False)
                    walls.append(time.perf_counter() - t0)
                conn.send((True, walls))
                continue
            sp = SamplingParams(temperature=temp, max_tokens=args.max_tokens, ignore_eos=True)
            if what == "run":
                conn.send((True, timed_generate(llm, batch, sp, marks=marks, timer=timer)))
            else:
                trace = (args.out / f"trace-{name}-T{temp:g}-b{n}.json") if args.trace else None
                conn.send((True, profile_generate(llm, batch, sp, spec, trace=trace)))
        shutdown(llm)  # here: left to interpreter exit, the engine hung on CPU
        conn.send((True, "stopped"))
    except Exception:
        conn.send((False, traceback.format_exc()))
    finally:
        conn.close()


class Engine:
    """A method's engine in a child process (its own vLLM metrics registry: vLLM
    re-registers its Prometheus metrics per engine, so two engines in one process would
    read each other's counters)."""

    def __init__(self, args, name, spec, width, prompts, cpus=None):
        import multiprocessing as mp

        self.name, self.spec = name, spec
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_worker, daemon=False,
                                args=(args, name, spec, width, prompts, child, cpus))
        self.proc.start()
        child.close()
        try:
            # ready (started one at a time: vLLM profiles memory at start); the engine
            # core's client class says whether the core is in-process
            self.core, self.package = self._reply()
        except BaseException:
            self._end()
            raise

    def _reply(self):
        try:
            ok, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.name}: engine process died "
                               f"(exit code {self.proc.exitcode})") from None
        if not ok:
            raise RuntimeError(f"{self.name}: engine process failed:\n{value}")
        return value

    def __call__(self, what: str, temp: float, n: int, rep: int = 0):
        self.conn.send((what, temp, n, rep))
        return self._reply()

    def pin(self, cpus: list[int]) -> None:
        self.conn.send(("pin", cpus))
        self._reply()

    def stop(self) -> None:
        with contextlib.suppress(OSError, EOFError, RuntimeError):
            self.conn.send(None)
            if self.conn.poll(120):  # the engine's own shutdown
                self._reply()
        self._end()

    def _end(self) -> None:
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def cell_row(name, spec, temp, n, runs: list[Run], warm: tuple = ()) -> dict:
    """One cell's row from its repeats, totalled: every repeat has its own prompts and
    every engine the same ones, so totals compare like with like across engines (the
    fastest run of each engine would not).  Every run's wall time is kept; ``warm``: the
    wall times of the cell's first and second short calls (a first-use stall shows as
    the first above the second)."""
    wall = sum(r.wall for r in runs)
    toks = sum(r.tokens for r in runs)
    drafts = sum(r.drafts for r in runs)
    iters = sum(r.iterations for r in runs)
    steps = drafts / n if spec else toks / n
    tau = (1 + sum(r.accepted for r in runs) / drafts) if (spec and drafts) else 1.0
    # requests advanced per engine step: below the batch size when the scheduler could
    # not fit every request's rows (e.g. 2 of 64 at budget 63)
    req_it = (drafts if spec else toks) / max(iters, 1)
    cut = [trim_stalls(r.gaps) for r in runs]
    trimmed = [r.wall - c for r, (c, _) in zip(runs, cut)]
    return dict(method=name, temperature=temp, batch=n, tau=tau,
                step_ms=1000 * wall / max(steps, 1.0), tok_s=toks / wall,
                tok_s_per_req=toks / wall / n, output_tokens=toks, wall_s=wall,
                walls_s=[round(r.wall, 4) for r in runs],
                tok_s_runs=[r.tokens / r.wall for r in runs],
                engine_steps=iters, req_per_engine_step=req_it,
                stall_s=sum(c for c, _ in cut), stalls=sum(k for _, k in cut),
                tok_s_trimmed=toks / sum(trimmed),
                tok_s_runs_trimmed=[r.tokens / w for r, w in zip(runs, trimmed)],
                warm_calls_s=[round(w, 4) for w in warm],
                median_gap_ms=[round(1000 * statistics.median(r.gaps[1:]), 3)
                               if len(r.gaps) > 1 else None for r in runs],
                gaps_ms=[[round(1000 * g, 2) for g in r.gaps] for r in runs],
                **_host_rows(runs, iters))


def _host_rows(runs: list[Run], iters: int) -> dict:
    """``host_ms_per_step`` (--host-timing): every timed method's host ms and calls per
    engine step, largest first (steps: the runner's ``execute_model`` calls, else vLLM's
    iteration count)."""
    snaps = [r.host for r in runs if r.host]
    if not snaps:
        return {}
    from benchmarks.hosttime import per_step

    steps = sum(s.get("runner.execute_model", (0, 0))[1] for s in snaps) or iters
    return dict(host_ms_per_step=per_step(snaps, steps))


def run_cells(args, engines: list[Engine], bar) -> list[dict]:
    """Every (temperature, batch) cell on every engine in ``engines``: warm-up, then
    ``--repeats`` timed runs, the engines' order reversed every other repeat and, when
    they are pinned, their CPU sets rotated every repeat (:func:`rotated`)."""
    rows = []
    sets = getattr(args, "cpu_sets", None) or [None]
    rotate = len(engines) > 1 and None not in sets
    for temp in args.temps:
        for n in args.batches:
            if rotate:  # the warm-up (and a one-repeat run) on the starting sets
                for e, cpus in zip(engines, sets):
                    e.pin(cpus)
            warm = {e.name: e("warm", temp, n) for e in engines}
            runs: dict[str, list[Run]] = {e.name: [] for e in engines}
            for rep in range(args.repeats):
                if rotate and rep:
                    for e, cpus in zip(engines, rotated(sets, rep)):
                        e.pin(cpus)
                for e in (engines if rep % 2 == 0 else engines[::-1]):
                    runs[e.name].append(e("run", temp, n, rep))
            for e in engines:
                rows.append(cell_row(e.name, e.spec, temp, n, runs[e.name], warm[e.name]))
                if args.profile:
                    rows[-1].update(e("profile", temp, n))
                bar.write(json.dumps(rows[-1]))
                bar.update(1)
    return rows


def run_methods(args, methods, prompts, bar) -> list[dict]:
    """Every cell of every method; ``args.engine_core`` and ``args.engine_package`` get
    each engine's core client and the directory of the vllm_ddtree it runs."""
    args.engine_core, args.engine_package = {}, {}
    if args.sequential:
        rows = []
        for name, spec, width in methods:
            bar.set_postfix_str(name)
            e = Engine(args, name, spec, width, prompts)
            args.engine_core[name], args.engine_package[name] = e.core, e.package
            try:
                rows += run_cells(args, [e], bar)
            finally:
                e.stop()
        return rows
    engines: list[Engine] = []
    try:
        for (name, spec, width), cpus in zip(methods, args.cpu_sets):
            bar.set_postfix_str(f"starting {name}")
            engines.append(Engine(args, name, spec, width, prompts, cpus))
            args.engine_core[name] = engines[-1].core
            args.engine_package[name] = engines[-1].package
        bar.set_postfix_str("interleaved")
        return run_cells(args, engines, bar)
    finally:
        for e in engines:
            e.stop()


# kernel names are long templates; this prefix tells apart the ones a step launches
KERNEL_NAME_CHARS = 160


def profile_generate(llm, batch, sp, spec, top: int = 6, trace=None) -> dict:
    """The same generate again under torch.profiler (engine in the worker's own process:
    --profile sets VLLM_ENABLE_V1_MULTIPROCESSING=0 there): wall and GPU-busy time per
    step (the sum of the kernel times the profiler records), the kernels that take
    longest and the host ops with the most self CPU time (where the host's step time
    goes).  Profiling slows the host side, so compare GPU-busy with the unprofiled step
    time.  ``trace``: also
    record Python stacks and write the Chrome trace there, gzipped, for
    ``benchmarks.trace_summary`` (32 tokens per request then, to keep it small)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if trace is not None:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=sp.temperature, max_tokens=min(sp.max_tokens, 32),
                            ignore_eos=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=acts, with_stack=trace is not None)
    run = timed_generate(llm, batch, sp, within=prof)
    events = prof.key_averages()
    kernels = [e for e in events
               if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    busy_us = sum(e.self_device_time_total for e in kernels)
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    host = [e for e in events if e.device_type.name == "CPU" and e.self_cpu_time_total > 0]
    host.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    if trace is not None:
        import gzip
        import shutil

        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace)
    per = max((run.drafts if spec else run.tokens) / len(batch), 1.0)  # this run's steps
    # every kernel by name (ms and launches per step): what step_cost compares by kernel
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        acc = by_name.setdefault(e.key[:KERNEL_NAME_CHARS], [0.0, 0.0])
        acc[0] += e.self_device_time_total / 1000 / per
        acc[1] += e.count / per
    return dict(prof_wall_ms=1000 * run.wall / per, gpu_busy_ms=busy_us / 1000 / per,
                prof_steps=per,
                kernels=[(k, round(ms, 5), round(c, 2)) for k, (ms, c) in by_name.items()],
                top_kernels=[(e.key[:60], round(e.self_device_time_total / 1000 / per, 4),
                              round(e.count / per, 2)) for e in kernels[:top]],
                top_host=[(e.key[:60], round(e.self_cpu_time_total / 1000 / per, 4),
                           round(e.count / per, 2)) for e in host[:2 * top]])


def add_ratios(rows: list[dict], paired: bool = True) -> None:
    """``vs_ar`` / ``vs_dflash``: ratio of the cells' total throughputs;
    ``paired_vs_dflash`` (``paired``: interleaved runs only, where one repeat of every
    engine ran within seconds): the median over repeats of the ratio within a repeat."""
    by = {(r["method"], r["temperature"], r["batch"]): r for r in rows}
    names = {r["method"] for r in rows}
    for r in rows:
        key = (r["temperature"], r["batch"])
        for ref in ("ar", "dflash"):  # an @inproc engine against its @inproc reference
            b = by.get((reference(r["method"], ref, names), *key))
            r[f"vs_{ref}"] = r["tok_s"] / b["tok_s"] if b else None
        b = by.get((reference(r["method"], "dflash", names), *key))
        r["paired_vs_dflash"] = _median_ratio(r, b, "tok_s_runs") if paired else None
        # the same two ratios with every run's stalls cut to the cap (trim_stalls)
        r["vs_dflash_trimmed"] = (r["tok_s_trimmed"] / b["tok_s_trimmed"]
                                  if b and "tok_s_trimmed" in r else None)
        r["paired_trimmed"] = _median_ratio(r, b, "tok_s_runs_trimmed") if paired else None


def _median_ratio(r: dict | None, b: dict | None, key: str) -> float | None:
    """Median over repeats of ``r[key][i] / b[key][i]`` (None without both rows' runs)."""
    if not (r and b and key in r and key in b):
        return None
    pairs = [x / y for x, y in zip(r[key], b[key])]
    return statistics.median(pairs) if pairs else None


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return False
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["batch"], r["tok_s"]) for r in rows
                         if r["method"] == method and r["temperature"] == temp)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("output tokens/s (total)")
        ax.set_title(f"T = {temp}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def build_methods(wanted: list, budgets: list, drafter: str, k: int,
                  dspark: tuple[str, int] | None = None) -> list:
    """``(name, speculative_config or None, verify rows per request)`` per engine of
    ``--methods``; ``ValueError`` for an unknown one.  A method with the suffix
    ``@inproc`` is the same engine with vLLM's engine core in-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), named with the suffix; ``@base``: the same
    engine running the package copy in ``--base-src`` (before/after in one run).
    ``dspark``: ``(DSpark drafter, its block size)`` for the methods ``dspark`` (vLLM's
    DSpark chain, one draft per block slot) and ``dspark-ddtree-N`` (DDTree of budget N
    over that drafter)."""
    for suffix in (INPROC, BASE):
        marked = [m[: -len(suffix)] for m in wanted if m.endswith(suffix)]
        if marked:
            plain = [m for m in wanted if not m.endswith(suffix)]
            return ((build_methods(plain, budgets, drafter, k, dspark) if plain else [])
                    + [(n + suffix, spec, w)
                       for n, spec, w in build_methods(marked, budgets, drafter, k, dspark)])
    fixed = [m for m in wanted if re.fullmatch(r"ddtree-[1-9][0-9]*", m)]  # static budget N
    on_dspark = [m for m in wanted if m == "dspark"
                 or re.fullmatch(r"dspark-ddtree-[1-9][0-9]*", m)]
    unknown = (set(wanted) - set(fixed) - set(on_dspark)
               - {"ar", "dflash", "dflash2", "ddtree", "ddtree-auto", "ddtree-online"})
    if unknown:
        raise ValueError(f"unknown --methods {sorted(unknown)}")
    if on_dspark and dspark is None:
        raise ValueError(f"--methods {on_dspark} need --dspark-drafter")
    methods = [("ar", None, 1)] if "ar" in wanted else []
    dflash = {"method": "dflash", "model": drafter, "num_speculative_tokens": k}
    if "dflash" in wanted:
        methods.append(("dflash", dflash, 1 + k))
    if "dflash2" in wanted:  # a second, identical DFlash engine: the A/A noise floor
        methods.append(("dflash-b", dict(dflash), 1 + k))
    static = sorted(set((budgets if "ddtree" in wanted else [])
                        + [int(m.split("-")[1]) for m in fixed]))
    methods += [(f"ddtree-{b}", {"method": "ddtree", "model": drafter,
                                 "num_speculative_tokens": b}, 1 + b) for b in static]
    for name, mode in (("ddtree-auto", True), ("ddtree-online", "online")):
        if name in wanted:
            methods.append((name, {"method": "ddtree", "model": drafter,
                                   "num_speculative_tokens": max(budgets),
                                   "ddtree_adaptive_budget": mode}, 1 + max(budgets)))
    if "dspark" in wanted:
        path, block = dspark
        methods.append(("dspark", {"method": "dspark", "model": path,
                                   "num_speculative_tokens": block}, 1 + block))
    for b in sorted({int(m.rsplit("-", 1)[1]) for m in on_dspark if m != "dspark"}):
        methods.append((f"dspark-ddtree-{b}", {"method": "ddtree", "model": dspark[0],
                                               "num_speculative_tokens": b}, 1 + b))
    return methods


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--dspark-drafter", type=Path, default=None,
                    help="a DSpark drafter for the same target (methods dspark, "
                         "dspark-ddtree-N)")
    ap.add_argument("--fixture", help="use the project's tiny pair of this variant instead")
    ap.add_argument("--out", default="throughput-out")
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--dflash-k", type=int, default=None, help="default: block_size - 1")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--prompts",
                    help="a .jsonl ({'prompt': ...}) or text file (blank-line x2 separated)")
    ap.add_argument("--num-prompts", type=int, default=64, help="cap for a training_log.json")
    ap.add_argument("--methods", default="ar,dflash,ddtree",
                    help="ar, dflash, dflash2 (a second DFlash engine, 'dflash-b': how far "
                         "two identical engines differ), ddtree (one engine per budget), "
                         "ddtree-N (one engine of static budget N), ddtree-auto (adaptive "
                         "budget up to the largest of --budgets), ddtree-online (the same, "
                         "re-tuned from the trees' expected acceptance), dspark (vLLM's "
                         "DSpark chain over --dspark-drafter), dspark-ddtree-N (DDTree of "
                         "budget N over it); any of them with "
                         "the suffix @inproc: vLLM's engine core in-process, or @base: the package "
                         "copy in --base-src")
    ap.add_argument("--cpu", action="store_true", help="CPU smoke settings (fp32, eager)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--gpu-mem", type=float, default=0.85,
                    help="GPU memory fraction for all engines alive at once (interleaved: "
                         "shared equally; --sequential: each engine's)")
    ap.add_argument("--sequential", action="store_true",
                    help="one engine after another instead of interleaved cells")
    ap.add_argument("--pin-cpus", choices=("auto", "on", "off"), default="auto",
                    help="pin each interleaved engine's processes to its own CPUs, the "
                         "sets rotating between engines every repeat (auto: on a GPU with "
                         "at least two CPUs per engine; never with --sequential)")
    ap.add_argument("--base-src", type=Path, default=None,
                    help="a directory holding another copy of the vllm_ddtree package, run "
                         "by the methods with the suffix @base")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--jit-verbose", action="store_true",
                    help="log every kernel JIT compilation after vLLM's warm-up (a "
                         "first-use stall), not only the first of each kernel")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs per cell, interleaved across engines; the cell "
                         "reports their totals and the median paired ratio")
    ap.add_argument("--host-timing", action="store_true",
                    help="host ms per step by method of the model runner and its parts "
                         "(benchmarks/hosttime.py); every method needs the @inproc suffix")
    ap.add_argument("--trace", action="store_true",
                    help="with --profile: write each cell's Chrome trace (trace-*.json.gz)")
    ap.add_argument("--profile", action="store_true",
                    help="also run each cell once under torch.profiler (engine inside its "
                         "worker process): GPU-busy ms per step and the top kernels")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.trace and not args.profile:
        ap.error("--trace needs --profile")
    if any(has_suffix(m, BASE) for m in args.methods.split(",")):
        if args.base_src is None or not (args.base_src / "vllm_ddtree").is_dir():
            ap.error("methods with @base need --base-src DIR holding a vllm_ddtree copy")
        args.base_src = args.base_src.resolve()
    if args.host_timing and not all(has_suffix(m, INPROC) for m in args.methods.split(",")):
        ap.error("--host-timing needs every method in-process: add @inproc to each")
    out = args.out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        args.dtype, args.eager, args.gpu_mem = "float32", True, 0.2
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.fixture:
        from vllm_ddtree.testing.fixtures import make_tiny_pair

        args.target, args.drafter = make_tiny_pair(out / "fixtures", args.fixture, args.dtype)
    if not (args.target and args.drafter):
        ap.error("give --target and --drafter, or --fixture")
    args.batches = [int(x) for x in args.batches.split(",")]
    args.temps = [float(x) for x in args.temps.split(",")]
    budgets = [int(x) for x in args.budgets.split(",")]
    def block_size(drafter) -> int:
        return json.loads((Path(drafter) / "config.json").read_text()).get("block_size", 16)

    k = args.dflash_k or block_size(args.drafter) - 1
    dspark = None
    if args.dspark_drafter:
        dspark = (str(args.dspark_drafter), block_size(args.dspark_drafter))
    try:
        methods = build_methods(args.methods.split(","), budgets, str(args.drafter), k, dspark)
    except ValueError as e:
        ap.error(str(e))
    prompts = load_prompts(args.prompts, args.num_prompts)
    if not args.sequential and not args.cpu:
        args.gpu_mem /= len(methods)
    pin = not args.sequential and (args.pin_cpus == "on"
                                   or (args.pin_cpus == "auto" and not args.cpu))
    args.cpu_sets = (cpu_sets(os.sched_getaffinity(0), len(methods)) if pin
                     else [None] * len(methods))
    from tqdm import tqdm

    with tqdm(total=len(methods) * len(args.batches) * len(args.temps), desc="benchmark") as bar:
        rows = run_methods(args, methods, prompts, bar)
    add_ratios(rows, paired=not args.sequential)
    meta = dict(target=str(args.target), drafter=str(args.drafter),
                dspark_drafter=dspark and dspark[0], dtype=args.dtype, tp=args.tp,
                eager=args.eager, max_tokens=args.max_tokens, dflash_k=k,
                repeats=args.repeats, interleaved=not args.sequential,
                gpu_mem_per_engine=args.gpu_mem, topk_prune=True,  # build_tree's default
                engine_cpus={m[0]: c for m, c in zip(methods, args.cpu_sets)},
                cpu_sets_rotate=len(methods) > 1 and None not in args.cpu_sets,
                engine_core=args.engine_core, engine_package=args.engine_package)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, out / "throughput.png")
    print(f"\n{'method':<18} {'T':>3} {'batch':>5} {'tau':>6} {'step ms':>8} {'tok/s':>9} "
          f"{'tok/s/req':>9} {'vs DFlash':>9} {'paired':>6} {'vs AR':>6} {'req/it':>6} "
          f"{'trimmed':>7} {'p.trim':>6} {'stalls':>6} {'stall s':>7}")
    for r in rows:
        f = lambda v: f"{v:.2f}" if v is not None else "-"
        print(f"{r['method']:<18} {r['temperature']:>3g} {r['batch']:>5} {r['tau']:>6.2f} "
              f"{r['step_ms']:>8.2f} {r['tok_s']:>9.1f} {r['tok_s_per_req']:>9.1f} "
              f"{f(r['vs_dflash']):>9} {f(r['paired_vs_dflash']):>6} {f(r['vs_ar']):>6} "
              f"{r['req_per_engine_step']:>6.1f} {f(r['vs_dflash_trimmed']):>7} "
              f"{f(r['paired_trimmed']):>6} {r['stalls']:>6} {r['stall_s']:>7.3f}")
    if args.host_timing:
        print(f"\n{'method':<18} {'T':>3} {'batch':>5}   host ms per step (calls per step)")
        for r in rows:
            tops = "; ".join(f"{k} {ms:.3f} x{c:g}" for k, ms, c in r["host_ms_per_step"][:6])
            print(f"{r['method']:<18} {r['temperature']:>3g} {r['batch']:>5}   {tops}")
    if args.profile:
        print(f"\n{'method':<12} {'T':>3} {'batch':>5} {'wall ms/step':>12} {'GPU busy':>9}"
              "   top kernels (ms per step, launches per step)")
        for r in rows:
            tops = "; ".join(f"{k} {ms:.3f} x{c:g}" for k, ms, c in r["top_kernels"][:3])
            print(f"{r['method']:<12} {r['temperature']:>3g} {r['batch']:>5} "
                  f"{r['prof_wall_ms']:>12.2f} {r['gpu_busy_ms']:>9.2f}   {tops}")
            hosts = "; ".join(f"{k} {ms:.3f} x{c:g}" for k, ms, c in r["top_host"][:4])
            print(f"{'':>37}host: {hosts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
