"""DDTree verification for Model Runner V2: takes the place of vLLM's rejection sampler
(``ModelState.custom_sampler``).  One straight pipeline per step:

1. the target's own token at every verify row, drawn by vLLM's ``Sampler.sample`` with
   the request's parameters, keyed (seed, position) at the node's tree position
   ``root + depth``: greedy rows take the argmax; at T > 0 each node's token is a draw
   from that node's processed distribution (lossless), and along the accepted path the
   Gumbel noise is the one non-speculative decoding uses at the same positions.
   An all-greedy batch without top-k/top-p takes that argmax in one launch on vLLM's
   processed logits (``_draw_rule``), not through the sampler's Gumbel kernel.
   Batches with sampled rows and no per-request seed instead take the choice rule of
   :mod:`~vllm_ddtree.gpu.verify_sampling` (the same distribution; one full-vocabulary
   draw per request, at the row where its walk stops, instead of one per row, with the
   plugin's own noise keyed as vLLM keys its own): vLLM's processing of the logits,
   then :func:`choose_children`;
2. the walk (:meth:`TreeStates.walk`): follow the child equal to the target's token (or
   chosen child), then, on the choice rule, :func:`draw_stop_tokens` (two launches, no
   call into vLLM's sampler); the accepted paths go back to the speculator
   (``TargetBinding.on_accepted``);
3. vLLM's ``SamplerOutput``: accepted tokens + bonus, ``num_sampled`` and
   ``num_rejected`` through vLLM's own ``get_num_sampled_and_rejected``.  Logprobs are
   vLLM's own code run on the logits rows permuted to the accepted path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.worker.gpu.input_batch import (
    InputBatch,
    InputBuffers,
    get_num_sampled_and_rejected,
)
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

from vllm_ddtree.gpu.verify_sampling import (
    choose_children,
    draw_stop_tokens,
    warm_choice_rule,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.spec_decode.draft_logits import DraftLogitsCache

    from vllm_ddtree.gpu.target_binding import TargetBinding

_PROCESSED_LOGPROBS = ("processed_logprobs", "processed_logits")


class DDTreeVerifier:
    # vLLM's warm-up reads this flag of the rejection sampler (adaptive verification is
    # refused for DDTree configs: vllm_ddtree.config.check_runner_features)
    enable_adaptive_verification = False

    def __init__(self, sampler: Sampler, vllm_config: VllmConfig, binding: TargetBinding,
                 device: torch.device) -> None:
        self.sampler = sampler
        self.binding = binding
        # vLLM's rejection sampler, used only for its logprobs helper
        self._stock = RejectionSampler(sampler, vllm_config.speculative_config, device)

    def __call__(
        self,
        logits: torch.Tensor,  # [num_logits, vocab]
        input_batch: InputBatch,
        draft_logits: DraftLogitsCache | None = None,  # None: drafts are deterministic
    ) -> SamplerOutput:
        sampler = self.sampler
        trees = self.binding.trees
        num_nans = get_num_nans(logits) if sampler.compute_nans else None
        logits_indices = input_batch.logits_indices
        # [num_logits] each node's token and its position (root + depth)
        node_tokens = input_batch.input_ids[logits_indices]
        node_positions = self.binding.rows.positions[logits_indices]
        row_args = (logits, input_batch.expanded_idx_mapping, input_batch.idx_mapping,
                    input_batch.idx_mapping_np, node_positions, node_tokens,
                    input_batch.expanded_local_pos,
                    input_batch.seq_lens_cpu_upper_bound.numpy())
        logprobs_dims = sampler.get_logprobs_dims(input_batch.idx_mapping_np)
        states = sampler.sampling_states
        rule = self._draw_rule(input_batch.idx_mapping_np)
        choice_rule = rule == "choice"

        # 1. the target's token (or choice) at every row
        if choice_rule:
            processed = sampler.apply_sampling_params(*row_args, skip_top_k_top_p=False)
            targets = choose_children(
                processed, input_batch.expanded_idx_mapping, input_batch.expanded_local_pos,
                node_positions, states.temperature.gpu, states.seeds.gpu, trees.walk_tokens,
                trees.parents)
        elif rule == "argmax":
            # what vLLM's sampler returns for such a batch (its temperature-0 Gumbel
            # kernel is an argmax, the first index on ties, as torch's), in one launch
            processed = sampler.apply_sampling_params(*row_args, skip_top_k_top_p=True)
            targets = processed.argmax(dim=-1)
        else:
            targets, processed = sampler.sample(
                *row_args, return_logprobs=logprobs_dims is not None)

        # 2. the walk, and the stop rows' draws of the choice rule
        num_reqs = input_batch.num_reqs
        sampled, accepted = trees.walk(targets.view(-1), input_batch.cu_num_logits,
                                       input_batch.idx_mapping, num_reqs)
        if choice_rule:
            draw_stop_tokens(processed, targets, sampled, accepted.path, accepted.num_accepted,
                             input_batch.cu_num_logits, input_batch.idx_mapping[:num_reqs],
                             node_positions, trees.walk_tokens, trees.parents,
                             states.seeds.gpu)
        self.binding.on_accepted(accepted)

        # 3. vLLM's output
        num_sampled = accepted.num_accepted.to(torch.int32)
        logprobs = None
        if logprobs_dims is not None:
            source = processed if sampler.logprobs_mode in _PROCESSED_LOGPROBS else logits
            logprobs = self._stock._get_logprobs_tensors(
                sampled, num_sampled, source[accepted.src_logit_row],  # row i = path row i
                input_batch.cu_num_logits, input_batch.cu_num_logits_np,
                input_batch.expanded_idx_mapping, logprobs_dims)
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            num_sampled, input_batch.seq_lens, input_batch.cu_num_logits,
            input_batch.idx_mapping, sampler.req_states.prefill_len.gpu)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs,
                             num_nans=num_nans, num_sampled=num_sampled,
                             num_rejected=num_rejected)

    def warm_up(self, logits: torch.Tensor) -> None:  # [n >= 1, vocab] the model's logits
        """Compile the choice rule's kernels for the model's own logits
        (:func:`~vllm_ddtree.gpu.verify_sampling.warm_choice_rule`); called from vLLM's
        dummy sampler run at start-up.  The index tensors come from vLLM's own dummy
        batch, so the launches take the dtypes a step's input batch has."""
        batch = InputBatch.make_dummy(1, 1, InputBuffers(1, 1, logits.device))
        trees, states = self.binding.trees, self.sampler.sampling_states
        warm_choice_rule(logits, batch.expanded_idx_mapping, batch.expanded_local_pos,
                         batch.idx_mapping, batch.cu_num_logits, self.binding.rows.positions[:1],
                         states.temperature.gpu, states.seeds.gpu, trees.walk_tokens,
                         trees.parents, trees.max_depth)

    def _draw_rule(self, idx_mapping_np: np.ndarray) -> str:
        """Host-side, how the batch's rows get their tokens: ``"argmax"`` where every
        request is greedy and none sets top-k or top-p (vLLM's sampler would mask
        the processed logits with them before its argmax); ``"choice"`` (the choice
        rule) where a request samples and none has its own seed (a seeded request gets
        the tokens it gets without speculation: every row is drawn with vLLM's keyed
        noise); else ``"sample"``, vLLM's sampler at every row."""
        states = self.sampler.sampling_states
        # ndarray methods, not np.any/np.all: a few µs less a step.  Temperatures are
        # >= 0, top-k <= the vocabulary and top-p <= 1 (vLLM clamps and validates them).
        if states.temperature.np[idx_mapping_np].any():
            return "sample" if states.any_explicit_seed(idx_mapping_np) else "choice"
        if idx_mapping_np.size == 0:  # nothing to draw (min() of nothing raises)
            return "argmax"
        plain = (states.top_k.np[idx_mapping_np].min() == states.vocab_size
                 and states.top_p.np[idx_mapping_np].min() == 1.0)
        return "argmax" if plain else "sample"
