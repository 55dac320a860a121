"""Kernels, each beside the torch reference it must match."""
