"""CPU worker for DDTree: vLLM's ``CPUWorker`` with the DDTree runner and attention.

Selected through vLLM's own ``parallel_config.worker_cls`` (set by the CPU platform
patch in :mod:`vllm_ddtree._patch.cpu_platform` only when ``method="ddtree"``).
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_ddtree.cpu.runner import DDTreeCPUModelRunner


class DDTreeCPUWorker(CPUWorker):
    def init_device(self) -> None:
        super().init_device()
        runner = self.model_runner
        if type(runner).__name__ != "CPUModelRunner" or not hasattr(runner, "drafter"):
            raise RuntimeError(
                "vllm-ddtree: the CPU path needs vLLM's V1 CPUModelRunner with a DFlash "
                f"drafter, got {type(runner).__qualname__}; unset VLLM_USE_V2_MODEL_RUNNER.")
        runner.__class__ = DDTreeCPUModelRunner  # before load_model: the drafter is swapped
        runner.ddtree_init()
