"""The one Triton probe of the core: ``HAS_TRITON`` and, when it is true, ``triton`` and
``tl``.  Kernel modules define their kernels under ``if HAS_TRITON:`` and keep a torch
path beside each, so the package imports (and runs) without Triton."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU path runs without Triton
    triton = None
    tl = None

HAS_TRITON = triton is not None

__all__ = ["HAS_TRITON", "tl", "triton"]
