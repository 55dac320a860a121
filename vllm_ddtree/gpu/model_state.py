"""Target-side DDTree hooks for vLLM's Model Runner V2, through its ModelState
interface (the target model returns this class from ``get_model_state_cls``, set by
:class:`~vllm_ddtree.gpu.speculator.DDTreeSpeculator.load_model`).

* ``prepare_attn``: every verify row's ancestor bits and RoPE position
  (root + depth) go to persistent buffers; KV slots stay linear (vLLM computed them);
* ``prepare_inputs`` / ``prepare_dummy_inputs``: RoPE reads the tree positions (one
  persistent buffer, so FULL CUDA graphs replay with the current step's values);
* ``custom_sampler``: the verifier (:class:`~vllm_ddtree.gpu.verifier.DDTreeVerifier`);
* ``add_request``: requests whose sampling features need a linear history are
  verified as a chain (logged once per reason); the slot's previous tree is cleared.
"""

from __future__ import annotations

from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from vllm.logger import init_logger
from vllm_ddtree.gpu import buffers as state_mod
from vllm_ddtree.gpu.buffers import needs_chain

_logger = init_logger(__name__)
_logged: set[str] = set()
# vLLM's kernel warm-up requests (``v1/worker/gpu/warmup.py``: ids ``_warmup_{i}_`` with
# ``SamplingParams.for_sampler_warmup()``, penalties included; 0.26 and 0.32 checked):
# verified as a chain like any other, but not logged, so the one-time warning is left for
# the first real request that needs it.
_WARMUP_PREFIX = "_warmup_"


class DDTreeModelState(DefaultModelState):
    def __init__(self, vllm_config, model, encoder_cache, device):
        super().__init__(vllm_config, model, encoder_cache, device)
        if self.rope_state is not None:
            raise NotImplementedError(
                "vllm-ddtree: targets with multimodal RoPE (M-RoPE/XD-RoPE) are not "
                "supported yet; use method 'dflash' for this model.")
        self.tree = state_mod.ACTIVE
        if self.tree is None:
            raise RuntimeError("vllm-ddtree: DDTreeModelState without a DDTree speculator")
        # vLLM 0.32+ loads engine-wide logits processors into the sampler; they read each
        # row's history as linear, so every request is verified as a chain
        self._engine_chain = ("custom logits processors (model_config.logits_processors)"
                              if getattr(vllm_config.model_config, "logits_processors", None)
                              else None)

    def add_request(self, req_index, new_req_data) -> None:
        super().add_request(req_index, new_req_data)
        # the slot's previous request left its tree here; a placeholder-draft step before
        # this request's first tree must accept nothing (no host sync: a device fill)
        self.tree.walk_tokens[req_index].fill_(-1)
        reason = self._engine_chain or needs_chain(getattr(new_req_data, "sampling_params",
                                                           None))
        self.tree.chain_flag[req_index] = reason is not None
        if (reason is not None and reason not in _logged
                and not str(getattr(new_req_data, "req_id", "")).startswith(_WARMUP_PREFIX)):
            _logged.add(reason)
            _logger.warning(
                "vllm-ddtree: requests with %s are verified as a linear chain (the "
                "drafter's top-1 path): exact, fewer accepted tokens; logged once.", reason)

    def prepare_inputs(self, input_batch, req_states):
        return {"positions": self.tree.rope[: input_batch.num_tokens_after_padding]}

    def prepare_dummy_inputs(self, num_reqs, num_tokens):
        inputs = super().prepare_dummy_inputs(num_reqs, num_tokens)
        inputs["positions"] = self.tree.rope[:num_tokens]
        return inputs

    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings,
                     attn_groups, kv_cache_config, for_capture=False, **kwargs):
        self.tree.fill_rows(input_batch.query_start_loc, input_batch.cu_num_logits,
                            input_batch.idx_mapping, input_batch.positions,
                            input_batch.num_reqs, input_batch.num_tokens_after_padding)
        self.tree.step_has_trees = bool(for_capture or input_batch.num_draft_tokens > 0)
        return super().prepare_attn(input_batch, cudagraph_mode, block_tables, slot_mappings,
                                    attn_groups, kv_cache_config, for_capture=for_capture,
                                    **kwargs)

    def custom_sampler(self, sampler):
        from vllm_ddtree.gpu.verifier import DDTreeVerifier

        return sampler, DDTreeVerifier(sampler, self.vllm_config, self.tree, self.device)
