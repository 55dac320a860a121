"""The package's loggers: vLLM's ``init_logger`` (with its ``warning_once`` /
``info_once``), named under vLLM's ``vllm`` logger so that vLLM's handler, format and
``VLLM_LOGGING_LEVEL`` apply.  A logger outside that tree has no handler in a vLLM
process: its INFO lines are lost and its warnings print unformatted."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.logger import _VllmLogger


def init_logger(name: str) -> _VllmLogger:
    """The logger of the module ``name`` (pass ``__name__``), as ``vllm.<name>``."""
    from vllm.logger import init_logger as vllm_init_logger

    return vllm_init_logger(f"vllm.{name}")
