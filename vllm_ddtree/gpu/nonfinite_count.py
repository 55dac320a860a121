"""One engine's count of request-steps whose draft logits held NaN/inf, on the GPU.

The drafter pass counts on the device, inside its CUDA graph (:meth:`NonfiniteCount.add`);
the host reads the count one step later from an asynchronous copy into pinned memory
(:meth:`NonfiniteCount.report`), so no step waits for the device.  The warning itself
is :class:`~vllm_ddtree.drafter_faults.NonfiniteDraftLog`'s, shared with the CPU path.
"""

from __future__ import annotations

import torch

from vllm_ddtree.drafter_faults import NonfiniteDraftLog


class NonfiniteCount:
    def __init__(self, device: torch.device | str) -> None:
        # [1] int64: request-steps whose draft logits held NaN/inf (emptied trees)
        self._count = torch.zeros(1, dtype=torch.int64, device=device)
        host = torch.zeros(1, dtype=torch.int64)
        # pinned: a non_blocking copy from the GPU into pageable memory would sync
        self._host = host.pin_memory() if torch.device(device).type == "cuda" else host
        self._seen = self._host.numpy()  # its memory, read as numpy
        self._log = NonfiniteDraftLog()

    def add(self, bad: torch.Tensor) -> None:  # [num_reqs] bool requests with NaN/inf
        """Count a drafter pass's requests (device work, graph-capturable)."""
        self._count.add_(bad.sum())

    def reset(self) -> None:
        """Drop what warm-up and capture passes counted (their inputs are no drafter's)."""
        self._count.zero_()

    def report(self) -> None:
        """Warn on the count the previous report's copy brought (a numpy read: indexing
        the tensor would make a tensor a step), then start the next copy."""
        self._log.report(self.seen)
        self._host.copy_(self._count, non_blocking=True)

    @property
    def seen(self) -> int:
        """The count as of the last copy that reached the host."""
        return int(self._seen[0])
