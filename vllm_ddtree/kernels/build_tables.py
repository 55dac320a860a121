"""Tables and key packing shared by the torch and the Triton tree builds.

Both builds (``build_tree_torch`` in the tree package and :mod:`.tree_build`) score the
same candidate (parent position, token rank) pairs and select with the same int64 keys:
order-preserving float32 score bits in the high 32 bits above an inverted tie code in
the low 32, so that a larger key is a higher score, then a lower tie code.  Distinct
tie codes make every key unique, and one ``topk`` selects with no ties.
:mod:`.topk_lse` packs token ids the same way.
"""

from __future__ import annotations

import bisect
from functools import lru_cache

import torch

from vllm_ddtree.kernels.triton_utils import HAS_TRITON, tl, triton

LOW32 = (1 << 32) - 1  # mask of a key's tie code


def orderable(scores: torch.Tensor) -> torch.Tensor:
    """int64 whose order equals the order of float32 ``scores`` (no NaN; -0 == +0)."""
    scores = scores + 0.0  # -0.0 -> +0.0
    bits = scores.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def pack_keys(scores: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """float32 ``scores`` and int64 ``ties`` (each ``< 2**32``, same shape) -> int64 keys:
    larger = higher score, then lower tie code."""
    return (orderable(scores) << 32) | (LOW32 - ties)


def unpack_ties(keys: torch.Tensor) -> torch.Tensor:
    """The tie codes of int64 ``keys`` (inverse of :func:`pack_keys`), int64."""
    return LOW32 - (keys & LOW32)


def unpack_scores(keys: torch.Tensor) -> torch.Tensor:
    """The float32 scores of int64 ``keys`` (inverse of :func:`pack_keys`)."""
    bits = keys >> 32
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return bits.to(torch.int32).view(torch.float32)


if HAS_TRITON:  # the same packing inside Triton kernels

    @triton.jit
    def pack_key(score, tie):  # float32, int64 (< 2**32) -> int64 key (pack_keys)
        bits = (score + 0.0).to(tl.int32, bitcast=True).to(tl.int64)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return (bits << 32) | (4294967295 - tie)

    @triton.jit
    def key_score(key):  # unpack_scores
        bits = key >> 32
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return bits.to(tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def key_tie(key):  # unpack_ties
        return 4294967295 - (key & 4294967295)


@lru_cache(maxsize=64)
def pair_layout(max_depth: int, k: int, width: int) -> tuple[list[int], list[int], list[int]]:
    """Candidate (parent position, token rank) pairs with ``(i+1)(r+1) <= width``.

    ``max_depth``: tree depth D; ``k``: candidate tokens per depth; ``width``: node
    budget.  Returns the pairs' parent positions and token ranks, sorted by parent
    position, and per depth ``d`` how many pairs have their parent inside depth
    ``d - 1``'s set (a prefix, since the pairs are sorted; entry 0 is unused).
    """
    parent_pos, ranks = [], []
    for i in range(width):
        rmax = min(k, width // (i + 1))
        parent_pos.extend([i] * rmax)
        ranks.extend(range(rmax))
    num_pairs, size = [0], min(width, k)
    for _ in range(1, max_depth):
        num_pairs.append(bisect.bisect_left(parent_pos, size))
        size = min(width, num_pairs[-1])
    return parent_pos, ranks, num_pairs


@lru_cache(maxsize=64)
def pair_tensors(max_depth: int, k: int, width: int, device: str,
                 dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pair_layout`'s parent positions and token ranks as ``[P]`` tensors (a
    single 0 when there are no pairs), cached per device and dtype."""
    parent_pos, ranks, _ = pair_layout(max_depth, k, width)
    dev = torch.device(device)
    return (torch.tensor(parent_pos or [0], dtype=dtype, device=dev),
            torch.tensor(ranks or [0], dtype=dtype, device=dev))


@lru_cache(maxsize=256)
def cached_int64_tensor(values: tuple[int, ...], device: str) -> torch.Tensor:
    """``[len(values)]`` int64 tensor of ``values`` on ``device``, made once per
    (values, device): a CUDA graph captured later reads it without any host-to-device
    copy under capture."""
    return torch.tensor(values, dtype=torch.int64, device=torch.device(device))
