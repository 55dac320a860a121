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

import torch
from vllm.logger import init_logger
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.adaptive.publisher import make_publisher
from vllm_ddtree.config import ddtree_params
from vllm_ddtree.drafter_faults import NonfiniteDraftLog
from vllm_ddtree.cpu.tree_store import TreeStore
from vllm_ddtree.tree import build_tree, drop_nonfinite


_logger = init_logger(__name__)
_logged: set[str] = set()


def _chain(reason: str) -> bool:
    if reason not in _logged:
        _logged.add(reason)
        _logger.warning(
            "vllm-ddtree: a batch with %s is not verified as a tree: greedy batches as a "
            "linear chain by vLLM's rejection sampler (exact, fewer accepted tokens), "
            "sampled (T > 0) batches accept no drafts and sample exactly as without "
            "speculation; logged once per reason.",
            reason)
    return False


def tree_eligible(sampling_metadata, has_structured_output: bool = False) -> bool:
    """True when every request in the batch can be verified as a tree.

    Each node's target token is drawn from that node's own distribution (temperature,
    top-k, top-p, min-p, per-request seeds).  Features whose state depends on the
    generated prefix or that report per-token values (logprobs, penalties, bad words,
    allowed-token masks, logit bias, min-tokens, other logits processors, grammars) make
    the batch fall back (logged once): greedy batches are verified as a linear chain by
    vLLM's own rejection sampler, sampled batches accept no drafts and draw one token per
    request with vLLM's sampler (``DDTreeCPUModelRunner._sample_roots``).
    """
    sm = sampling_metadata
    if has_structured_output:
        return _chain("structured output (a grammar)")
    if sm.max_num_logprobs is not None:
        return _chain("logprobs requested")
    if not sm.no_penalties:
        return _chain("repetition/presence/frequency penalties")
    if sm.bad_words_token_ids:
        return _chain("bad words")
    if sm.allowed_token_ids_mask is not None:
        return _chain("allowed_token_ids")
    for proc in sm.logitsprocs.all:
        if type(proc).__name__ == "MinPLogitsProcessor":
            continue  # applied per node by the verifier
        state = getattr(proc, "biases", None)
        if state is None:
            state = getattr(proc, "min_toks", None)
        if state is None or len(state) > 0:
            return _chain(f"an active logits processor ({type(proc).__name__})")
    return True


def min_p_of(sampling_metadata, num_reqs: int):
    """Per-request min-p (CPU tensor) when any request uses it, else None."""
    for proc in sampling_metadata.logitsprocs.all:
        if type(proc).__name__ == "MinPLogitsProcessor" and proc.min_p_count > 0:
            return torch.tensor([proc.get_min_p_by_index(i) for i in range(num_reqs)])
    return None


class DDTreeProposer(DFlashProposer):
    ddtree_proposer = True  # the only DFlashProposer allowed to serve a DDTree config

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self.budget, self.depth = ddtree_params(vllm_config.speculative_config)
        self.ddtree_runner = runner
        self.store = TreeStore()
        self._draft_logits: torch.Tensor | None = None
        self.nonfinite_drafts = 0  # request-steps whose draft logits held NaN/inf
        self._nonfinite_log = NonfiniteDraftLog()
        self.online = make_publisher(vllm_config, device,
                                       vllm_config.scheduler_config.max_num_seqs)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        if self.use_heterogeneous_vocab:  # draft-vocabulary ids: keep vLLM's mapping, chain
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        logits = self.model.compute_logits(hidden_states)
        self._draft_logits = logits
        return logits.argmax(dim=-1), None

    def _linearize_context(self, target_hidden_states, target_positions, cad):
        """Move each request's accepted rows to the front, with linear positions."""
        paths = self.store.last_paths
        self.store.last_paths = {}
        if not paths:
            return target_hidden_states, target_positions
        qsl = cad.query_start_loc_cpu.tolist()
        positions = target_positions.clone()
        for index, (start, path) in paths.items():
            s, e = qsl[index], qsl[index + 1]
            if s != start:
                raise RuntimeError(f"DDTree: request {index} moved from row {start} to {s}")
            rest = [j for j in range(e - s) if j not in set(path)]
            perm = torch.tensor(path + rest, dtype=torch.long) + s
            target_hidden_states[s:e] = target_hidden_states[perm]
            positions[s:e] = positions[s] + torch.arange(e - s, dtype=positions.dtype)
        return target_hidden_states, positions

    def propose(self, num_speculative_tokens, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, sampling_metadata, *args, **kwargs):
        target_hidden_states, target_positions = self._linearize_context(
            target_hidden_states, target_positions, common_attn_metadata)
        depth = min(self.depth, num_speculative_tokens)
        self._draft_logits = None
        chain = super().propose(depth, target_token_ids, target_positions,
                                target_hidden_states, next_token_ids, token_indices_to_sample,
                                common_attn_metadata, sampling_metadata, *args, **kwargs)
        self.num_speculative_tokens = num_speculative_tokens
        runner = self.ddtree_runner
        req_ids = list(runner.input_batch.req_ids[: chain.shape[0]])
        structured = runner._has_structured_output()
        if depth == 0 or self._draft_logits is None or not tree_eligible(sampling_metadata,
                                                                          structured):
            self.store.put_chains(req_ids)
            return chain
        bs = chain.shape[0]
        logits = self._draft_logits.view(bs, depth, -1)
        if self.online is None:
            tree = build_tree(logits, min(self.budget, num_speculative_tokens))
        else:  # the full tree's expectations for every candidate budget, then its prefix
            tree = build_tree(logits, self.budget)
        self.nonfinite_drafts += int(drop_nonfinite(tree, logits).sum())  # CPU: no sync
        if self.online is not None:
            self.online.store(tree.scores)
            self.online.publish(bs)
            tree = tree.prefix(num_speculative_tokens)
        self._nonfinite_log.report(self.nonfinite_drafts)
        self.store.put(req_ids, tree)
        # Slots past a tree's last node (only when the vocabulary is tiny) are scheduled
        # but never accepted: give them a real token id.
        return tree.token_ids.clamp(min=0)
