"""DDTree verification for Model Runner V2: takes the place of vLLM's rejection
sampler (``ModelState.custom_sampler``).

1. The target's own token at every verify row, drawn by vLLM's ``Sampler.sample`` with
   the request's parameters, keyed (seed, position) at the node's tree position
   ``root + depth``: greedy rows take the argmax; at T > 0 each node's token is a draw
   from that node's processed distribution (lossless), and along the accepted path the
   Gumbel noise is the one non-speculative decoding uses at the same positions.
2. The walk (:meth:`TreeBuffers.walk`): follow the child equal to the target's token.
3. vLLM's ``SamplerOutput``: accepted tokens + bonus, ``num_sampled`` and
   ``num_rejected`` through vLLM's own ``get_num_sampled_and_rejected``.  Logprobs are
   vLLM's own code run on the logits rows permuted to the accepted path.
"""

from __future__ import annotations

import functools
import inspect

import torch
from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler


def _returns_logprobs(sampler, idx_mapping_np) -> bool:
    fn = getattr(sampler, "returns_logprobs", None)  # vLLM 0.26
    if fn is not None:
        return fn(idx_mapping_np)
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    return sampler.sampling_states.max_num_logprobs(idx_mapping_np) != NO_LOGPROBS


@functools.lru_cache(maxsize=16)
def _param_names(func) -> frozenset[str]:
    return frozenset(inspect.signature(func).parameters)


def _call_by_name(fn, **available):
    """Call ``fn`` with the arguments its signature names (vLLM versions add and
    reorder arguments of these internal methods).  The signature is read once per
    function, not every step."""
    params = _param_names(getattr(fn, "__func__", fn)) - {"self"}
    return fn(**{k: v for k, v in available.items() if k in params})


class DDTreeVerifier:
    # vLLM 0.32+ warm-up reads this flag of the rejection sampler (adaptive verification
    # is refused for DDTree configs: vllm_ddtree.config.check_runner_features)
    enable_adaptive_verification = False

    def __init__(self, sampler, vllm_config, tree, device):
        self.sampler = sampler
        self.tree = tree
        # vLLM's rejection sampler, used only for its logprobs helper
        self._stock = RejectionSampler(sampler, vllm_config.speculative_config, device)

    def __call__(self, logits, input_batch, draft_logits=None, invalid_drafts=None,
                 **_) -> SamplerOutput:
        """vLLM 0.32+ also passes ``invalid_drafts`` (drafts a grammar rejects).  Not
        needed here: requests with a grammar are verified as a chain, and each row's
        target token is drawn from grammar-masked logits, so a draft the grammar rejects
        never equals the target's token and the walk stops before it."""
        s = self.sampler
        num_nans = None
        if s.compute_nans:
            from vllm.v1.worker.gpu.metrics.logits import get_num_nans

            num_nans = get_num_nans(logits)
        li = input_batch.logits_indices
        node_tokens = input_batch.input_ids[li]
        pos = self.tree.rope[li]  # root position + depth
        seq_ub = input_batch.seq_lens_cpu_upper_bound
        wants_logprobs = _returns_logprobs(s, input_batch.idx_mapping_np)
        targets, processed = _call_by_name(
            s.sample, logits=logits, expanded_idx_mapping=input_batch.expanded_idx_mapping,
            idx_mapping=input_batch.idx_mapping, idx_mapping_np=input_batch.idx_mapping_np,
            pos=pos, input_ids=node_tokens, expanded_local_pos=input_batch.expanded_local_pos,
            seq_lens_upper_bound_np=seq_ub.numpy() if seq_ub is not None else None,
            return_logprobs=wants_logprobs)
        n = input_batch.num_reqs
        sampled, acc = self.tree.walk(targets.view(-1), input_batch.cu_num_logits,
                                      input_batch.idx_mapping, n)
        num_sampled = acc.num_accepted.to(torch.int32)

        logprobs = None
        if wants_logprobs:
            src = processed if s.logprobs_mode in ("processed_logprobs",
                                                   "processed_logits") else logits
            src = src[acc.src_logit_row]  # row cu + i = accepted row i
            logprobs = self._logprobs(input_batch, sampled, num_sampled, src)

        num_sampled, num_rejected = get_num_sampled_and_rejected(
            num_sampled, input_batch.seq_lens, input_batch.cu_num_logits,
            input_batch.idx_mapping, s.req_states.prefill_len.gpu)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs,
                             num_nans=num_nans, num_sampled=num_sampled,
                             num_rejected=num_rejected)

    def _logprobs(self, input_batch, sampled, num_sampled, logits):
        fn = self._stock._get_logprobs_tensors
        if "input_batch" in inspect.signature(fn).parameters:  # vLLM 0.26
            return fn(input_batch, sampled, num_sampled, logits)
        from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

        max_lp = self.sampler.sampling_states.max_num_logprobs(input_batch.idx_mapping_np)
        if max_lp == NO_LOGPROBS:
            return None
        return fn(sampled, num_sampled, logits, input_batch.cu_num_logits,
                  input_batch.cu_num_logits_np, max_lp)
