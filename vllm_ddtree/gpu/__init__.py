"""DDTree on vLLM's GPU Model Runner V2 (speculator, model state, verifier, attention)."""
