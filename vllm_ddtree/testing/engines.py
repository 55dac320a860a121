"""The one way tests, benchmarks and the demo start and stop a vLLM engine.

``with llm_engine(model=..., speculative_config=...) as llm:`` starts ``vllm.LLM`` and,
on leaving the block (normally or by an exception), shuts its engine core down at once:
its processes and their memory are gone before the next engine starts, rather than at
some later garbage collection.  :func:`shutdown` does the same for an engine held
elsewhere (a module-scoped fixture)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def llm_engine(**kwargs: Any) -> Iterator[Any]:
    """``vllm.LLM(**kwargs)``, shut down when the block ends."""
    from vllm import LLM

    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        shutdown(llm)


def shutdown(llm: Any) -> None:
    """Stop ``llm``'s engine core and free what this process held for it.  Safe to call
    twice; the caller drops its own reference afterwards."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
