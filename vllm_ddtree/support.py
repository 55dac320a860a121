"""What a tree verify supports, shared by the CPU and GPU paths (each adds only what is
its own).

* :func:`chain_reason`: sampling features whose state vLLM keeps per generated prefix
  (penalties count the tokens before each draft row, bad words and grammars match the
  prefix, a thinking budget counts it) read the draft rows of a request as one linear
  history.  A tree's rows are not one history, so such a request's drafts are verified
  as a linear chain (the drafter's top-1 path): exact, fewer tokens accepted.
* :func:`attention_problems`: attention features the tree kernels do not implement;
  a target layer that uses any of them is refused at load time.
* :func:`refuse_multimodal_rope`: a target with multimodal RoPE is refused at load time
  (tree positions are written to the 1-D positions only).

No vLLM import: both read vLLM objects through their attributes.
"""

from __future__ import annotations

from typing import Any


def chain_reason(sampling_params: Any) -> str | None:
    """Why a request with ``sampling_params`` (vLLM's ``SamplingParams``) must be
    verified as a linear chain, or None."""
    p = sampling_params
    if p is None:
        return None
    if getattr(p, "structured_outputs", None) is not None:
        return "structured output (a grammar)"
    if (getattr(p, "repetition_penalty", 1.0) != 1.0 or getattr(p, "presence_penalty", 0.0)
            or getattr(p, "frequency_penalty", 0.0)):
        return "repetition/presence/frequency penalties"
    if getattr(p, "bad_words", None) or getattr(p, "_bad_words_token_ids", None):
        return "bad words"
    if getattr(p, "thinking_token_budget", None) is not None:
        return "a thinking-token budget"
    return None


def attention_problems(impl: Any) -> list[str]:
    """The features of vLLM attention ``impl`` that a tree verify cannot compute exactly
    (empty when it can).  Reads the attributes vLLM's attention impls share; a path
    checks its own backend and layouts itself."""
    problems = []
    window = getattr(impl, "sliding_window", None)
    if window not in (None, -1, (-1, -1)):
        problems.append("sliding-window attention")
    if getattr(impl, "alibi_slopes", None) is not None:
        problems.append("ALiBi")
    if getattr(impl, "logits_soft_cap", None):
        problems.append("logit soft-capping")
    if getattr(impl, "sinks", None) is not None:
        problems.append("attention sinks")
    if str(getattr(impl, "kv_cache_dtype", "auto")).startswith("fp8"):
        problems.append("an fp8 KV cache")
    if getattr(impl, "kv_sharing_target_layer_name", None):
        problems.append("a KV cache shared with another layer")
    return problems


def refuse_layer(layer_name: str, problems: list[str], path: str) -> None:
    """Raise for a target attention layer with ``problems`` (none: return)."""
    if problems:
        raise NotImplementedError(
            f"vllm-ddtree: target attention layer {layer_name} uses {'; '.join(problems)}, "
            f"which the {path} tree attention does not support; use method 'dflash' for "
            "this model.")


def refuse_multimodal_rope(uses_multimodal_rope: bool) -> None:
    """Raise for a target whose RoPE is multimodal (M-RoPE/XD-RoPE): a tree verify writes
    each node's position (root + depth) to the 1-D positions only."""
    if uses_multimodal_rope:
        raise NotImplementedError(
            "vllm-ddtree: targets with multimodal RoPE (M-RoPE/XD-RoPE) are not "
            "supported yet (tree positions are written to the 1-D positions only); "
            "use method 'dflash' for this model.")
