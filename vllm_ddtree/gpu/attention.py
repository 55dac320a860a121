"""Tree attention for the target model on GPU: vLLM's FlashAttention backend plus the
project's Triton tree kernel (vLLM ships no tree attention backend any more).

Registered over ``FLASH_ATTN`` only in worker processes that run DDTree (see
``vllm_ddtree/_patch/gpu_runner.py``).  Its metadata builder attaches tree metadata to
*target* layers' metadata in steps that verify trees; drafter layers and every other
step run vLLM's code unchanged.

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

import torch
from vllm.v1.attention.backends import flash_attn as fa
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadataBuilder)

from vllm_ddtree.gpu import buffers as state_mod
from vllm_ddtree.kernels.tree_attention import tree_attention_triton


@dataclass
class TreeAttnMeta:
    fused: bool  # FA3 prefix + in-place tree merge (all q_len <= W)
    prefix_lens: torch.Tensor  # [R] int32
    query_end: torch.Tensor | None  # [R] int32 (recompute mode: rows to redo)
    bits: torch.Tensor  # [T, NW] int32
    width: int  # W


class DDTreeFlashAttentionBuilder(FlashAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        n = vllm_config.scheduler_config.max_num_seqs
        self._ddtree_prefix = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self._ddtree_qend = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self._ddtree_is_target: bool | None = None
        # read once, as vLLM's own builder does for its AOT schedule (a per-step call
        # walks vLLM's platform and config checks on the host)
        self._ddtree_fa3 = fa.get_flash_attn_version() == 3

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        meta.ddtree = None
        tree = state_mod.ACTIVE
        if tree is None or not tree.step_has_trees:
            return meta
        if self._ddtree_is_target is None:
            # the target runner's groups may also list drafter layers; the drafter's
            # own builders list only drafter layers
            self._ddtree_is_target = not all(n in tree.draft_layer_names
                                             for n in self.layer_names)
        if not self._ddtree_is_target:
            return meta
        cam = common_attn_metadata
        n = cam.num_reqs
        qsl = cam.query_start_loc
        qlen = qsl[1 : n + 1] - qsl[:n]
        prefix = self._ddtree_prefix[:n]
        torch.sub(cam.seq_lens[:n], qlen, out=prefix)
        fused = cam.max_query_len <= tree.W and self._ddtree_fa3
        qend = None
        if not fused:
            qend = self._ddtree_qend[:n]
            torch.where(qlen <= tree.W, qsl[1 : n + 1], qsl[:n], out=qend)
        meta.ddtree = TreeAttnMeta(fused, prefix, qend, tree.row_bits, tree.W)
        return meta


class DDTreeFlashAttentionImpl(FlashAttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        t = getattr(attn_metadata, "ddtree", None)
        if t is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                   output, output_scale, output_block_scale)
        m = attn_metadata
        n = m.num_actual_tokens
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        q = query[:n]
        out = output[:n]
        if t.fused:
            _, lse = fa.flash_attn_varlen_func(
                q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=m.query_start_loc,
                max_seqlen_q=m.max_query_len, seqused_k=t.prefix_lens,
                max_seqlen_k=m.max_seq_len, softmax_scale=self.scale, causal=False,
                block_table=m.block_table, return_softmax_lse=True,
                fa_version=self.vllm_flash_attn_version, num_splits=m.max_num_splits)
            tree_attention_triton(q, key_cache, value_cache, m.block_table, m.query_start_loc,
                                  t.prefix_lens, t.bits, self.scale, include_prefix=False,
                                  max_rows=t.width, out=out, prefix_out_lse=lse,
                                  return_lse=False)
        else:
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                            output_scale, output_block_scale)
            tree_attention_triton(q, key_cache, value_cache, m.block_table, m.query_start_loc,
                                  t.prefix_lens, t.bits, self.scale, include_prefix=True,
                                  max_rows=t.width, query_end=t.query_end, out=out,
                                  return_lse=False)
        return output


class DDTreeFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return DDTreeFlashAttentionImpl

    @staticmethod
    def get_builder_cls():
        return DDTreeFlashAttentionBuilder


def check_target_layer(layer_name: str, impl) -> None:
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
