"""DDTree proposer for vLLM's V1 runner: vLLM's own DFlash drafter, then a tree.

Thin adapter over ``vllm.v1.spec_decode.dflash.DFlashProposer``:

* the drafter pass runs unchanged with ``D`` query slots; ``_sample_draft_tokens`` keeps
  its per-depth logits;
* ``propose`` builds the best-first tree of ``B`` nodes and returns its tokens in
  topological order as the ``B`` draft tokens the scheduler sees;
* before the drafter pass, each request's context rows are reordered so that the rows
  of the accepted path come first, with linear positions (stock DFlash keeps the first
  ``k + 1`` verify rows and drops the rest as rejected).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.adaptive.publisher import make_publisher
from vllm_ddtree.config import ddtree_params
from vllm_ddtree.cpu.tree_store import ScheduledTree, TreeStore
from vllm_ddtree.drafter_faults import NonfiniteDraftLog
from vllm_ddtree.logger import init_logger
from vllm_ddtree.support import chain_reason
from vllm_ddtree.tree import build_tree, drop_nonfinite

logger = init_logger(__name__)


def _falls_back(reason: str) -> bool:
    logger.warning_once(
        "vllm-ddtree: a batch with %s is not verified as a tree: greedy batches as a "
        "linear chain by vLLM's rejection sampler (exact, fewer accepted tokens), "
        "sampled (T > 0) batches accept no drafts and sample exactly as without "
        "speculation; logged once per reason.",
        reason)
    return False


class BatchLogitsProcs:
    """The runner's vLLM logits processors, sorted once.

    vLLM 0.32 builds them with the runner (``build_logitsprocs``) and keeps the same
    instances for the engine's life (an input batch rebuilt for the KV block sizes takes
    them over), so which ones are vLLM's built-ins is decided here, at construction; per
    step only the built-ins' per-request state is read.  Min-p is applied per node by the
    verifier; logit bias and min-tokens make a batch fall back while a request uses them;
    any other processor always does."""

    def __init__(self, logitsprocs: LogitsProcessors) -> None:
        self._min_p: MinPLogitsProcessor | None = None
        # in vLLM's order: (the reason a batch falls back, whether that holds this step)
        self._blocking: list[tuple[str, Callable[[], bool]]] = []
        for proc in logitsprocs.all:
            reason = f"an active logits processor ({type(proc).__name__})"
            if type(proc) is MinPLogitsProcessor:
                self._min_p = proc
            elif type(proc) is LogitBiasLogitsProcessor:
                self._blocking.append((reason, _has_biases(proc)))
            elif type(proc) is MinTokensLogitsProcessor:
                self._blocking.append((reason, _has_min_tokens(proc)))
            else:
                self._blocking.append((reason, _always))

    def blocking_reason(self) -> str | None:
        """Why this step's batch cannot be verified as trees, or None."""
        for reason, active in self._blocking:
            if active():
                return reason
        return None

    def min_p(self, num_reqs: int) -> torch.Tensor | None:  # [num_reqs] float32
        """Per-request min-p (CPU tensor) when any request uses it, else None."""
        proc = self._min_p
        if proc is None or proc.min_p_count == 0:
            return None
        return torch.tensor([proc.get_min_p_by_index(i) for i in range(num_reqs)])


def _has_biases(proc: LogitBiasLogitsProcessor) -> Callable[[], bool]:
    """Whether a request of the batch has a logit bias (vLLM keeps one entry each)."""
    return lambda: len(proc.biases) > 0


def _has_min_tokens(proc: MinTokensLogitsProcessor) -> Callable[[], bool]:
    """Whether a request of the batch is still short of its min_tokens."""
    return lambda: len(proc.min_toks) > 0


def _always() -> bool:
    """A logits processor that is not vLLM's: its state is unknown, so always active."""
    return True


def tree_eligible(sampling_metadata: SamplingMetadata, logits_procs: BatchLogitsProcs,
                  batch_params: Iterable[Any]) -> bool:
    """True when every request in the batch can be verified as a tree.

    Each node's target token is drawn from that node's own distribution (temperature,
    top-k, top-p, min-p, per-request seeds).  A request whose sampling state reads the
    draft rows as one history (:func:`vllm_ddtree.support.chain_reason`, checked on
    ``batch_params``, the batch's ``SamplingParams``), and the features this path does not
    apply per node (logprobs, allowed-token masks, and the logits processors
    ``logits_procs`` finds active: logit bias, min-tokens, any other) make the whole batch
    fall back (logged once): greedy batches are verified as a linear chain by vLLM's own
    rejection sampler, sampled batches accept no drafts and draw one token per request
    with vLLM's sampler (``DDTreeCPUModelRunner._sample_roots``).
    """
    for params in batch_params:
        reason = chain_reason(params)
        if reason is not None:
            return _falls_back(reason)
    metadata = sampling_metadata
    if metadata.max_num_logprobs is not None:
        return _falls_back("logprobs requested")
    if metadata.allowed_token_ids_mask is not None:
        return _falls_back("allowed_token_ids")
    reason = logits_procs.blocking_reason()
    if reason is not None:
        return _falls_back(reason)
    return True


@dataclass
class AcceptedPath:
    """One request's accepted verify rows, as the verifier hands them to the drafter."""

    start: int  # the root's row in the verify step's flattened token batch
    rows: list[int]  # accepted verify rows relative to ``start``, root first (0 = root)


class DDTreeProposer(DFlashProposer):
    """vLLM's DFlash drafter that proposes trees (see the module docstring).

    Its runner hands it, at construction, what it reads while proposing:
    ``batch_req_ids()`` (the request ids of the batch, in batch order),
    ``batch_params()`` (their ``SamplingParams``) and ``logits_procs`` (the runner's
    logits processors, :class:`BatchLogitsProcs`).  Per step the runner asks it which
    tree the scheduled drafts are (:meth:`scheduled_tree`), tells it the finished
    requests (:meth:`forget`) and, after a tree verify, the accepted paths
    (:meth:`accept_paths`)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        *,
        batch_req_ids: Callable[[], Sequence[str]] | None = None,
        batch_params: Callable[[], Sequence[Any]] | None = None,
        logits_procs: BatchLogitsProcs | None = None,
    ) -> None:
        super().__init__(vllm_config, device)
        if batch_req_ids is None or batch_params is None or logits_procs is None:
            raise TypeError("DDTreeProposer needs its runner's batch_req_ids, "
                            "batch_params and logits_procs")
        params = ddtree_params(vllm_config.speculative_config)
        self.budget, self.depth = params.budget, params.depth
        self._batch_req_ids = batch_req_ids
        self._batch_params = batch_params
        self._logits_procs = logits_procs
        self._trees = TreeStore()
        self._accepted_paths: dict[int, AcceptedPath] = {}  # request index -> its path
        self._draft_logits: torch.Tensor | None = None  # [num_reqs * depth, vocab]
        self.nonfinite_drafts = 0  # request-steps whose draft logits held NaN/inf
        self._nonfinite_log = NonfiniteDraftLog()
        self.online = make_publisher(vllm_config, device,
                                     vllm_config.scheduler_config.max_num_seqs)

    @property
    def draft_layer_names(self) -> frozenset[str]:
        """The drafter's attention layers (those with a KV cache), as vLLM's
        ``load_model`` found them: read only after the drafter is loaded."""
        return frozenset(self._draft_attn_layer_names)

    # -- the runner's hand-offs ---------------------------------------------------
    def scheduled_tree(self, req_id: str, draft_token_ids: Sequence[int]) -> ScheduledTree:
        """The tree that the scheduled drafts of ``req_id`` form (see
        :meth:`~vllm_ddtree.cpu.tree_store.TreeStore.lookup`)."""
        return self._trees.lookup(req_id, draft_token_ids)

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the stored trees of finished requests."""
        self._trees.forget(req_ids)

    def accept_paths(self, paths: dict[int, AcceptedPath]) -> None:
        """The accepted paths of this step's tree verify, by request index (empty for a
        step that verified no tree); the next :meth:`propose` reads them once."""
        self._accepted_paths = paths

    # -- vLLM's DFlashProposer overrides -----------------------------------------
    def _sample_draft_tokens(
        self,
        hidden_states: torch.Tensor,  # [num_reqs * depth, hidden_size]
        sampling_metadata: SamplingMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [num_reqs * depth] draft ids, probs
        if self.use_heterogeneous_vocab:  # draft-vocabulary ids: keep vLLM's mapping, chain
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        logits = self.model.compute_logits(hidden_states)
        self._draft_logits = logits
        return logits.argmax(dim=-1), None

    def _linearize_context(
        self,
        target_hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        target_positions: torch.Tensor,  # [num_tokens]
        common_attn_metadata: CommonAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # hidden states (in place), positions
        """Move each request's accepted rows to the front, with linear positions."""
        paths, self._accepted_paths = self._accepted_paths, {}
        if not paths:
            return target_hidden_states, target_positions
        query_start = common_attn_metadata.query_start_loc_cpu.tolist()
        positions = target_positions.clone()
        for index, path in paths.items():
            first, end = query_start[index], query_start[index + 1]
            if first != path.start:
                raise RuntimeError(
                    f"DDTree: request {index} moved from row {path.start} to {first}")
            accepted = set(path.rows)
            rejected = [row for row in range(end - first) if row not in accepted]
            order = torch.tensor(path.rows + rejected, dtype=torch.long) + first
            target_hidden_states[first:end] = target_hidden_states[order]
            positions[first:end] = positions[first] + torch.arange(end - first,
                                                                   dtype=positions.dtype)
        return target_hidden_states, positions

    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,  # [num_tokens]
        target_positions: torch.Tensor,  # [num_tokens]
        target_hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        next_token_ids: torch.Tensor,  # [num_reqs]
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: CommonAttentionMetadata,
        sampling_metadata: SamplingMetadata,
        # (each multimodal item's embeddings, [num_tokens] bool: rows they fill)
        mm_embed_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,  # [num_reqs]
        # layer name -> [num_tokens] KV slot per row (a list of those: one per micro-batch)
        slot_mappings: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]] | None = None,
    ) -> torch.Tensor:  # [num_reqs, num_speculative_tokens] or [num_reqs, depth] (chain)
        """vLLM's V1 runner calls this as it calls ``SpecDecodeBaseProposer.propose``
        (all by keyword); the drafter pass gets ``depth`` query slots."""
        target_hidden_states, target_positions = self._linearize_context(
            target_hidden_states, target_positions, common_attn_metadata)
        depth = min(self.depth, num_speculative_tokens)
        self._draft_logits = None
        chain = super().propose(
            depth, target_token_ids, target_positions, target_hidden_states,
            next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
            mm_embed_inputs=mm_embed_inputs, num_rejected_tokens_gpu=num_rejected_tokens_gpu,
            slot_mappings=slot_mappings)
        self.num_speculative_tokens = num_speculative_tokens
        num_reqs = chain.shape[0]
        req_ids = list(self._batch_req_ids()[:num_reqs])
        if depth == 0 or self._draft_logits is None or not tree_eligible(
                sampling_metadata, self._logits_procs, self._batch_params()):
            self._trees.forget(req_ids)
            return chain
        logits = self._draft_logits.view(num_reqs, depth, -1)
        if self.online is None:
            tree = build_tree(logits, min(self.budget, num_speculative_tokens))
        else:  # the full tree's expectations for every candidate budget, then its prefix
            tree = build_tree(logits, self.budget)
        self.nonfinite_drafts += int(drop_nonfinite(tree, logits).sum())  # CPU: no sync
        if self.online is not None:
            self.online.store(tree.scores)
            self.online.publish(num_reqs)
            tree = tree.prefix(num_speculative_tokens)
        self._nonfinite_log.report(self.nonfinite_drafts)
        self._trees.put(req_ids, tree)
        # Slots past a tree's last node (only when the vocabulary is tiny) are scheduled
        # but never accepted: give them a real token id.
        return tree.token_ids.clamp(min=0)
