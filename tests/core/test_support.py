"""What a tree verify supports (:mod:`vllm_ddtree.support`): the sampling features that
make a request verify a chain, and the attention and RoPE features that refuse a target.
Duck-typed stand-ins for vLLM's objects (the module reads their attributes only)."""

from types import SimpleNamespace

import pytest

from vllm_ddtree.support import (
    attention_problems,
    chain_reason,
    refuse_layer,
    refuse_multimodal_rope,
)


class Params:
    """The attributes of vLLM's ``SamplingParams`` that ``chain_reason`` reads, at
    vLLM's defaults."""

    structured_outputs = None
    repetition_penalty = 1.0
    presence_penalty = 0.0
    frequency_penalty = 0.0
    bad_words = None


def test_chain_reason():
    assert chain_reason(None) is None
    assert chain_reason(Params()) is None
    p = Params()
    p.presence_penalty = 0.5
    assert "penalties" in chain_reason(p)
    for name, value in (("repetition_penalty", 1.1), ("frequency_penalty", -0.2)):
        p = Params()
        setattr(p, name, value)
        assert chain_reason(p) == "repetition/presence/frequency penalties"
    p = Params()
    p.bad_words = ["x"]
    assert chain_reason(p) == "bad words"
    p = Params()
    p._bad_words_token_ids = [[7]]  # vLLM's tokenized form
    assert chain_reason(p) == "bad words"
    p = Params()
    p.thinking_token_budget = 0  # 0 is a budget (end thinking at once), not "unset"
    assert chain_reason(p) == "a thinking-token budget"
    p = Params()
    p.structured_outputs = object()
    assert chain_reason(p) == "structured output (a grammar)"


def _impl(**attrs):
    """An attention impl with the attributes vLLM's impls share, none of them in use."""
    base = dict(sliding_window=None, alibi_slopes=None, logits_soft_cap=None, sinks=None,
                kv_cache_dtype="auto", kv_sharing_target_layer_name=None)
    return SimpleNamespace(**{**base, **attrs})


def test_attention_problems():
    assert attention_problems(_impl()) == []
    assert attention_problems(object()) == []  # attributes absent: nothing in use
    for window in (-1, (-1, -1)):  # vLLM's "no window"
        assert attention_problems(_impl(sliding_window=window)) == []
    assert attention_problems(_impl(kv_cache_dtype="bfloat16")) == []
    cases = [(dict(sliding_window=4096), "sliding-window attention"),
             (dict(sliding_window=(127, 0)), "sliding-window attention"),
             (dict(alibi_slopes=[0.5]), "ALiBi"),
             (dict(logits_soft_cap=30.0), "logit soft-capping"),
             (dict(sinks=[0.0]), "attention sinks"),
             (dict(kv_cache_dtype="fp8_e4m3"), "an fp8 KV cache"),
             (dict(kv_sharing_target_layer_name="layers.0.attn"),
              "a KV cache shared with another layer")]
    for attrs, problem in cases:
        assert attention_problems(_impl(**attrs)) == [problem], attrs
    every = _impl(**{k: v for attrs, _ in cases[1:] for k, v in attrs.items()})
    assert attention_problems(every) == [p for _, p in cases[1:]]  # all, in order


def test_refuse_layer():
    refuse_layer("layers.3.attn", [], "GPU")  # nothing to refuse
    with pytest.raises(NotImplementedError, match=r"layers\.3\.attn uses ALiBi; an fp8 KV "
                                                  r"cache, which the GPU tree attention"):
        refuse_layer("layers.3.attn", ["ALiBi", "an fp8 KV cache"], "GPU")


def test_refuse_multimodal_rope():
    refuse_multimodal_rope(False)  # 1-D RoPE: nothing to refuse
    with pytest.raises(NotImplementedError, match=r"multimodal RoPE \(M-RoPE/XD-RoPE\).*"
                                                  r"use method 'dflash'"):
        refuse_multimodal_rope(True)
