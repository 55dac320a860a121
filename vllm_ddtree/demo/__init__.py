"""The end-to-end demo (``python -m vllm_ddtree.demo``) and the SmolLM2-135M model pair
it runs: the target converted from a GGUF (``smollm``), the drafter's training data
(``smollm_data``) and the shipped DFlash drafter (``assets/``)."""
