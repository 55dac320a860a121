"""Tooling for tests, benchmarks and the demo, never imported by a server: the tiny model
fixtures (``fixtures``), the plain-PyTorch reference decode loop (``reference_decode``),
engine helpers (``engines``), readers of vLLM's metrics (``metrics``) and of the README's
code blocks (``readme``)."""
