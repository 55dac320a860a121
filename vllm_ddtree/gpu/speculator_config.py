"""DDTree as a speculative method of vLLM's speculator registry (vLLM 0.34+).

:func:`vllm_ddtree.register` registers ``"ddtree"`` with
``register_speculative_method("ddtree", DDTreeSpeculatorConfig)`` in every process.
vLLM then moves ``method="ddtree"`` to ``custom_method`` and sets ``method`` to this
config's ``base_method`` (``"dflash"``) before it calls :meth:`configure`, which sets
vLLM up for the drafter's family: vLLM's DFlash set-up, or for a DSpark checkpoint
``method="dspark"`` and vLLM's DSpark set-up.  Either way the two steps of
:mod:`vllm_ddtree.resolve` run around it, so the :class:`~vllm_ddtree.config.DDTreeParams`
are attached before vLLM builds anything else.

DDTree options arrive in ``speculator_options`` (``max_depth``, ``adaptive_budget``);
the documented ``ddtree_*`` keys are moved there before vLLM validates the config
(``_patch/speculative_options.py``).

Like vLLM's own config modules, this one imports no speculator: it is loaded in every
process, the API server's included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.worker.gpu.spec_decode.dflash.config import DFlashSpeculatorConfig
from vllm.v1.worker.gpu.spec_decode.dspark.config import DSparkSpeculatorConfig

import vllm_ddtree.config as ddcfg
import vllm_ddtree.resolve as resolve
from vllm_ddtree.drafter import missing_drafter

if TYPE_CHECKING:
    from vllm.config import SpeculativeConfig

_DFLASH_SPECULATOR = "vllm_ddtree.gpu.speculator.DDTreeSpeculator"
_DSPARK_SPECULATOR = "vllm_ddtree.gpu.dspark_speculator.DDTreeDSparkSpeculator"


class DDTreeSpeculatorConfig(DFlashSpeculatorConfig):
    base_method = ddcfg.BASE_METHOD
    speculator_class = _DFLASH_SPECULATOR
    supported_options = frozenset({"speculator_options"})
    # the tree verifier replaces vLLM's rejection sampler, which applies watermarks
    supports_watermarking = False

    @classmethod
    def default_model(cls, spec: SpeculativeConfig) -> str | None:
        # vLLM asks for a default drafter when none is given: DDTree has none
        raise missing_drafter()

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> None:
        options = ddcfg.check_speculator_options(spec.speculator_options)
        request = resolve.check_request(spec, options.get("max_depth"),
                                        options.get("adaptive_budget", False))
        if request.dspark:
            # vLLM's DSpark set-up (its draft config checks the checkpoint against
            # spec.method); vLLM reads the traits below from this class
            spec.method = ddcfg.DSPARK_METHOD
            DSparkSpeculatorConfig.configure(spec)
        else:
            super().configure(spec)
        resolve.resolve(spec, request)

    def __init__(self, spec_config: SpeculativeConfig) -> None:
        super().__init__(spec_config)
        if spec_config.method == ddcfg.DSPARK_METHOD:
            # vLLM's DSpark traits that DDTree keeps (instance attributes shadow the
            # DFlash class values vLLM reads through this object)
            self.speculator_class = _DSPARK_SPECULATOR
            self.uses_separate_workspace_lane = True

    @property
    def _drafter_queries(self) -> int:
        """Query rows per request of the drafter pass: the bonus token and ``D`` mask
        tokens for DFlash; ``D`` slots for DSpark (its anchor slot drafts too)."""
        depth = ddcfg.ddtree_params(self.spec_config).depth
        return depth if self.spec_config.method == ddcfg.DSPARK_METHOD else 1 + depth

    @property
    def num_lookahead_tokens(self) -> int:
        """vLLM's drafter reservation for its family (DFlash ``B + 1``, DSpark ``B``):
        the drafter pass writes ``1 + D <= 1 + B`` slots past the accepted tokens."""
        if self.spec_config.method == ddcfg.DSPARK_METHOD:
            return self.num_speculative_tokens
        return super().num_lookahead_tokens

    def max_num_draft_seqs(self, max_num_batched_tokens: int) -> int:
        # the drafter pass has one block of queries per request, whatever the budget
        return max_num_batched_tokens // self._drafter_queries
