"""Target-side DDTree hooks for vLLM's Model Runner V2, through its ModelState interface.

The engine's speculator binds its
:class:`~vllm_ddtree.gpu.target_binding.TargetBinding` to the target model at load time
(:func:`vllm_ddtree._patch.target_model.bind_model_state`); vLLM then builds the model
state as ``DDTreeModelState(vllm_config, model, encoder_cache, device)`` with that same
model.

* ``prepare_attn``: the step's verify rows (every row's ancestor bits and RoPE position,
  every request's prefix length) in one launch (:meth:`TreeStates.fill_rows`); KV slots
  stay linear (vLLM computed them); metadata is built for the target's attention groups
  only;
* ``prepare_inputs`` / ``prepare_dummy_inputs``: RoPE reads the tree positions (one
  persistent buffer, so FULL CUDA graphs replay with the current step's values);
* ``custom_sampler``: the verifier (:class:`~vllm_ddtree.gpu.verifier.DDTreeVerifier`);
  ``dummy_sampler_run`` (vLLM's start-up sampler pass) has it compile its kernels for
  the model's logits dtype;
* ``add_request``: the slot's previous tree is dropped, and requests whose sampling
  features read a linear history are verified as a chain (logged once per reason).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from vllm_ddtree._patch.target_model import bound_state
from vllm_ddtree.gpu.target_binding import TargetBinding
from vllm_ddtree.logger import init_logger
from vllm_ddtree.support import chain_reason, refuse_multimodal_rope

if TYPE_CHECKING:
    import torch.nn as nn
    from vllm.config import VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.states import RequestState
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_ddtree.gpu.verifier import DDTreeVerifier

logger = init_logger(__name__)

# vLLM's sampler warm-up requests (``v1/worker/gpu/warmup.py``: ids ``_warmup_{i}_`` with
# ``SamplingParams.for_sampler_warmup()``, penalties included): verified as a chain like
# any other, but not logged, so the one-time warning is left for the first real request
# that needs it.
_WARMUP_PREFIX = "_warmup_"


class DDTreeModelState(DefaultModelState):
    def __init__(self, vllm_config: VllmConfig, model: nn.Module,
                 encoder_cache: Any | None, device: torch.device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        refuse_multimodal_rope(self.rope_state is not None)
        self.binding: TargetBinding = bound_state(model)
        # engine-wide logits processors read each row's history as linear, so every
        # request is verified as a chain
        self._engine_chain = ("custom logits processors (model_config.logits_processors)"
                              if vllm_config.model_config.logits_processors else None)
        # (vLLM's attention groups, the target's groups among them): see prepare_attn
        self._target_groups: tuple[list, list] | None = None
        self._verifier: DDTreeVerifier | None = None  # built by custom_sampler

    def add_request(self, req_index: int, new_req_data: NewRequestData) -> None:
        super().add_request(req_index, new_req_data)
        reason = self._engine_chain or chain_reason(new_req_data.sampling_params)
        self.binding.trees.add_request(req_index, reason is not None)
        if reason is not None and not new_req_data.req_id.startswith(_WARMUP_PREFIX):
            logger.warning_once(
                "vllm-ddtree: requests with %s are verified as a linear chain (the "
                "drafter's top-1 path): exact, fewer accepted tokens; logged once.", reason)

    def prepare_inputs(self, input_batch: InputBatch,
                       req_states: RequestState) -> dict[str, torch.Tensor | None]:
        return {"positions": self.binding.rows.positions[
            : input_batch.num_tokens_after_padding]}

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict[str, Any]:
        inputs = super().prepare_dummy_inputs(num_reqs, num_tokens)
        inputs["positions"] = self.binding.rows.positions[:num_tokens]
        return inputs

    def prepare_attn(
        self,
        input_batch: InputBatch,
        cudagraph_mode: CUDAGraphMode,
        block_tables: tuple[torch.Tensor, ...],
        slot_mappings: torch.Tensor,
        attn_groups: list[list[AttentionGroup]],
        kv_cache_config: KVCacheConfig,
        for_capture: bool = False,
        ubatch_idx: int = 0,
        model_specific_attn_metadata: Any = None,
    ) -> dict[str, Any]:
        self.binding.trees.fill_rows(
            self.binding.rows, input_batch.query_start_loc, input_batch.cu_num_logits,
            input_batch.idx_mapping, input_batch.positions, input_batch.seq_lens,
            input_batch.num_reqs, input_batch.num_reqs_after_padding,
            input_batch.num_tokens_after_padding,
            has_trees=for_capture or input_batch.num_draft_tokens > 0)
        return super().prepare_attn(input_batch, cudagraph_mode, block_tables, slot_mappings,
                                    self._target_attn_groups(attn_groups), kv_cache_config,
                                    for_capture, ubatch_idx, model_specific_attn_metadata)

    def _target_attn_groups(
        self, attn_groups: list[list[AttentionGroup]]
    ) -> list[list[AttentionGroup]]:
        """``attn_groups`` (per KV-cache group) without the drafter's groups.  The
        drafter's layers share the target's KV-cache groups but not its backend (they
        keep vLLM's FlashAttention), so vLLM gives them attention groups of their own;
        the target step would build their metadata and never read it (the drafter
        builds its own in ``propose``).  Filtered once per list of groups (vLLM keeps
        one for the runner's life)."""
        cached = self._target_groups
        if cached is None or cached[0] is not attn_groups:
            from vllm_ddtree.gpu.attention import DDTreeFlashAttentionBackend

            target = [[g for g in groups if g.backend is DDTreeFlashAttentionBackend]
                      for groups in attn_groups]
            cached = self._target_groups = (attn_groups, target)
        return cached[1]

    def custom_sampler(self, sampler: Any) -> tuple[Any, DDTreeVerifier]:
        from vllm_ddtree.gpu.verifier import DDTreeVerifier

        self._verifier = DDTreeVerifier(sampler, self.vllm_config, self.binding, self.device)
        return sampler, self._verifier

    def dummy_sampler_run(self, sampler: Any, hidden_states: torch.Tensor) -> bool:
        # vLLM's warm-up compiles the verifier's kernels for float32 logits only; the
        # model's own logits dtype is compiled here (DDTreeVerifier.warm_up).  False:
        # vLLM's default dummy sampler run follows.
        if self._verifier is not None:
            self._verifier.warm_up(self.compute_sample_logits(hidden_states[:1]))
        return False
