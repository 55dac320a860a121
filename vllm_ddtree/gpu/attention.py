"""Tree attention for the target model on GPU: vLLM's FlashAttention backend plus the
project's Triton tree kernel (vLLM ships no tree attention backend).

The speculator switches each *target* attention layer to these subclasses, per instance,
over its engine's :class:`~vllm_ddtree.gpu.step_rows.StepRows`
(:func:`vllm_ddtree._patch.target_model.use_tree_attention`, then
:func:`check_target_layer`); drafter layers keep vLLM's FlashAttention.  vLLM later
builds the metadata builder from the layer's backend, and the
builder finds the step rows through its layers.  It attaches tree metadata to the target
layers' metadata in steps that verify trees; every other step runs vLLM's code unchanged.

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
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends import flash_attn as fa
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadata,
    FlashAttentionMetadataBuilder,
)

from vllm_ddtree.gpu.step_rows import StepRows
from vllm_ddtree.kernels.tree_attention import tree_attention_triton
from vllm_ddtree.support import attention_problems, refuse_layer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import AttentionSpec

#: head sizes the tree kernel is compiled and tested for
HEAD_SIZES = (64, 128, 256)


@dataclass(frozen=True)
class TreeAttnMeta:
    fused: bool  # FA3 prefix + in-place tree merge (all q_len <= max_rows)
    prefix_lens: torch.Tensor  # [num_reqs] int32 KV length before this step's rows
    query_end: torch.Tensor | None  # [num_reqs] int32 (recompute mode: rows to redo)
    row_bits: torch.Tensor  # [num_tokens, NW] int32 ancestor bits of every query row
    max_rows: int  # verify rows a request may have in this step (at most 1 + budget)


def step_rows_of_layers(vllm_config: VllmConfig, layer_names: list[str]) -> StepRows:
    """The step rows the layers ``layer_names`` were switched over (found in vLLM's
    per-engine ``static_forward_context``)."""
    forward_context = vllm_config.compilation_config.static_forward_context
    found: dict[int, StepRows] = {}
    for name in layer_names:
        rows = getattr(getattr(forward_context.get(name), "impl", None), "step_rows", None)
        if rows is not None:
            found[id(rows)] = rows
    if len(found) != 1:
        problem = "no DDTree step rows" if not found else "the step rows of several engines"
        raise RuntimeError(
            f"vllm-ddtree: the tree attention builder of layers {list(layer_names)} found "
            f"{problem}; DDTreeSpeculator.load_model switches each target layer before "
            "vLLM builds the builders.")
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
        self._step_rows = step_rows_of_layers(vllm_config, layer_names)
        # read once, as vLLM's own builder does for its AOT schedule (a per-step call
        # walks vLLM's platform and config checks on the host)
        self._fa3 = fa.get_flash_attn_version() == 3

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlashAttentionMetadata:
        rows = self._step_rows
        if not rows.has_trees:
            meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
            meta.ddtree = None
            return meta
        common = common_attn_metadata
        num_reqs = common.num_reqs
        prefix_lens = rows.prefix_lens[:num_reqs]
        fused = common.max_query_len <= rows.max_rows and self._fa3
        if fused:
            # vLLM's builder then makes FA3's schedule (scheduler_metadata, kept in its
            # persistent buffer under FULL CUDA graphs) for the call forward makes:
            # non-causal over each request's prefix.  Without it FA3 plans the split
            # inside every layer's call (one more kernel per layer and step).
            meta = super().build(0, common.replace(seq_lens=prefix_lens, causal=False),
                                 fast_build)
            # the step's own width (an adaptive engine's steps are narrower than its
            # largest budget): the kernel's grid and tiling follow it
            uniform = common.num_actual_tokens == num_reqs * common.max_query_len
            tree = TreeAttnMeta(True, prefix_lens, None, rows.bits,
                                rows.kernel_rows(common.max_query_len, uniform))
        else:
            meta = super().build(common_prefix_len, common, fast_build)
            tree = TreeAttnMeta(False, prefix_lens, rows.query_end[:num_reqs], rows.bits,
                                rows.max_rows)
        meta.ddtree = tree
        return meta


class DDTreeFlashAttentionImpl(FlashAttentionImpl):
    # this engine's step rows (set by use_tree_attention; vLLM creates the impl as a
    # FlashAttentionImpl, so there is no constructor of this class to pass them to)
    step_rows: StepRows
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
        if not tree.fused:
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                            output_scale, output_block_scale)
            tree_attention_triton(q, key_cache, value_cache, meta.block_table,
                                  meta.query_start_loc, tree.prefix_lens, tree.row_bits,
                                  self.scale, include_prefix=True, max_rows=tree.max_rows,
                                  query_end=tree.query_end, out=out, return_lse=False)
            return output
        if not self._ddtree_unfused_ready:
            self._compile_unfused(q, key_cache, value_cache, meta, tree, out)
        # FA3 reads the caches through TMA, which needs 16-byte strides on size-1 dims
        # (one KV head per rank), as vLLM's own forward arranges
        _, lse = fa.flash_attn_varlen_func(
            q=q, k=canonicalize_singleton_dim_strides(key_cache),
            v=canonicalize_singleton_dim_strides(value_cache), out=out,
            cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len,
            seqused_k=tree.prefix_lens, max_seqlen_k=meta.max_seq_len,
            softmax_scale=self.scale, causal=False, block_table=meta.block_table,
            return_softmax_lse=True, scheduler_metadata=meta.scheduler_metadata,
            fa_version=self.vllm_flash_attn_version, num_splits=meta.max_num_splits)
        tree_attention_triton(q, key_cache, value_cache, meta.block_table,
                              meta.query_start_loc, tree.prefix_lens, tree.row_bits,
                              self.scale, include_prefix=False, max_rows=tree.max_rows,
                              out=out, prefix_out_lse=lse, return_lse=False)
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
        warm-up and capture passes run uniform tree steps (the fused variant), so the
        first mixed step would compile it mid-serving.  Done in the first uncaptured
        tree step with the step's own tensors (Triton specializes on their alignment and
        strides) and every request's row range empty (``query_end = query_start``): the
        launch writes nothing."""
        if torch.cuda.is_current_stream_capturing():
            return  # a launch here would be recorded into the graph
        num_reqs = meta.block_table.shape[0]
        tree_attention_triton(q, key_cache, value_cache, meta.block_table,
                              meta.query_start_loc, tree.prefix_lens, tree.row_bits,
                              self.scale, include_prefix=True,
                              max_rows=self.step_rows.max_rows,  # as mixed steps pass it
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
    """Refuse target attention features the tree attention does not implement: those no
    tree verify supports, and this path's own (vLLM's FlashAttention, the kernel's head
    sizes)."""
    problems = attention_problems(impl)
    if not isinstance(impl, DDTreeFlashAttentionImpl):
        problems.append(f"attention backend {type(impl).__name__} (DDTree needs FLASH_ATTN)")
    elif impl.head_size not in HEAD_SIZES:
        problems.append(f"head size {impl.head_size}")
    refuse_layer(layer_name, problems, "GPU")
