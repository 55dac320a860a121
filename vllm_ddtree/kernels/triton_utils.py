"""The one Triton probe of the core: ``HAS_TRITON`` and, when it is true, ``triton`` and
``tl``.  Kernel modules define their kernels under ``if HAS_TRITON:`` and keep a torch
path beside each, so the package imports (and runs) without Triton.  Also the one
power-of-two rounding of launch shapes, in plain Python (tilings and size checks run
where Triton may be absent)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU path runs without Triton
    triton = None
    tl = None

HAS_TRITON = triton is not None


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): Triton block sizes."""
    return 1 << max(0, n - 1).bit_length()


__all__ = ["HAS_TRITON", "next_pow2", "tl", "triton"]
