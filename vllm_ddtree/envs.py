"""Environment variables read by the vllm-ddtree runtime (vLLM's ``envs.py`` idiom); the
demo's own (``VLLM_DDTREE_CACHE``, ``VLLM_DDTREE_SMOLLM_*``) are read where they are used,
in :mod:`vllm_ddtree.demo`.

Every variable is read lazily, at attribute access, so tests and child processes
see the current environment::

    from vllm_ddtree import envs
    if envs.VLLM_DDTREE_DISABLE: ...

This module imports only the standard library.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    VLLM_DDTREE_DISABLE: bool = False
    VLLM_DDTREE_SKIP_VERSION_CHECK: bool = False

_TRUE = frozenset({"1", "true", "yes", "on"})


def _flag(name: str) -> Callable[[], bool]:
    def read() -> bool:
        return os.environ.get(name, "").strip().lower() in _TRUE

    return read


# --8<-- [start:env-vars]
environment_variables: dict[str, Callable[[], Any]] = {
    # Kill switch: when set to 1, `register()` does nothing, so an installed
    # vllm-ddtree leaves vLLM untouched and `"method": "ddtree"` is rejected.
    "VLLM_DDTREE_DISABLE": _flag("VLLM_DDTREE_DISABLE"),
    # Escape hatch: when set to 1, `register()` patches vLLM even if the
    # installed vLLM version is not one vllm-ddtree was tested with.
    "VLLM_DDTREE_SKIP_VERSION_CHECK": _flag("VLLM_DDTREE_SKIP_VERSION_CHECK"),
}
# --8<-- [end:env-vars]


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
