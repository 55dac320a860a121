"""Shared helpers for tests that start vLLM's OpenAI-compatible server (loopback only).

Each server runs in its own process group (``start_new_session``) so that ``stop()``
also reaches the engine core and worker processes it spawned.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

MODEL = "tiny"  # --served-model-name
STARTUP_TIMEOUT_S = 300.0  # several servers share the cores while they start
REQUEST_TIMEOUT_S = 120.0

_PORTS: set[int] = set()


def free_port() -> int:
    """A loopback port that is free now and was not handed out before."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS:
            _PORTS.add(port)
            return port


def tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(lines[-n:])


# VLLM_DDTREE_TEST_GPU=1 runs the server tests on a GPU: bf16 fixtures (the large-margin
# tree_beats_chain pair where a test uses the random one, see fixture_variant), eager.
ON_GPU = os.environ.get("VLLM_DDTREE_TEST_GPU") == "1"
DTYPE = "bfloat16" if ON_GPU else "float32"


def fixture_variant(cpu_variant: str) -> str:
    """bf16 flips near-ties of the random pair (batch-shape dependent rounding), so exact
    comparisons on a GPU use the large-margin pair."""
    return "tree_beats_chain" if ON_GPU and cpu_variant == "random" else cpu_variant


def server_cmd(target: Path, port: int, spec: dict | None = None, max_model_len: int = 512,
               extra_args: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(target), "--served-model-name", MODEL, "--dtype", DTYPE,
           "--max-model-len", str(max_model_len), "--enforce-eager",
           "--gpu-memory-utilization", "0.2", "--seed", "0", "--port", str(port),
           "--host", "127.0.0.1", *extra_args]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


class Server:
    """A server started by :func:`server_cmd`, or by ``command(port)`` with the
    environment ``env`` where they are given (a user's command line, run as written)."""

    def __init__(self, name: str, target: Path | None, log_dir: Path, spec: dict | None = None,
                 max_model_len: int = 512, extra_args: tuple[str, ...] = (), *,
                 command: Callable[[int], list[str]] | None = None,
                 env: dict[str, str] | None = None):
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        if command is not None:
            cmd = command(self.port)
        else:
            assert target is not None
            cmd = server_cmd(target, self.port, spec, max_model_len, extra_args)
        if env is None:
            env = dict(os.environ)
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default is too big here
        self._model: str | None = None
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # own process group

    def tail(self, n: int = 60) -> str:
        head = f"----- {self.name} server log tail ({self.log_path}) -----"
        return f"{head}\n{tail(self.log_path, n)}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    @property
    def model(self) -> str:
        """The served model's name, as the server lists it (``/v1/models``)."""
        if self._model is None:
            self._model = json.loads(self.get("/v1/models"))["data"][0]["id"]
        return self._model

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.base + path, timeout=30) as r:
            return r.read().decode()

    def post_raw(self, path: str, body: bytes,
                 content_type: str = "application/json") -> tuple[int, str]:
        """POST raw bytes; (HTTP status, body text), also for error statuses."""
        req = urllib.request.Request(self.base + path, data=body, method="POST",
                                     headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused",
                             timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def metrics(self) -> str:
        return self.get("/metrics")

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after 30 s."""
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)  # stragglers (engine core, workers)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            print(f"{self.name} server (pid {pgid}) did not exit after SIGKILL",
                  file=sys.__stderr__)


def wait_all_healthy(servers: list[Server], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for s in list(pending):
            if s.proc.poll() is not None:
                pytest.fail(f"{s.name} server exited with {s.proc.returncode} while "
                            f"starting\n{s.tail()}")
            if s.healthy():
                pending.remove(s)
        if pending and time.monotonic() > deadline:
            pytest.fail(f"not healthy after {timeout_s:.0f} s: "
                        f"{[s.name for s in pending]}\n" + "\n".join(s.tail() for s in pending))
        time.sleep(0.5)


def field(obj, name):
    """A vLLM extension field of an openai response object (None when absent)."""
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


_COUNTER = re.compile(
    r"^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)(?:_total)?"
    r"(?:\{[^}]*\})?\s+(\S+)\s*$", re.MULTILINE)


def spec_counters(metrics_text: str) -> dict[str, float]:
    """Speculative-decoding counters in Prometheus text (summed over label sets).

    vLLM 0.32 exports them as ``vllm:spec_decode_num_{drafts,draft_tokens,
    accepted_tokens}_total`` (plus ``*_created`` gauges, not matched here, and
    ``..._accepted_tokens_per_pos_total``, not matched either); a server without
    speculation exports none of them.
    """
    out: dict[str, float] = {}
    for name, value in _COUNTER.findall(metrics_text):
        out[name] = out.get(name, 0.0) + float(value)
    return out


def metric(metrics_text: str, name: str, **labels: str) -> float | None:
    """One Prometheus sample summed over its label sets that carry ``labels`` (None when
    absent)."""
    pat = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)\s*$", re.MULTILINE)
    want = [f'{k}="{v}"' for k, v in labels.items()]
    values = [v for lab, v in pat.findall(metrics_text) if all(w in lab for w in want)]
    return sum(float(v) for v in values) if values else None


def report(text: str, request) -> None:
    """Print server logs through pytest's terminal reporter (shown also without -s)."""
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line("\n" + text)
    else:
        print(text, file=sys.__stderr__)
