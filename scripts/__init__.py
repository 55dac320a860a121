"""Tools of vllm-ddtree that are not shipped with the package: the SmolLM2 drafter
trainer, the converted-model check and the static vLLM-surface check.

Run them as modules from the repository root, e.g. ``python3 -m scripts.train_drafter
--out /tmp/d --device cpu --steps 3 --tiny``, as for :mod:`benchmarks`."""
