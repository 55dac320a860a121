"""Tree attention on vLLM's CPU backend (``CPU_ATTN``).

The CPU kernel has no mask and returns no log-sum-exp, so after vLLM's own kernel has
run (causally) over the whole batch, the verify rows of tree requests are recomputed
in torch: the paged prefix (unpacked from the ISA-specific layout) plus the request's
fresh verify rows, masked to ancestors-or-self.  The same layer also keeps the verify
rows' K/V for the compaction that follows the walk.  Rows of other requests and every
drafter layer are left exactly as vLLM computed them.

Installed per layer: after the target model loads, the runner switches each target
attention layer's ``impl`` instance to :class:`DDTreeCPUAttentionImpl` (a subclass that
changes nothing but the forward) and hands it the runner's own
:class:`~vllm_ddtree.cpu.tree_store.VerifyContext`, so no process-wide backend registry,
cache or verify state is touched and drafter layers keep vLLM's class.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionLayer
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata

from vllm_ddtree.cpu.tree_store import VerifyContext, VerifyKV, VerifyStep
from vllm_ddtree.support import attention_problems, refuse_layer


def unpack_blocks(
    blocks: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size] packed
    isa: str,
    is_key: bool,
) -> torch.Tensor:  # [num_blocks * block_size, num_kv_heads, head_size]
    """Packed K or V cache blocks -> rows in slot order."""
    num_blocks, num_kv_heads, block_size, head_size = blocks.shape
    if isa == "amx":
        if is_key:
            rows = blocks.reshape(num_blocks, num_kv_heads, block_size // 16, head_size // 2,
                                  16, 2).permute(0, 1, 2, 4, 3, 5)
        else:
            rows = blocks.reshape(num_blocks, num_kv_heads, head_size // 16, block_size // 2,
                                  16, 2).permute(0, 1, 3, 5, 2, 4)
        rows = rows.reshape(num_blocks, num_kv_heads, block_size, head_size)
    elif is_key:  # vec / vec16: K stored transposed per block
        rows = blocks.reshape(num_blocks, num_kv_heads, head_size, block_size).transpose(-1, -2)
    else:
        rows = blocks.reshape(num_blocks, num_kv_heads, block_size, head_size)
    return rows.permute(0, 2, 1, 3).reshape(num_blocks * block_size, num_kv_heads, head_size)


class DDTreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, then the tree rows of the runner's verify step.

    Installed by :func:`install`, which also sets :attr:`verify_context`: the holder
    through which the owning runner hands over each step's verify (``None`` outside a
    tree verify)."""

    verify_context: VerifyContext

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, 2 * head_size]
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,  # [num_tokens, num_heads * head_size]
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # output
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        step = self.verify_context.step
        if step is None or attn_metadata is None or not step.requests:
            return result
        self._tree_rows(layer, query, key, value, kv_cache, attn_metadata, output, step)
        return result

    def _tree_rows(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, 2 * head_size]
        metadata: CPUAttentionMetadata,
        output: torch.Tensor,  # [num_tokens, num_heads * head_size]
        step: VerifyStep,
    ) -> None:
        """Recompute the verify rows of branching requests over their paged prefix and
        their ancestors, and keep every verify row's K/V for the compaction."""
        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size,
                                               -1).chunk(2, dim=2)
        num_heads, head_size = self.num_heads, self.head_size
        out = output.view(output.shape[0], num_heads, head_size)
        for req in step.requests:
            if req.is_chain:  # vLLM's causal kernel already computed these rows
                continue
            rows = slice(req.start, req.start + req.num_nodes + 1)
            prefix_len = req.prefix_len
            blocks = metadata.block_table[req.index, :math.ceil(prefix_len / block_size)].long()
            prefix_keys = unpack_blocks(key_cache[blocks], layer.isa, True)[:prefix_len]
            prefix_values = unpack_blocks(value_cache[blocks], layer.isa, False)[:prefix_len]
            # [num_kv_heads, prefix_len + num_nodes + 1, head_size]
            keys = torch.cat([prefix_keys.to(key.dtype), key[rows]], 0).float().transpose(0, 1)
            values = torch.cat([prefix_values.to(value.dtype), value[rows]],
                               0).float().transpose(0, 1)
            queries = query[rows].float().transpose(0, 1)  # [num_heads, num_nodes + 1, head_size]
            attended = torch.nn.functional.scaled_dot_product_attention(
                queries, keys, values, attn_mask=req.verify_mask, scale=self.scale,
                enable_gqa=num_heads != num_kv_heads)
            out[rows] = attended.transpose(0, 1).to(out.dtype)
        verify_rows = step.rows
        step.keep_kv(layer.layer_name, VerifyKV(
            layer, self, kv_cache, key[verify_rows].clone(), value[verify_rows].clone(),
            metadata.slot_mapping[verify_rows].clone()))


SUPPORTED_ISAS = ("vec", "vec16", "amx")  # KV layouts whose unpacking is verified


def check_supported(name: str, layer: Any) -> None:
    """Refuse, at load time, layers whose tree rows this path cannot compute exactly:
    the features no tree verify supports (:func:`vllm_ddtree.support.attention_problems`)
    and this path's own limits (vLLM's CPU_ATTN backend, KV layouts it unpacks)."""
    impl = layer.impl
    problems = attention_problems(impl)
    if type(impl) not in (CPUAttentionBackendImpl, DDTreeCPUAttentionImpl):
        problems.append(f"backend {type(impl).__qualname__} (only vLLM's CPU_ATTN)")
    if impl.is_fp8_kv_cache and "an fp8 KV cache" not in problems:
        problems.append("a quantized KV cache")
    isa = getattr(layer, "isa", None)
    if isa not in SUPPORTED_ISAS:
        problems.append(f"CPU attention ISA {isa!r} (verified: {', '.join(SUPPORTED_ISAS)})")
    refuse_layer(name, problems, "CPU")


def install(layers: Mapping[str, Any], verify_context: VerifyContext) -> None:
    """Switch the given target attention layers (name -> vLLM attention layer) to the
    tree-aware implementation, reading the verify step from ``verify_context``."""
    for name, layer in layers.items():
        check_supported(name, layer)
        layer.impl.__class__ = DDTreeCPUAttentionImpl
        layer.impl.verify_context = verify_context
