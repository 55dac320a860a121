"""The Markov head of a DSpark drafter as the conditioned tree build reads it.

Reads vLLM's loaded DSpark model (``Qwen3DSparkForCausalLM``: ``model.markov_head``'s
``markov_w1`` embedding and ``markov_w2`` projection, the ``logits_processor``) by
attribute only: no vLLM import, so the vLLM 0.32 CPU build's model checks it in CI.
"""

from __future__ import annotations

from typing import Any

from vllm_ddtree.tree.conditioned import MarkovHead


def markov_head_of(model: Any) -> MarkovHead:
    """The drafter's Markov head: the two factors (views of the loaded weights, the draft
    vocabulary's rows of the second) and the logits processor's scale.  vLLM's DSpark
    sampler computes the same bias as a bf16 GEMM through that processor; the build sums
    the factors' products in float32 inside its kernel.  Refuses heads the build cannot
    read as two dense factors."""
    head = model.model.markov_head
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    processor = model.logits_processor
    if getattr(model, "has_recurrent_markov_head", False) or not (
            w1.dtype.is_floating_point and w2.dtype.is_floating_point):
        raise ValueError("vllm-ddtree: DDTree over this DSpark drafter needs a Markov head "
                         "of two dense factors (this one is recurrent or quantized); serve "
                         "it with method='dspark'")
    if processor.soft_cap is not None:
        raise ValueError("vllm-ddtree: DDTree over DSpark drafters with a logit soft cap is "
                         "not supported; serve it with method='dspark'")
    # ParallelLMHead pads its rows; the processor keeps the first org_vocab_size
    return MarkovHead(w1, w2[: processor.org_vocab_size].to(w1.dtype), float(processor.scale))
