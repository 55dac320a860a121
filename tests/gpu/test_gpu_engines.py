"""DDTree on vLLM's GPU runner (Model Runner V2), end to end on the tiny bf16 fixtures:
greedy exactness against no speculation with CUDA graphs on, and the T > 0 distribution
test.  Needs a CUDA GPU with vLLM (skipped elsewhere by tests/conftest.py):

    python3 -m pytest tests/gpu -m gpu

Eleven engine starts in all (about 45 s each on an H200).  The same checks with more
budgets, batch sizes and graph modes: ``benchmarks.gpu_correctness`` and
``benchmarks.gpu_sampling``.
"""

from __future__ import annotations

import pytest

from benchmarks.gpu_correctness import engine, run_batches
from benchmarks.gpu_sampling import CONFIGS, P_MIN, TOKENS, min_p

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.vllm]

BUDGET = 60
BATCHES = (1, 32)
MAX_TOKENS = 48
# mean accepted tokens per step at budget 60 that show the trees accepting: accept_all
# accepts every drafted depth (D + 1 = 16 on the H200); on tree_beats_chain the drafter's
# top-1 chain is always wrong (tau 1.00), trees reach 2.00
MIN_TAU = {"accept_all": 15.0, "tree_beats_chain": 1.5}


@pytest.fixture(scope="module", autouse=True)
def spawned_engine_processes():
    """vLLM's engine processes started by ``spawn``: a forked engine core of a process
    that already touched CUDA can stop before loading the model."""
    pytest.importorskip("vllm", reason="needs vLLM (a CUDA build)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        yield


def _assert_greedy_identical(target, drafter, min_tau: float, label: str) -> None:
    """Greedy DDTree (budget 60, CUDA graphs on) against an eager no-speculation engine,
    at every batch of BATCHES: the same tokens, and at least ``min_tau`` tokens a step."""
    with engine(target, None, graphs=False) as llm:
        want = run_batches(llm, BATCHES, MAX_TOKENS)
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": BUDGET}
    with engine(target, spec, graphs=True, budget=BUDGET) as llm:
        got = run_batches(llm, BATCHES, MAX_TOKENS)
    for batch in BATCHES:
        tokens, tau, _ = got[batch]
        assert tokens == want[batch][0], f"{label}, batch {batch}: tokens differ"
        assert tau >= min_tau, f"{label}, batch {batch}: tau {tau:.2f}"


@pytest.mark.parametrize("fixture", sorted(MIN_TAU))
def test_margin_fixtures_greedy_identical_with_cuda_graphs(root, fixture):
    """Greedy DDTree (budget 60, CUDA graphs on) gives exactly the tokens of no
    speculation, at batches 1 and 32, on the fixtures whose logit margins (~10) make the
    tokens independent of bf16 rounding; the no-speculation reference runs eager, which
    those margins allow (and which saves a graph capture)."""
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    target, drafter = make_tiny_pair(root, fixture, "bfloat16")
    _assert_greedy_identical(target, drafter, MIN_TAU[fixture], fixture)


# (fixture, reduced draft vocabulary): from root A the Markov head's best path is A A A
# ..., what the target accepts at every depth; the DSpark pass drafts block_size = 16
# depths, so accepting them all gives 17 tokens a step
DSPARK_CASES = (("markov_steers", None), ("markov_steers", 100))
DSPARK_MIN_TAU = 16.0


@pytest.mark.parametrize(("variant", "vd"), DSPARK_CASES)
def test_dspark_drafter_greedy_identical_with_cuda_graphs(root, variant, vd):
    """``method: ddtree`` over a DSpark drafter (vLLM's DSpark backbone, the tree's
    children ranked by the Markov head): greedy tokens equal no speculation's at batches
    1 and 32 with CUDA graphs on, full and reduced draft vocabularies, and the trees
    follow the head (a marginal tree's best path, B B B ..., would accept nothing)."""
    from vllm_ddtree.testing import dspark_fixture as dx
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    target, _ = make_tiny_pair(root, dx.PAIRED_TARGET[variant], "bfloat16")
    drafter = dx.write_dspark_drafter(root, variant, "bfloat16", draft_vocab_size=vd)
    _assert_greedy_identical(target, drafter, DSPARK_MIN_TAU, f"{variant}/{vd}")


NUM_SAMPLES, SEEDS = 4000, list(range(1000, 1200))


def _sample_runs(target, spec) -> dict:
    """Samples of the first TOKENS tokens of one engine: per CONFIGS entry NUM_SAMPLES
    unseeded, T = 0.7 (no speculation only, for the power check), and twice the seeded
    requests; plus the engine's tau."""
    from vllm import SamplingParams

    from vllm_ddtree.testing.engines import llm_engine
    from vllm_ddtree.testing.metrics import spec_counts

    def samples(llm, n=NUM_SAMPLES, seeded=False, **params):
        sampling = [SamplingParams(max_tokens=TOKENS, ignore_eos=True,
                                   seed=SEEDS[i] if seeded else None, **params)
                    for i in range(n)]
        outputs = llm.generate(["hi"] * n, sampling, use_tqdm=False)
        return [tuple(o.outputs[0].token_ids) for o in outputs]

    # different engine seeds: the unseeded samples of the two engines are independent;
    # no speculation runs eager (it gives the reference distribution, ~70 s sooner)
    with llm_engine(model=str(target), dtype="bfloat16", max_model_len=256,
                    seed=1 if spec else 0, max_num_seqs=256, gpu_memory_utilization=0.3,
                    disable_log_stats=False, speculative_config=spec,
                    enforce_eager=spec is None) as llm:
        run = {config: samples(llm, **params) for config, params in CONFIGS.items()}
        if spec is None:
            run["t07"] = samples(llm, temperature=0.7)
        run["seeded"] = [samples(llm, n=len(SEEDS), seeded=True, temperature=1.0)
                         for _ in range(2)]
        run["tau"] = spec_counts(llm).tau
    return run


@pytest.fixture(scope="module")
def spread_nospec(root) -> dict:
    """No speculation on the ``spread`` target, shared by both drafter families."""
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    target, _ = make_tiny_pair(root, "spread", "bfloat16")
    run = _sample_runs(target, None)
    power = min_p(run["t07"], run["t1"])
    assert power < P_MIN, f"the test cannot tell T = 0.7 from T = 1 (p = {power:.3g})"
    return run


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_sampling_matches_no_speculation(root, spread_nospec, family):
    """T > 0 on the ``spread`` fixture (target T = 1 distribution ~(0.80, 0.16, 0.03) over
    three tokens, shared by the drafter, so trees accept several random tokens a step),
    with the DFlash drafter and with the DSpark one (its Markov head reranks each node's
    children).  For each of t1, top_k, top_p: 4000 unseeded samples of the first 4
    tokens with DDTree (budget 60) and with no speculation; the two-sample chi-square
    (:func:`vllm_ddtree.testing.metrics.two_sample_p_value`) per position and on the
    joint pair of positions 1 and 2 must give p > 1e-3 everywhere (``min_p``).  Power: the
    same test rejects (p < 1e-3) no speculation at T = 0.7 against T = 1
    (``spread_nospec``).  Seeded requests give the same tokens run to run and the same
    tokens as no speculation (vLLM keys its noise by seed and position, DDTree draws each
    node at root + depth)."""
    from vllm_ddtree.testing import dspark_fixture as dx
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    target, drafter = make_tiny_pair(root, "spread", "bfloat16")
    if family == "dspark":
        drafter = dx.write_dspark_drafter(root, "spread", "bfloat16")
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": BUDGET}
    ddtree, nospec = _sample_runs(target, spec), spread_nospec
    for config in CONFIGS:
        p = min_p(ddtree[config], nospec[config])
        assert p > P_MIN, f"{config}: DDTree's samples differ from no speculation (p = {p:.3g})"
    assert ddtree["tau"] is not None and ddtree["tau"] > 2.0
    first, second = ddtree["seeded"]
    assert first == second, "seeded DDTree requests differ run to run"
    assert first == nospec["seeded"][0], "seeded DDTree differs from no speculation"
