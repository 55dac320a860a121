"""The supported vLLM versions (the gate ``register()`` applies) and runner detection.

Importing this module imports neither torch nor vLLM; functions that need vLLM
import it lazily.
"""

from __future__ import annotations

import re

SKIP_VERSION_ENV = "VLLM_DDTREE_SKIP_VERSION_CHECK"

#: vLLM minor series vllm-ddtree was written and tested against.
SUPPORTED_SERIES: tuple[tuple[int, int], ...] = ((0, 26), (0, 32), (0, 33))

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def supported_versions_text() -> str:
    """Human-readable list of supported series, e.g. ``"0.26.x, 0.32.x, 0.33.x"``."""
    return ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_SERIES)


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``; dev/rc/local suffixes are ignored.

    Raises ``ValueError`` when no ``MAJOR.MINOR`` prefix can be read.
    """
    match = _VERSION_RE.match(version)
    if match is None:
        raise ValueError(f"cannot parse vLLM version {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def is_supported_version(version: str) -> bool:
    """True when ``version`` belongs to one of :data:`SUPPORTED_SERIES`."""
    try:
        major, minor, _ = parse_version(version)
    except ValueError:
        return False
    return (major, minor) in SUPPORTED_SERIES


def check_vllm_version(version: str) -> None:
    """Raise ``RuntimeError`` unless ``version`` is a supported vLLM version.

    The check is on the minor series only, so ``0.32.0+cpu`` and
    ``0.33.1.dev3+gabc`` pass. The caller decides whether
    ``VLLM_DDTREE_SKIP_VERSION_CHECK`` applies.
    """
    if is_supported_version(version):
        return
    from vllm_ddtree import __version__

    raise RuntimeError(
        f"vllm-ddtree {__version__} does not support the installed vLLM "
        f"{version!r}: supported vLLM versions are {supported_versions_text()}. "
        f"Install a supported vLLM, or set {SKIP_VERSION_ENV}=1 to patch this "
        "vLLM anyway (untested; DDTree may fail or give wrong results)."
    )


def installed_vllm_version() -> str:
    """``vllm.__version__`` (imports vLLM)."""
    import vllm

    return str(vllm.__version__)





def runner_path() -> str:
    """Best guess of the model runner that will serve DDTree in this process.

    Heuristic, mirrors ``VllmConfig.use_v2_model_runner`` without a config:
    the CPU platform always uses V1; ``VLLM_USE_V2_MODEL_RUNNER`` wins; no
    Triton means V1; otherwise V2 (0.32/0.33) or V2-for-dense-targets (0.26).
    """
    import vllm.envs as vllm_envs
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "V1 (CPU)"
    forced = vllm_envs.VLLM_USE_V2_MODEL_RUNNER
    if forced is not None:
        return "V2 (GPU, forced by VLLM_USE_V2_MODEL_RUNNER)" if forced else (
            "V1 (GPU, forced by VLLM_USE_V2_MODEL_RUNNER=0)"
        )
    if not vllm_has_triton():
        return "V1 (GPU, no Triton)"
    if parse_version(installed_vllm_version())[:2] == (0, 26):
        return "V2 (GPU) for dense targets, V1 for MoE targets"
    return "V2 (GPU)"


def vllm_has_triton() -> bool:
    """Whether vLLM itself uses Triton (its own probe: False on the CPU build, where a
    Triton without a CPU backend is installed)."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return False
    return bool(HAS_TRITON)
