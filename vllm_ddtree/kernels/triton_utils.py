"""The one Triton probe of the package: ``HAS_TRITON`` and, when it is true, ``triton`` and
``tl``.  Kernel modules define their kernels under ``if HAS_TRITON:``, and every kernel
has a torch reference (beside it, or in :mod:`vllm_ddtree.tree` for the tree build's
kernels), so the package imports (and runs) without Triton.  Each operation
``op`` has ``op_torch`` (the reference) and, where a kernel exists, ``op_triton`` (its
launcher); ``op`` itself picks one by the single rule :func:`use_triton`.  Tests call the
two variants directly.  Also the one power-of-two rounding of launch shapes, in plain
Python (tilings and size checks run where Triton may be absent)."""

from __future__ import annotations

from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU path runs without Triton
    triton = None
    tl = None

HAS_TRITON = triton is not None


def use_triton(tensor: Any) -> bool:
    """Whether an operation on ``tensor`` runs its Triton kernel: Triton is importable and
    the tensor is on a GPU.  Off the GPU (the CPU path, CPU tests) the torch reference
    runs; tests run the kernels on CPU tensors under ``TRITON_INTERPRET=1`` by calling
    the ``*_triton`` launchers."""
    return HAS_TRITON and bool(tensor.is_cuda)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): Triton block sizes."""
    return 1 << max(0, n - 1).bit_length()


__all__ = ["HAS_TRITON", "next_pow2", "tl", "triton", "use_triton"]
