"""The worker -> scheduler statistics channel of ``ddtree_adaptive_budget: "online"``.
Pure Python."""

from __future__ import annotations

import mmap
import os
import tempfile


class StatsChannel:
    """Worker -> scheduler, through a small memory-mapped file on tmpfs (the scheduler and
    the tensor-parallel rank 0 worker may be different processes): running sums
    ``[steps, requests, sum E_n for each candidate]`` as float64.  The scheduler creates it
    and removes it on close; the worker attaches.  Readers see values a step or so old and
    possibly mid-update: fine for a moving average.  (A plain file, not
    ``multiprocessing.shared_memory``: that one's resource tracker, shared by vLLM's worker
    processes, would unlink or double-unregister the segment.)"""

    DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

    def __init__(self, name: str, width: int, create: bool):
        self.width = width
        self.path = os.path.join(self.DIR, name)
        size = 8 * (2 + width)
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(self.path, flags, 0o600)  # attach: FileNotFoundError until created
        try:
            if create:
                os.ftruncate(fd, size)  # zero-filled
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._owner = create

    @staticmethod
    def name_for(engine_pid: int) -> str:
        return f"vllm_ddtree_{engine_pid}"

    def add(self, requests: int, sums: list[float]) -> None:
        with memoryview(self._mm).cast("d") as v:  # no view outlives the call
            for i, s in enumerate(sums):
                v[2 + i] += s
            v[1] += requests
            v[0] += 1

    def read(self) -> tuple[float, float, list[float]]:
        with memoryview(self._mm).cast("d") as v:
            vals = v.tolist()
        return vals[0], vals[1], vals[2:2 + self.width]

    def close(self) -> None:
        self._mm.close()
        if self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
