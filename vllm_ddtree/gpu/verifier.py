"""DDTree verification for Model Runner V2: takes the place of vLLM's rejection
sampler (``ModelState.custom_sampler``).

1. The target's own token at every verify row, drawn by vLLM's ``Sampler.sample`` with
   the request's parameters, keyed (seed, position) at the node's tree position
   ``root + depth``: greedy rows take the argmax; at T > 0 each node's token is a draw
   from that node's processed distribution (lossless), and along the accepted path the
   Gumbel noise is the one non-speculative decoding uses at the same positions.
   Batches with sampled rows and no per-request seed instead take the choice rule of
   :mod:`~vllm_ddtree.gpu.verify_sampling` (the same distribution; one full-vocabulary
   draw per request, at the row where its walk stops, instead of one per row): vLLM's
   processing of the logits, then :func:`choose_children`.
2. The walk (:meth:`TreeBuffers.walk`): follow the child equal to the target's token
   (or chosen child), then, on the choice rule, :func:`draw_stop_tokens`.
3. vLLM's ``SamplerOutput``: accepted tokens + bonus, ``num_sampled`` and
   ``num_rejected`` through vLLM's own ``get_num_sampled_and_rejected``.  Logprobs are
   vLLM's own code run on the logits rows permuted to the accepted path.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

from vllm_ddtree.gpu.buffers import TreeBuffers
from vllm_ddtree.gpu.verify_sampling import choose_children, draw_stop_tokens

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.sample.sampler import Sampler


def _returns_logprobs(sampler: Sampler, idx_mapping_np: np.ndarray) -> bool:
    fn = getattr(sampler, "returns_logprobs", None)  # vLLM 0.26
    if fn is not None:
        return fn(idx_mapping_np)
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    return sampler.sampling_states.max_num_logprobs(idx_mapping_np) != NO_LOGPROBS


@functools.lru_cache(maxsize=16)
def _param_names(func: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(func).parameters)


def _params_of(fn: Callable[..., Any]) -> frozenset[str]:
    """The parameter names of ``fn`` (a bound method: of its function, ``self``
    included), read once per function, not every step."""
    return _param_names(getattr(fn, "__func__", fn))


def _call_by_name(fn: Callable[..., Any], **available: Any) -> Any:
    """Call ``fn`` with the arguments its signature names (vLLM versions add and
    reorder arguments of these internal methods).  The signature is read once per
    function, not every step."""
    params = _params_of(fn) - {"self"}
    return fn(**{k: v for k, v in available.items() if k in params})


class DDTreeVerifier:
    # vLLM 0.32+ warm-up reads this flag of the rejection sampler (adaptive verification
    # is refused for DDTree configs: vllm_ddtree.config.check_runner_features)
    enable_adaptive_verification = False

    def __init__(self, sampler: Sampler, vllm_config: VllmConfig, tree_buffers: TreeBuffers,
                 device: torch.device) -> None:
        self.sampler = sampler
        self.tree_buffers = tree_buffers
        # vLLM's rejection sampler, used only for its logprobs helper
        self._stock = RejectionSampler(sampler, vllm_config.speculative_config, device)

    def __call__(
        self,
        logits: torch.Tensor,  # [num_logits, vocab]
        input_batch: InputBatch,
        draft_logits: torch.Tensor | None = None,
        invalid_drafts: Any = None,
        **_: Any,
    ) -> SamplerOutput:
        """vLLM 0.32+ also passes ``invalid_drafts`` (drafts a grammar rejects).  Not
        needed here: requests with a grammar are verified as a chain, and each row's
        target token is drawn from grammar-masked logits, so a draft the grammar rejects
        never equals the target's token and the walk stops before it."""
        sampler = self.sampler
        num_nans = None
        if sampler.compute_nans:
            from vllm.v1.worker.gpu.metrics.logits import get_num_nans

            num_nans = get_num_nans(logits)
        logits_indices = input_batch.logits_indices
        node_tokens = input_batch.input_ids[logits_indices]  # [num_logits]
        node_positions = self.tree_buffers.row_positions[logits_indices]  # root + depth
        seq_lens_upper_bound = input_batch.seq_lens_cpu_upper_bound
        wants_logprobs = _returns_logprobs(sampler, input_batch.idx_mapping_np)
        row_args = dict(
            logits=logits, expanded_idx_mapping=input_batch.expanded_idx_mapping,
            idx_mapping=input_batch.idx_mapping, idx_mapping_np=input_batch.idx_mapping_np,
            pos=node_positions, input_ids=node_tokens,
            expanded_local_pos=input_batch.expanded_local_pos,
            seq_lens_upper_bound_np=(seq_lens_upper_bound.numpy()
                                     if seq_lens_upper_bound is not None else None))
        choice_rule = self._uses_choice_rule(input_batch.idx_mapping_np)
        states = sampler.sampling_states
        tree_buffers = self.tree_buffers
        if choice_rule:
            processed = _call_by_name(sampler.apply_sampling_params, **row_args,
                                      skip_top_k_top_p=False)
            targets = choose_children(
                processed, input_batch.expanded_idx_mapping, input_batch.expanded_local_pos,
                node_positions, states.temperature.gpu, states.seeds.gpu,
                tree_buffers.walk_tokens, tree_buffers.parents)
        else:
            targets, processed = _call_by_name(sampler.sample, **row_args,
                                               return_logprobs=wants_logprobs)
        num_reqs = input_batch.num_reqs
        sampled, accepted = tree_buffers.walk(targets.view(-1), input_batch.cu_num_logits,
                                              input_batch.idx_mapping, num_reqs)
        if choice_rule:
            draw_stop_tokens(processed, targets, sampled, accepted.path, accepted.num_accepted,
                             input_batch.cu_num_logits, input_batch.idx_mapping[:num_reqs],
                             node_positions, tree_buffers.walk_tokens, tree_buffers.parents,
                             self._draw)
        num_sampled = accepted.num_accepted.to(torch.int32)

        logprobs = None
        if wants_logprobs:
            source = processed if sampler.logprobs_mode in ("processed_logprobs",
                                                            "processed_logits") else logits
            source = source[accepted.src_logit_row]  # row cu + i = accepted row i
            logprobs = self._logprobs(input_batch, sampled, num_sampled, source)

        num_sampled, num_rejected = get_num_sampled_and_rejected(
            num_sampled, input_batch.seq_lens, input_batch.cu_num_logits,
            input_batch.idx_mapping, sampler.req_states.prefill_len.gpu)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs,
                             num_nans=num_nans, num_sampled=num_sampled,
                             num_rejected=num_rejected)

    def _uses_choice_rule(self, idx_mapping_np: np.ndarray) -> bool:
        """Host-side: the batch has a sampled request and none with its own seed (a
        seeded request gets the tokens it gets without speculation: every row is drawn
        with vLLM's keyed noise)."""
        states = self.sampler.sampling_states
        return (bool(np.any(states.temperature.np[idx_mapping_np] > 0.0))
                and not states.any_explicit_seed(idx_mapping_np))

    def _draw(
        self,
        rows: torch.Tensor,  # [n, V] processed logits, some entries -inf
        row_states: torch.Tensor,  # [n] int32 request state of each row
        positions: torch.Tensor,  # [n] int64 each row's position
    ) -> torch.Tensor:  # [n] int64
        """vLLM's own draw (its Gumbel noise, keyed (seed, position)) from rows whose
        temperature is already applied."""
        states = self.sampler.sampling_states
        return _call_by_name(gumbel_sample, logits=rows, expanded_idx_mapping=row_states,
                             temperature=states.temperature.gpu, seed=states.seeds.gpu,
                             pos=positions, apply_temperature=False, is_drafting=False,
                             use_fp64=getattr(self.sampler, "use_fp64_gumbel", False))

    def _logprobs(
        self,
        input_batch: InputBatch,
        sampled: torch.Tensor,  # [num_reqs, 1 + budget]
        num_sampled: torch.Tensor,  # [num_reqs] int32
        logits: torch.Tensor,  # [num_logits, vocab] permuted to the accepted path
    ) -> Any:
        get_logprobs = self._stock._get_logprobs_tensors
        if "input_batch" in _params_of(get_logprobs):  # vLLM 0.26
            return get_logprobs(input_batch, sampled, num_sampled, logits)
        from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

        max_num_logprobs = self.sampler.sampling_states.max_num_logprobs(
            input_batch.idx_mapping_np)
        if max_num_logprobs == NO_LOGPROBS:
            return None
        return get_logprobs(sampled, num_sampled, logits, input_batch.cu_num_logits,
                            input_batch.cu_num_logits_np, max_num_logprobs)
