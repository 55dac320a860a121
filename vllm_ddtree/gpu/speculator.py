"""DDTree speculator for vLLM's Model Runner V2 (GPU): vLLM's DFlash speculator with a
tree instead of a chain.

Subclass of ``DFlashSpeculator``; only four of its methods are extended:

* ``__init__``: the drafter pass keeps ``1 + D`` query rows per request while the
  scheduler sees ``B`` draft tokens (``num_speculative_tokens = B``);
* ``init_cudagraph_manager``: the drafter's graphs are captured for that one width even
  when the budget varies per batch size (``ddtree_adaptive_budget``);
* ``_generate_draft`` (captured in vLLM's FULL CUDA graph): the drafter's ``D``
  per-depth logits -> :func:`build_tree` on the GPU -> ``B`` draft tokens plus the
  tree metadata (:class:`TreeBuffers`);
* ``propose``: before the drafter pass, compact the target KV of the accepted path and
  move the accepted rows' hidden states first (stock DFlash then treats them as the
  first ``k + 1`` verify rows); after it, chain fallbacks and the scatter of the
  tree metadata to request states.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree.adaptive.publisher import make_publisher
from vllm_ddtree.config import ddtree_params
from vllm_ddtree.drafter_faults import NonfiniteDraftLog
from vllm_ddtree.gpu import buffers as state_mod
from vllm_ddtree.gpu.buffers import TreeBuffers
from vllm_ddtree.gpu.verify_rows import KVCompactor
from vllm_ddtree.tree import build_tree

_logger = init_logger(__name__)


class DDTreeSpeculator(DFlashSpeculator):
    _speculator_name = "DDTree"

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.budget, self.depth = ddtree_params(self.speculative_config)
        if self.num_speculative_steps != self.budget:
            raise ValueError("vllm-ddtree: num_speculative_tokens must equal the tree budget")
        if self.draft_logits is not None:
            raise ValueError("vllm-ddtree: draft_sample_method='probabilistic' is not "
                             "supported (the tree is built from the drafter's marginals)")
        self.num_query_per_req = 1 + self.depth  # bonus + D mask tokens
        self.tree = TreeBuffers(self.max_num_reqs, self.max_num_tokens, self.budget,
                                self.depth, device)
        state_mod.ACTIVE = self.tree
        self._compactors: list[tuple[str, KVCompactor]] | None = None
        # NaN/inf drafter logits: the device counter reaches the host by an asynchronous
        # copy into pinned memory, read one step later (no sync)
        self._nonfinite_host = torch.zeros(1, dtype=torch.int64).pin_memory()
        self._nonfinite_log = NonfiniteDraftLog()
        # ddtree_adaptive_budget="online": per-step expectations for the scheduler (no sync)
        self.online = make_publisher(vllm_config, device, self.max_num_reqs)

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        """vLLM's graph manager reads a per-batch-size schedule as "this pass has
        ``1 + budget`` query rows per request" (true of the DFlash chain).  The DDTree
        drafter pass has ``1 + D`` rows whatever the budget: vLLM 0.26 derived negative
        widths from the schedule (``1 + D - B + b``) and failed its capture assertion;
        0.32+ skip the schedule only when ``1 + D <= B``.  Hide it while the manager
        is built, so the drafter's graphs are the ``1 + D`` ones for every version."""
        spec = self.vllm_config.speculative_config
        schedule = spec.num_speculative_tokens_per_batch_size
        spec.num_speculative_tokens_per_batch_size = None
        try:
            super().init_cudagraph_manager(cudagraph_mode)
        finally:
            spec.num_speculative_tokens_per_batch_size = schedule

    # -- load --------------------------------------------------------------------------
    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        self.tree.draft_layer_names = frozenset(self.draft_attn_layer_names)
        self._install_tree_attention()
        from vllm_ddtree.gpu.model_state import DDTreeModelState

        # vLLM picks the target's ModelState through this hook (runs after this call).
        target_model.get_model_state_cls = lambda: DDTreeModelState

    def _install_tree_attention(self) -> None:
        """Target attention layers: FlashAttention -> its tree-aware subclasses (per
        instance; vLLM builds metadata builders from ``layer.get_attn_backend()`` later)."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
        from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend,
                                                           FlashAttentionImpl)

        from vllm_ddtree.gpu.attention import (DDTreeFlashAttentionBackend,
                                               DDTreeFlashAttentionImpl, check_target_layer)

        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        for name, layer in layers.items():
            if name in self.tree.draft_layer_names:
                continue
            if layer.attn_backend is FlashAttentionBackend and \
                    type(layer.impl) is FlashAttentionImpl:
                layer.attn_backend = DDTreeFlashAttentionBackend
                layer.impl.__class__ = DDTreeFlashAttentionImpl
            check_target_layer(name, layer.impl)

    # -- drafter pass (inside vLLM's FULL CUDA graph) ------------------------------------
    def _generate_draft(self, num_reqs, num_tokens_padded, attn_metadata, slot_mappings,
                        num_tokens_across_dp, cudagraph_runtime_mode=CUDAGraphMode.NONE):
        hidden = self._run_model(num_tokens_padded, attn_metadata, slot_mappings,
                                 num_tokens_across_dp, cudagraph_runtime_mode)
        B, D = self.budget, self.depth
        rows = self.sample_indices[: num_reqs * B].view(num_reqs, B)[:, :D].reshape(-1)
        logits = self.model.compute_logits(hidden[rows]).view(num_reqs, D, -1)
        tree = build_tree(logits, B)
        self.tree.store_batch(tree, logits, self.draft_tokens)
        if self.online is not None:
            self.online.store(tree.scores)

    # -- one step ----------------------------------------------------------------------
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, *args, **kwargs):
        dummy = kwargs.get("dummy_run", False)
        # vLLM 0.33 skips the drafter's query pass in steps that need no drafts
        # (num_speculative_tokens=0): no new trees, so nothing to commit or publish
        skip = kwargs.get("num_speculative_tokens") == 0
        acc = self.tree.take_accepted()
        if acc is not None and not dummy:
            self._compact(acc, input_batch, slot_mappings)
            rows = aux_hidden_states[0].shape[0] if aux_hidden_states else \
                last_hidden_states.shape[0]
            perm = torch.arange(rows, device=self.device)
            li = input_batch.logits_indices.long()
            perm[li] = li[acc.src_logit_row]
            if aux_hidden_states:
                aux_hidden_states = [torch.cat(aux_hidden_states, dim=-1)[perm]]
            else:
                last_hidden_states = last_hidden_states[perm]
        out = super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states,
                              aux_hidden_states, num_sampled, num_rejected, *args, **kwargs)
        if dummy:  # warm-up/capture inputs are not a drafter failure
            self.tree.nonfinite.zero_()
        elif not skip:
            self._report_nonfinite()
            n = input_batch.num_reqs
            chain_rows = np.flatnonzero(self.tree.chain_flag[input_batch.idx_mapping_np[:n]])
            if chain_rows.size:  # host flags only: no device read
                # pinned + non_blocking: an asynchronous copy (pageable memory would sync)
                rows = torch.from_numpy(chain_rows.astype(np.int64)).pin_memory().to(
                    self.device, non_blocking=True)
                self.tree.apply_chain_fallback(rows, self.draft_tokens)
            self.tree.commit(input_batch.idx_mapping, n)
            if self.online is not None:
                self.online.publish(n)
        return out

    def _report_nonfinite(self) -> None:
        seen = int(self._nonfinite_host[0])  # written by an earlier step's async copy
        self._nonfinite_log.report(seen)
        self._nonfinite_host.copy_(self.tree.nonfinite, non_blocking=True)

    def _compact(self, acc, input_batch, slot_mappings) -> None:
        """Copy each accepted node's target K/V to the slot of its depth, in every
        target attention layer (grouped by slot mapping = KV-cache group)."""
        if self._compactors is None:
            self._compactors = self._make_compactors(slot_mappings)
        li = input_batch.logits_indices
        cu = input_batch.cu_num_logits
        for layer_name, comp in self._compactors:
            comp(slot_mappings[layer_name], li, cu, acc.path, acc.num_accepted, acc.num_reqs)

    def _make_compactors(self, slot_mappings) -> list[tuple[str, KVCompactor]]:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        groups: dict[int, list[str]] = {}
        for name in layers:
            if name in self.tree.draft_layer_names:
                continue
            groups.setdefault(id(slot_mappings[name]), []).append(name)
        out = []
        for names in groups.values():
            caches = []
            for name in names:
                kv = layers[name].kv_cache
                kv = kv[0] if isinstance(kv, (list, tuple)) else kv
                caches.append(kv.transpose(1, 2))  # [blocks, block_size, heads, 2*hd]
            out.append((names[0], KVCompactor(caches)))
        _logger.info("vllm-ddtree: KV compaction over %d target layers in %d group(s)",
                     sum(len(n) for n in groups.values()), len(groups))
        return out
