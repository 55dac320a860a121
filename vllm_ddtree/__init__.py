"""vllm-ddtree: DDTree tree speculative decoding as a vLLM plugin.

Usage::

    vllm serve TARGET --speculative-config \\
        '{"method": "ddtree", "model": "DFLASH_DRAFTER", "num_speculative_tokens": 15}'

vLLM calls :func:`register` (entry point ``vllm.general_plugins: ddtree``) in
every process it starts. Importing this package imports neither torch nor vLLM.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "register"]

_registered = False


def register() -> None:
    """vLLM general-plugin entry point: make ``method="ddtree"`` available.

    Idempotent per process. Does nothing when ``VLLM_DDTREE_DISABLE=1``.
    Raises ``RuntimeError`` on an unsupported vLLM version unless
    ``VLLM_DDTREE_SKIP_VERSION_CHECK=1`` (vLLM propagates errors raised here).
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
        if not version.is_supported_version(installed):
            logger.warning(
                "vllm-ddtree: vLLM %s is untested (supported: %s); patching anyway "
                "because VLLM_DDTREE_SKIP_VERSION_CHECK=1.",
                installed,
                version.supported_versions_text(),
            )
    else:
        version.check_vllm_version(installed)

    from vllm_ddtree import _patch

    _patch.apply_all()
    _registered = True
    logger.debug("vllm-ddtree %s registered (patches: %s).", __version__, _patch.applied_names())


def _unregister() -> None:
    """Undo :func:`register` in this process (tests only)."""
    global _registered
    from vllm_ddtree import _patch

    _patch.undo_all()
    _registered = False
