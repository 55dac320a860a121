"""Select the DDTree speculator (and tree attention) in vLLM's GPU Model Runner V2.

See the ``gpu_runner`` entry of the ledger in ``_patch/__init__.py``.
"""

from __future__ import annotations

import sys

from vllm_ddtree._patch.helper import PatchSet

SPEC_DECODE = "vllm.v1.worker.gpu.spec_decode"
MODEL_RUNNER = "vllm.v1.worker.gpu.model_runner"


def make_init_speculator(original):
    # vLLM 0.26 calls init_speculator(vllm_config, device); 0.32+ adds req_states
    def init_speculator(vllm_config, device, *args, **kwargs):
        from vllm_ddtree.config import is_ddtree

        if not is_ddtree(vllm_config.speculative_config):
            return original(vllm_config, device, *args, **kwargs)
        if vllm_config.speculative_config.method == "dspark":  # a DSpark checkpoint
            from vllm_ddtree.gpu.dspark_speculator import DDTreeDSparkSpeculator

            return DDTreeDSparkSpeculator(vllm_config, device)
        from vllm_ddtree.gpu.speculator import DDTreeSpeculator

        return DDTreeSpeculator(vllm_config, device)

    init_speculator.__wrapped__ = original
    return init_speculator


V1_PROPOSER = "vllm.v1.spec_decode.dflash"
V1_MESSAGE = (
    "vllm-ddtree: this engine selected vLLM's V1 GPU model runner, where DDTree is not "
    "implemented (on vLLM 0.26 MoE targets run on V1; VLLM_USE_V2_MODEL_RUNNER=0 forces it). "
    "Use a dense target on the default V2 runner, or method 'dflash'.")


def v1_runner_is_ddtree_free() -> bool:
    """True where vLLM's V1 runner must not serve DDTree: every platform but CPU (the CPU
    runner builds vLLM's DFlash proposer first, then the DDTree worker replaces it)."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def make_v1_guard(original):
    """On GPU, vLLM's V1 DFlash proposer would silently run a plain chain for a DDTree
    config: refuse (the project's own proposer subclass is always allowed)."""

    def __init__(self, vllm_config, *args, **kwargs):
        from vllm_ddtree.config import is_ddtree

        if (is_ddtree(vllm_config.speculative_config)
                and not getattr(type(self), "ddtree_proposer", False)
                and v1_runner_is_ddtree_free()):
            raise NotImplementedError(V1_MESSAGE)
        return original(self, vllm_config, *args, **kwargs)

    __init__.__wrapped__ = original
    return __init__


def apply(patches: PatchSet) -> None:
    import importlib

    proposer = importlib.import_module(V1_PROPOSER).DFlashProposer
    patches.setattr(proposer, "__init__", make_v1_guard(proposer.__dict__["__init__"]))

    spec_decode = importlib.import_module(SPEC_DECODE)
    wrapper = make_init_speculator(spec_decode.init_speculator)
    patches.setattr(spec_decode, "init_speculator", wrapper)
    # The runner imports the name at module import: patch it there too when it is
    # already imported (otherwise it will import the wrapper).
    runner = sys.modules.get(MODEL_RUNNER)
    if runner is not None:
        patches.setattr(runner, "init_speculator", wrapper)
