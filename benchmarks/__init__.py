"""Benchmarks and GPU checks of vllm-ddtree (not shipped with the package).

Run them as modules from the repository root, e.g. ``python3 -m benchmarks.throughput
--fixture tree_beats_chain --cpu --out /tmp/t``: the root on ``sys.path`` makes both
``benchmarks.*`` (helpers one benchmark shares with another) and ``vllm_ddtree``
importable, the latter even where the plugin is not installed yet.  The tests find this
package through pytest's ``pythonpath`` setting (pyproject.toml)."""
