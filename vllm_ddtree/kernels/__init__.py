"""Triton kernels of the tree core.  Each module's docstring names the torch reference
its kernel must match: beside it, or in :mod:`vllm_ddtree.tree` for the tree build's
kernels (docs/architecture.md lists them)."""
