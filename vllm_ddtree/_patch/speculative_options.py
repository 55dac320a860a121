"""vLLM 0.34: the ``ddtree_*`` keys of ``--speculative-config`` become
``speculator_options`` before vLLM validates the config.

See the ``speculative_options`` entry of the ledger in ``_patch/__init__.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import vllm_ddtree.config as ddcfg
from vllm_ddtree._patch.helper import PatchSet

TARGET = "vllm.config.speculative.SpeculativeConfig"


def _make_init(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        ddcfg.check_raw_options(kwargs)
        original(self, *args, **ddcfg.to_speculator_options(kwargs))

    return __init__


def apply(patches: PatchSet) -> None:
    from vllm.config.speculative import SpeculativeConfig as cls

    if "speculator_options" not in cls.__dataclass_fields__:
        raise RuntimeError(f"{TARGET} has no speculator_options field; vLLM changed, "
                           "update vllm-ddtree")
    patches.setattr(cls, "__init__", _make_init(cls.__dict__["__init__"]))
