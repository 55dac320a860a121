"""DDTree speculator for vLLM's Model Runner V2 (GPU): vLLM's DFlash speculator with a
tree instead of a chain.

Subclass of ``DFlashSpeculator`` (named by
:class:`~vllm_ddtree.gpu.speculator_config.DDTreeSpeculatorConfig`); it owns its engine's
:class:`~vllm_ddtree.gpu.tree_state.TreeStates` and
:class:`~vllm_ddtree.gpu.step_rows.StepRows` and extends four of its methods:

* ``__init__``: the drafter pass keeps ``1 + D`` query rows per request while the
  scheduler sees ``B`` draft tokens (``num_speculative_tokens = B``);
* ``load_model``: hands its state to the rest of this runner's DDTree pieces through
  vLLM's per-runner objects: the target model (vLLM builds the target's ModelState from
  it, which builds the verifier) and the target's attention layers (vLLM builds the
  attention metadata builders from them);
* ``_generate_draft`` (captured in vLLM's FULL CUDA graph): the drafter's ``D``
  per-depth logits -> :func:`build_tree` on the GPU -> ``B`` draft tokens plus the
  tree metadata, stored at each request's state;
* ``propose``: before the drafter pass, compact the target KV of the accepted path and
  move the accepted rows' hidden states first, in place (stock DFlash then treats them
  as the first ``k + 1`` verify rows); after it, the chain fallbacks.

The verifier hands the accepted paths back through :meth:`accept` (called once per
verify step, before the ``propose`` of the same step reads them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree._patch.target_model import bind_model_state, use_tree_attention
from vllm_ddtree.adaptive.publisher import make_publisher
from vllm_ddtree.adaptive.schedule import drafter_budgets
from vllm_ddtree.config import ddtree_params
from vllm_ddtree.gpu.attention import (
    DDTreeFlashAttentionBackend,
    DDTreeFlashAttentionImpl,
    check_target_layer,
)
from vllm_ddtree.gpu.compaction import KVCompactor
from vllm_ddtree.gpu.model_state import DDTreeModelState
from vllm_ddtree.gpu.nonfinite_count import NonfiniteCount
from vllm_ddtree.gpu.step_rows import StepRows
from vllm_ddtree.gpu.target_binding import TargetBinding
from vllm_ddtree.gpu.tree_state import TreeStates
from vllm_ddtree.gpu.walk import Accepted
from vllm_ddtree.logger import init_logger
from vllm_ddtree.tree import DraftTree, build_tree

if TYPE_CHECKING:
    import torch.nn as nn
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu.dp_utils import DPSyncState
    from vllm.v1.worker.gpu.input_batch import InputBatch

logger = init_logger(__name__)


class DDTreeSpeculator(DFlashSpeculator):
    _speculator_name = "DDTree"
    # [max_num_reqs + 1]: the tree a drafter pass of n requests builds (None: the
    # budget), known once the drafter's CUDA graphs are (init_cudagraph_manager); a
    # class default because vLLM's __init__ sizes buffers through methods that read it
    _tree_budgets: list[int] | None = None

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        params = ddtree_params(self.speculative_config)
        self.budget, self.max_depth = params.budget, params.depth
        if self.num_speculative_steps != self.budget:
            raise ValueError("vllm-ddtree: num_speculative_tokens must equal the tree budget")
        if self.use_draft_logits:
            raise ValueError("vllm-ddtree: draft_sample_method='probabilistic' is not "
                             "supported (the tree is built from the drafter's marginals)")
        self.num_query_per_req = 1 + self.max_depth  # bonus + D mask tokens
        schedule = self.speculative_config.num_speculative_tokens_per_batch_size or ()
        self.trees = TreeStates(self.max_num_reqs, self.budget, self.max_depth, device)
        self.step_rows = StepRows(self.max_num_reqs, self.max_num_tokens, self.budget, device,
                                  step_budgets=[b for _, _, b in schedule])
        # the verifier's accepted paths, read once by the next propose
        self._accepted: Accepted | None = None
        self._compactors: list[tuple[str, KVCompactor]] | None = None
        # NaN/inf drafter logits: counted on the device, reported a step later (no sync)
        self._nonfinite = NonfiniteCount(device)
        # ddtree_adaptive_budget="online": per-step expectations for the scheduler (no sync)
        self.online = make_publisher(vllm_config, device, self.max_num_reqs)

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        super().init_cudagraph_manager(cudagraph_mode)
        self._tree_budgets = self._drafter_budgets()

    def _drafter_budgets(self) -> list[int] | None:
        """With a per-batch-size schedule (``num_speculative_tokens_per_batch_size``,
        e.g. ``ddtree_adaptive_budget``), vLLM's scheduler gives each step the budget of
        its batch size and the verify cuts the tree to it (its first ``n`` nodes are the
        best ``n``-node tree): a drafter pass builds only the largest budget its CUDA
        graph serves (:func:`~vllm_ddtree.adaptive.schedule.drafter_budgets`), so the
        tree builds compile at capture.  None (every pass builds the full budget): the
        online policy, which may give any candidate budget at any batch size, and a
        drafter without FULL graphs (one compiled build, at vLLM's profile run)."""
        spec = self.speculative_config
        graphs = self.query_cudagraph_manager
        if (self.online is not None or not spec.num_speculative_tokens_per_batch_size
                or graphs is None or graphs.cudagraph_mode.decode_mode() != CUDAGraphMode.FULL):
            return None
        from vllm.config.compilation import (
            decode_cudagraph_capture_max_tokens,
            decode_cudagraph_capture_shapes,
        )
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        # the scheduler's own lookup: batch size -> draft tokens of its step
        step_budget = build_dynamic_sd_schedule_lookup(
            spec.num_speculative_tokens_per_batch_size, self.max_num_reqs, self.budget)
        # the request counts vLLM captures for the drafter's uniform decode graphs
        compilation = self.vllm_config.compilation_config
        shapes = decode_cudagraph_capture_shapes(
            compilation.decode_cudagraph_capture_request_sizes or (),
            {self.num_query_per_req: self.max_num_reqs},
            decode_cudagraph_capture_max_tokens(compilation))
        return drafter_budgets(step_budget, [n for n, _ in shapes])

    def accept(self, accepted: Accepted) -> None:
        """The verifier's walk of this step (see the module docstring)."""
        self._accepted = accepted

    # -- load --------------------------------------------------------------------------
    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        # vLLM builds the metadata builders from each layer's backend later, and they
        # find the step rows through their layers
        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        for name, layer in layers.items():
            if name not in self.draft_attn_layer_names:
                use_tree_attention(layer, DDTreeFlashAttentionBackend,
                                   DDTreeFlashAttentionImpl, self.step_rows)
                check_target_layer(name, layer.impl)
        # vLLM builds the target's ModelState from target_model after this call
        bind_model_state(target_model, DDTreeModelState,
                         TargetBinding(self.trees, self.step_rows, self.accept))

    # -- drafter pass (inside vLLM's FULL CUDA graph) ------------------------------------
    def _generate_draft(
        self,
        num_reqs: int,
        num_tokens_padded: int,
        attn_metadata: dict[str, Any] | None,
        slot_mappings: dict[str, torch.Tensor] | None,
        num_tokens_across_dp: torch.Tensor | None,
        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    ) -> None:
        # [num_tokens_padded, hidden_size]
        hidden_states = self._run_model(num_tokens_padded, attn_metadata, slot_mappings,
                                        num_tokens_across_dp, cudagraph_runtime_mode)
        tree, draft_logits = self._draft_tree(hidden_states, num_reqs)
        bad = self.trees.store_batch(tree, draft_logits, self.draft_tokens,
                                     self._batch_states(num_reqs))
        self._nonfinite.add(bad)
        if self.online is not None:  # an emptied tree expects nothing
            self.online.store(tree.scores.masked_fill(bad.unsqueeze(1), float("-inf")))

    def _draft_tree(
        self,
        hidden_states: torch.Tensor,  # [num_tokens_padded, hidden_size] the drafter's
        num_reqs: int,
    ) -> tuple[DraftTree, torch.Tensor]:  # num_reqs trees, [num_reqs, max_depth, vocab]
        """The batch's trees and the draft logits they were built from."""
        draft_logits = self.model.compute_logits(
            hidden_states[self._sample_rows(num_reqs)]).view(num_reqs, self.max_depth, -1)
        return build_tree(draft_logits, self._pass_budget(num_reqs)), draft_logits

    def _pass_budget(self, num_reqs: int) -> int:
        """The tree budget of a drafter pass of ``num_reqs`` requests (a Python int:
        fixed in the pass's CUDA graph at capture)."""
        return self.budget if self._tree_budgets is None else self._tree_budgets[num_reqs]

    def _num_graph_context_tokens(self, num_reqs: int) -> int:
        """Target rows a captured drafter pass of ``num_reqs`` requests stores as the
        drafter's context (its combine, K/V projection and RoPE run inside the graph):
        vLLM's rule, one verify per request, at the widest tree the graph's steps verify
        rather than the engine's largest budget, so an adaptive engine's graphs compute
        no padding rows (a step with more target rows, e.g. a prefill, has vLLM store
        the rest before the replay).  While vLLM's ``__init__`` sizes its staging
        buffer, and without a per-batch-size schedule: vLLM's own."""
        if self._tree_budgets is None:
            return super()._num_graph_context_tokens(num_reqs)
        return min(num_reqs * (1 + self._tree_budgets[num_reqs]), self.max_num_tokens)

    def _batch_states(self, num_reqs: int) -> torch.Tensor:  # [num_reqs] int64 view
        """The request state of each batch row of the drafter pass, -1 in rows past the
        batch (CUDA-graph padding): vLLM's DFlash input kernel writes each request's
        state at its first sample row (``budget`` per request) and -1 in the rest, into
        a buffer the pass's graph reads at replay."""
        return self.sample_idx_mapping[: num_reqs * self.budget: self.budget]

    def _sample_rows(self, num_reqs: int) -> torch.Tensor:  # [num_reqs * max_depth]
        """The drafter rows whose logits draft depths 1..D, request-major: vLLM's DFlash
        input kernel lays sample rows out ``budget`` per request, the first D in use."""
        rows = self.sample_indices[: num_reqs * self.budget].view(num_reqs, self.budget)
        return rows[:, : self.max_depth].reshape(-1)

    # -- one step ----------------------------------------------------------------------
    def propose(
        self,
        input_batch: InputBatch,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        # [num_tokens, hidden_size]
        last_hidden_states: torch.Tensor,
        # num_layers x [num_tokens, hidden_size]
        aux_hidden_states: list[torch.Tensor] | None,
        # [num_reqs]
        num_sampled: torch.Tensor,
        # [num_reqs]
        num_rejected: torch.Tensor,
        # [max_num_reqs]
        last_sampled: torch.Tensor,
        # [num_prefill_lookahead, max_num_reqs]
        next_prefill_tokens: torch.Tensor,
        # [max_num_reqs]
        temperature: torch.Tensor,
        # [max_num_reqs]
        seeds: torch.Tensor,
        dp_sync_state: DPSyncState | None = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        is_profile: bool = False,
        num_speculative_tokens: int | None = None,
    ) -> torch.Tensor:  # [num_reqs, budget]
        accepted, self._accepted = self._accepted, None
        if accepted is not None and not dummy_run:
            # the hidden states the drafter reads move with the KV (in place: vLLM reads
            # them only here)
            self._compact(accepted, input_batch, slot_mappings,
                          aux_hidden_states or [last_hidden_states])
        out = super().propose(
            input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
            num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
            dp_sync_state=dp_sync_state, dummy_run=dummy_run,
            skip_attn_for_dummy_run=skip_attn_for_dummy_run, mm_inputs=mm_inputs,
            is_profile=is_profile, num_speculative_tokens=num_speculative_tokens)
        num_reqs = input_batch.num_reqs
        if dummy_run:
            # warm-up inputs are not a drafter failure, and the pass stored the dummy
            # batch's trees at its states (a live request there keeps its bonus token)
            self._nonfinite.reset()
            self.trees.drop_trees(input_batch.idx_mapping[:num_reqs])
        elif num_speculative_tokens != 0:  # 0: vLLM skipped the drafter's query pass
            self._nonfinite.report()
            states_np = input_batch.idx_mapping_np[:num_reqs]
            chain_rows = self.trees.chain_rows(states_np)
            if chain_rows.size:  # host flags only: no device read
                # [2, m] batch rows and their states; pinned + non_blocking: an
                # asynchronous copy (pageable memory would sync)
                rows = torch.from_numpy(np.stack([chain_rows, states_np[chain_rows]]))
                rows = rows.pin_memory().to(self.device, non_blocking=True)
                self.trees.apply_chain_fallback(rows[0], rows[1], self.draft_tokens)
            if self.online is not None:
                self.online.publish(num_reqs)
        return out

    def _compact(
        self,
        accepted: Accepted,
        input_batch: InputBatch,
        slot_mappings: dict[str, torch.Tensor],
        hidden: list[torch.Tensor],  # each [num_tokens, width] read by the drafter
    ) -> None:
        """Copy each accepted node's target K/V to the slot of its depth, in every
        target attention layer (grouped by slot mapping = KV-cache group), and its rows
        of ``hidden`` to the row of its depth (with the first group: one launch)."""
        if self._compactors is None:
            self._compactors = self._make_compactors(slot_mappings)
        for layer_name, compactor in self._compactors:
            compactor(slot_mappings[layer_name], input_batch.logits_indices,
                      input_batch.cu_num_logits, accepted.path, accepted.num_accepted,
                      accepted.num_reqs, hidden)
            hidden = []

    def _make_compactors(
        self, slot_mappings: dict[str, torch.Tensor]
    ) -> list[tuple[str, KVCompactor]]:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        groups: dict[int, list[str]] = {}
        for name in layers:
            if name not in self.draft_attn_layer_names:
                groups.setdefault(id(slot_mappings[name]), []).append(name)
        compactors = []
        for names in groups.values():
            # [blocks, block_size, heads, 2 * head_size] views of each layer's cache
            caches = [layers[name].kv_cache.transpose(1, 2) for name in names]
            compactors.append((names[0], KVCompactor(caches)))
        logger.info("vllm-ddtree: KV compaction over %d target layers in %d group(s)",
                    sum(len(n) for n in groups.values()), len(groups))
        return compactors
