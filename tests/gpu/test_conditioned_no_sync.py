"""No device-to-host sync in the conditioned (DSpark) tree build: its second build (the
first compiles the Triton kernels) runs under ``torch.cuda.set_sync_debug_mode("error")``,
where any synchronizing call raises.  Imports nothing from vLLM."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.tree.conditioned import MarkovHead, build_conditioned_tree_triton

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("R", [1, 8])
def test_the_conditioned_tree_build_has_no_device_to_host_sync(R):
    """Each depth's candidates and selection, and the assembly, at budget 15 over
    depth 6 and 4096 tokens, for one request and for eight."""
    dev = torch.device("cuda")
    D, V, B = 6, 4096, 15
    g = torch.Generator(device=dev).manual_seed(R)
    base = (torch.randn(R, D, V, device=dev, generator=g) * 2).bfloat16()
    head = MarkovHead(torch.randn(V, 16, device=dev, generator=g).bfloat16(),
                      torch.randn(V, 16, device=dev, generator=g).bfloat16(), 0.5)
    roots = torch.randint(0, V, (R,), device=dev, generator=g)
    want = build_conditioned_tree_triton(base, roots, head, B)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = build_conditioned_tree_triton(base, roots, head, B)
        # the mode catches a sync: the check can fail
        with pytest.raises(RuntimeError, match="synchroniz"):
            int(got.num_nodes[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for field in ("token_ids", "parents", "depths", "num_nodes", "scores", "top1",
                  "nonfinite"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
