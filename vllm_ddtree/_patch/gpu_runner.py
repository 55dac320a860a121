"""Select the DDTree speculator (and tree attention) in vLLM's GPU Model Runner V2.

See the ``gpu_runner`` entry of the ledger in ``_patch/__init__.py``.
"""

from __future__ import annotations

import sys

from vllm_ddtree._patch.helper import PatchSet

SPEC_DECODE = "vllm.v1.worker.gpu.spec_decode"
MODEL_RUNNER = "vllm.v1.worker.gpu.model_runner"


def make_init_speculator(original):
    def init_speculator(vllm_config, device):
        from vllm_ddtree.config import is_ddtree

        if not is_ddtree(vllm_config.speculative_config):
            return original(vllm_config, device)
        from vllm_ddtree.gpu.speculator import DDTreeSpeculator

        return DDTreeSpeculator(vllm_config, device)

    init_speculator.__wrapped__ = original
    return init_speculator


def apply(patches: PatchSet) -> None:
    import importlib

    spec_decode = importlib.import_module(SPEC_DECODE)
    wrapper = make_init_speculator(spec_decode.init_speculator)
    patches.setattr(spec_decode, "init_speculator", wrapper)
    # The runner imports the name at module import: patch it there too when it is
    # already imported (otherwise it will import the wrapper).
    runner = sys.modules.get(MODEL_RUNNER)
    if runner is not None:
        patches.setattr(runner, "init_speculator", wrapper)
