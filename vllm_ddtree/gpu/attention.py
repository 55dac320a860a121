"""Tree attention for the target model on GPU: vLLM's FlashAttention backend plus the
project's Triton tree kernel (vLLM ships no tree attention backend any more).

No registry entry: :func:`bind_tree_attention` switches each *target* attention layer,
per instance, from FlashAttention to these subclasses and binds it to its engine's
:class:`~vllm_ddtree.gpu.buffers.TreeBuffers`
(:meth:`~vllm_ddtree.gpu.speculator.DDTreeSpeculator.load_model` calls it).  vLLM later
builds the metadata builder from the layer's backend, and the builder finds the buffers
through its layers.  It attaches tree metadata to the target layers' metadata in steps
that verify trees; drafter layers and every other step run vLLM's code unchanged.

Per target layer in a tree step (KV of this step's rows is already in the paged cache):

* every request has at most ``W = 1 + B`` rows (all decode steps, FULL CUDA graphs):
  FlashAttention 3 over each request's prefix (``causal=False``, ``seqused_k =
  seq_len - q_len``, returning its LSE) straight into the output, then the Triton
  kernel merges each row's ancestor keys into it in place;
* otherwise (a long prefill chunk in the batch; piecewise/eager): vLLM's causal
  FlashAttention for all rows, then the Triton kernel recomputes the rows of requests
  with ``q_len <= W`` (prefix + ancestors) in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends import flash_attn as fa
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)

from vllm_ddtree.gpu.buffers import TreeBuffers
from vllm_ddtree.kernels.tree_attention import tree_attention_triton

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import AttentionSpec


@dataclass
class TreeAttnMeta:
    fused: bool  # FA3 prefix + in-place tree merge (all q_len <= max_rows)
    prefix_lens: torch.Tensor  # [num_reqs] int32 KV length before this step's rows
    query_end: torch.Tensor | None  # [num_reqs] int32 (recompute mode: rows to redo)
    row_bits: torch.Tensor  # [num_tokens, NW] int32 ancestor bits of every query row
    max_rows: int  # verify rows a request may have in this step (at most 1 + budget)


def bind_tree_attention(layer_name: str, layer: Any, tree_buffers: TreeBuffers) -> None:
    """Switch the target attention layer ``layer`` (vLLM's ``Attention``) to tree attention
    over ``tree_buffers``: per instance, its backend and its impl's class (vLLM builds the
    metadata builder from ``layer.get_attn_backend()`` later).  Refuses layers whose
    features the tree kernel does not implement."""
    if layer.attn_backend is FlashAttentionBackend and type(layer.impl) is FlashAttentionImpl:
        layer.attn_backend = DDTreeFlashAttentionBackend
        layer.impl.__class__ = DDTreeFlashAttentionImpl
        layer.impl.tree_buffers = tree_buffers
    check_target_layer(layer_name, layer.impl)


def bound_tree_buffers(vllm_config: VllmConfig, layer_names: list[str]) -> TreeBuffers:
    """The buffers :func:`bind_tree_attention` bound to the layers ``layer_names`` (found
    in vLLM's per-engine ``static_forward_context``)."""
    forward_context = vllm_config.compilation_config.static_forward_context
    found: dict[int, TreeBuffers] = {}
    for name in layer_names:
        tree_buffers = getattr(getattr(forward_context.get(name), "impl", None),
                               "tree_buffers", None)
        if tree_buffers is not None:
            found[id(tree_buffers)] = tree_buffers
    if len(found) != 1:
        problem = "no DDTree buffers" if not found else "buffers of several engines"
        raise RuntimeError(
            f"vllm-ddtree: the tree attention builder of layers {list(layer_names)} found "
            f"{problem}; DDTreeSpeculator.load_model binds each target layer "
            "(vllm_ddtree.gpu.attention.bind_tree_attention) before vLLM builds them.")
    return next(iter(found.values()))


class DDTreeFlashAttentionBuilder(FlashAttentionMetadataBuilder):
    # A FULL CUDA graph bakes the tree kernel's path (fused or not) and grid from the
    # batch it was captured with.  Uniform decode batches replay a graph of their own
    # width; a mixed batch (a prefill chunk, truncated trees) would replay one captured
    # with another layout.  So FULL graphs for uniform batches only: vLLM then runs
    # mixed batches piecewise (cudagraph_mode FULL becomes FULL_AND_PIECEWISE).
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._ddtree_buffers = bound_tree_buffers(vllm_config, layer_names)
        # read once, as vLLM's own builder does for its AOT schedule (a per-step call
        # walks vLLM's platform and config checks on the host)
        self._ddtree_fa3 = fa.get_flash_attn_version() == 3

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlashAttentionMetadata:
        tree_buffers = self._ddtree_buffers
        if not tree_buffers.step_has_trees:
            meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
            meta.ddtree = None
            return meta
        common = common_attn_metadata
        num_reqs = common.num_reqs
        # written for this step's requests by the model state's fill_rows (one launch
        # with the rows' bits and positions)
        prefix_lens = tree_buffers.prefix_lens[:num_reqs]
        max_rows = tree_buffers.max_rows
        fused = common.max_query_len <= max_rows and self._ddtree_fa3
        if fused:
            # vLLM's builder then makes FA3's schedule (scheduler_metadata, kept in its
            # persistent buffer under FULL CUDA graphs) for the call forward makes:
            # non-causal over each request's prefix, no cascade.  Without it FA3 plans
            # the split inside every layer's call (one more kernel per layer and step).
            meta = super().build(0, common.replace(seq_lens=prefix_lens, causal=False),
                                 fast_build)
        else:
            meta = super().build(common_prefix_len, common, fast_build)
        query_end = None
        if fused:
            # the step's own width (an adaptive engine's steps are narrower than its
            # largest budget): the kernel's grid and tiling follow it
            max_rows = tree_buffers.kernel_rows(common.max_query_len)
        else:
            query_end = tree_buffers.query_end[:num_reqs]
        meta.ddtree = TreeAttnMeta(fused, prefix_lens, query_end, tree_buffers.row_bits,
                                   max_rows)
        return meta


class DDTreeFlashAttentionImpl(FlashAttentionImpl):
    # this engine's buffers (set by bind_tree_attention; vLLM creates the impl as a
    # FlashAttentionImpl, so there is no constructor of this class to pass them to)
    tree_buffers: TreeBuffers
    # whether this layer has compiled the unfused kernel variant (_compile_unfused)
    _ddtree_unfused_ready = False

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, 2 * head_size]
        attn_metadata: FlashAttentionMetadata,
        output: torch.Tensor,  # [num_tokens, num_heads * head_size]
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tree = getattr(attn_metadata, "ddtree", None)
        if tree is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                   output, output_scale, output_block_scale)
        meta = attn_metadata
        num_tokens = meta.num_actual_tokens
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        q = query[:num_tokens]
        out = output[:num_tokens]
        if tree.fused and not self._ddtree_unfused_ready:
            self._compile_unfused(q, key_cache, value_cache, meta, tree, out)
        if tree.fused:
            _, lse = fa.flash_attn_varlen_func(
                q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=meta.query_start_loc,
                max_seqlen_q=meta.max_query_len, seqused_k=tree.prefix_lens,
                max_seqlen_k=meta.max_seq_len, softmax_scale=self.scale, causal=False,
                block_table=meta.block_table, return_softmax_lse=True,
                scheduler_metadata=meta.scheduler_metadata,
                fa_version=self.vllm_flash_attn_version, num_splits=meta.max_num_splits)
            tree_attention_triton(q, key_cache, value_cache, meta.block_table,
                                  meta.query_start_loc, tree.prefix_lens, tree.row_bits,
                                  self.scale, include_prefix=False, max_rows=tree.max_rows,
                                  out=out, prefix_out_lse=lse, return_lse=False)
        else:
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                            output_scale, output_block_scale)
            tree_attention_triton(q, key_cache, value_cache, meta.block_table,
                                  meta.query_start_loc, tree.prefix_lens, tree.row_bits,
                                  self.scale, include_prefix=True, max_rows=tree.max_rows,
                                  query_end=tree.query_end, out=out, return_lse=False)
        return output

    def _compile_unfused(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        meta: FlashAttentionMetadata,
        tree: TreeAttnMeta,
        out: torch.Tensor,  # [num_tokens, num_heads, head_size]
    ) -> None:
        """Compile the kernel variant of steps that mix a prefill with trees.  vLLM's
        warm-up and capture passes only run uniform tree steps (the fused variant), so
        the first mixed step would compile it mid-serving: a stall of ~0.3 s.  Done in
        the first uncaptured tree step (vLLM's warm-up pass before capture) with the
        step's own tensors (Triton specializes on their alignment and strides) and every
        request's row range empty (``query_end = query_start``): the launch writes
        nothing."""
        if torch.cuda.is_current_stream_capturing():
            return  # a launch here would be recorded into the graph
        num_reqs = meta.block_table.shape[0]
        tree_attention_triton(q, key_cache, value_cache, meta.block_table,
                              meta.query_start_loc, tree.prefix_lens, tree.row_bits,
                              self.scale, include_prefix=True,
                              max_rows=self.tree_buffers.max_rows,  # as mixed steps pass it
                              query_end=meta.query_start_loc[:num_reqs], out=out,
                              return_lse=False)
        self._ddtree_unfused_ready = True


class DDTreeFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[DDTreeFlashAttentionImpl]:
        return DDTreeFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DDTreeFlashAttentionBuilder]:
        return DDTreeFlashAttentionBuilder


def check_target_layer(layer_name: str, impl: Any) -> None:
    """Refuse target attention features the tree kernel does not implement."""
    problems = []
    if not isinstance(impl, DDTreeFlashAttentionImpl):
        problems.append(f"attention backend {type(impl).__name__} (DDTree needs FLASH_ATTN)")
    else:
        if tuple(impl.sliding_window) != (-1, -1):
            problems.append("sliding-window attention")
        if impl.alibi_slopes is not None:
            problems.append("ALiBi")
        if impl.logits_soft_cap:
            problems.append("logit soft-capping")
        if impl.sinks is not None:
            problems.append("attention sinks")
        if str(impl.kv_cache_dtype).startswith("fp8"):
            problems.append("an fp8 KV cache")
        if impl.head_size not in (64, 128, 256):
            problems.append(f"head size {impl.head_size}")
    if problems:
        raise NotImplementedError(
            f"vllm-ddtree: target layer {layer_name} uses {', '.join(problems)}, which the "
            "tree attention does not support yet; use method 'dflash' for this model.")
