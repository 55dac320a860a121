"""DDTree over a DSpark drafter for vLLM's Model Runner V2 (GPU).

A DSpark drafter is DFlash's backbone plus a low-rank Markov head: the token after
``t`` at depth ``d`` has the logits ``base[d] + bias(t)``.  vLLM's ``DSparkSpeculator``
samples one chain left to right from them; this speculator builds the DDTree whose
every node ranks its children by its own distribution
(:func:`vllm_ddtree.tree.build_conditioned_tree`) and keeps everything else of
:class:`~vllm_ddtree.gpu.speculator.DDTreeSpeculator`: verification, sampling at
T > 0, KV compaction, adaptive budgets.

Layout (vLLM's dense DSpark layout, "anchor-as-first"): each request's drafter pass
has ``D`` query slots, the anchor (the request's last committed token, the tree's root)
and ``D - 1`` noise tokens; slot ``k`` predicts depth ``k + 1``.  vLLM's DFlash input
kernel lays the ``D`` sample rows out ``budget`` per request, as for the DFlash tree.
Checkpoints with the ``1 + N`` fill-in block (``sample_from_anchor: false``) are refused
when the config is validated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

from vllm_ddtree.gpu.markov_head import markov_head_of
from vllm_ddtree.gpu.speculator import DDTreeSpeculator
from vllm_ddtree.tree import DraftTree, build_conditioned_tree
from vllm_ddtree.tree.conditioned import MarkovHead

if TYPE_CHECKING:
    import torch.nn as nn
    from vllm.config import VllmConfig


class DDTreeDSparkSpeculator(DDTreeSpeculator, DSparkSpeculator):
    # MRO: DDTree's propose / load_model / graph manager, DSpark's __init__ buffers and
    # load_draft_model (vLLM's DSpark loader), DFlash's drafter pass underneath
    _speculator_name = "DDTree-DSpark"

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        if not self.sample_from_anchor:  # refused at config time; a guard for other paths
            raise ValueError("vllm-ddtree: DSpark drafters with the 1 + N fill-in block "
                             "are not supported")
        # vLLM's DSpark sized these for B query slots; the tree's drafter pass has D
        self.num_query_per_req = self.max_depth
        self._anchor_idx = torch.arange(self.max_num_reqs, dtype=torch.int64,
                                        device=device) * self.num_query_per_req
        self._draft_to_target: torch.Tensor | None = None
        self._markov_head: MarkovHead | None = None

    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        d2t = getattr(self.model, "draft_id_to_target_id", None)
        if d2t is not None:  # reduced draft vocabulary: target id = draft id + d2t[id]
            self._draft_to_target = torch.arange(d2t.shape[0], device=d2t.device) + d2t
        self._markov_head = markov_head_of(self.model)

    def _draft_tree(
        self,
        hidden_states: torch.Tensor,  # [num_tokens_padded, hidden_size] the drafter's
        num_reqs: int,
    ) -> tuple[DraftTree, torch.Tensor]:  # num_reqs trees, [num_reqs, max_depth, V_draft]
        # the anchor's row drafts depth 1
        base_logits = self.model.compute_draft_logits(
            hidden_states[self._sample_rows(num_reqs)]).view(num_reqs, self.max_depth, -1)
        # [num_reqs] the anchor slot's input: the request's last committed token
        roots = self.input_buffers.input_ids[self._anchor_idx[:num_reqs]].long()
        tree = build_conditioned_tree(base_logits, roots, self._markov_head,
                                      self._pass_budget(num_reqs), self._draft_to_target)
        return tree, base_logits
