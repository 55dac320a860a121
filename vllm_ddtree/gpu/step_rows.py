"""The verify rows of one target step: what the tree attention reads.

Written once per step by :meth:`StepRows.fill` from the trees of the step's requests
(:meth:`~vllm_ddtree.gpu.tree_state.TreeStates.fill_rows`, called from the model state's
``prepare_attn``), read by the tree attention's metadata
builder and kernels, by the model state (RoPE positions) and by the verifier (each
node's position).  Persistent buffers: their addresses are baked into CUDA graphs.
Pure torch (no vLLM import).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import torch

from vllm_ddtree.gpu.rows import fill_tree_rows


class StepRows:
    """``T`` below is ``max_num_tokens`` (the step's token rows), ``S`` ``max_num_reqs``,
    ``W = max_rows = budget + 1`` (verify rows of one request), ``NW = ceil(W / 32)``."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, budget: int,
                 device: torch.device | str, step_budgets: Iterable[int] = ()) -> None:
        self.max_rows = budget + 1
        self.num_words = (self.max_rows + 31) // 32
        # verify widths a step can have (1 + each budget of a per-batch-size schedule)
        self.verify_widths = sorted({1 + b for b in step_budgets if b < budget}
                                    | {self.max_rows})
        # [T, NW] int32: row i attends to row j of its request iff bit j is set
        self.bits = torch.zeros((max_num_tokens, self.num_words), dtype=torch.int32,
                                device=device)
        # [T] int64: RoPE positions (tree rows: root position + depth)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        # [S] int32: each request's KV length before the step's rows
        self.prefix_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        # [S] int32: end of the rows a mixed step's tree kernel recomputes
        self.query_end = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        # host flag: this step verifies trees (else the attention runs vLLM's own path)
        self.has_trees = False

    def fill(
        self,
        query_start: torch.Tensor,  # [num_reqs_padded + 1] int32 vLLM's query_start_loc
        cu_num_logits: torch.Tensor,  # [num_reqs + 1] int32
        idx_mapping: torch.Tensor,  # [num_reqs] int32 batch row -> request state
        positions: torch.Tensor,  # [num_tokens_padded] int64 linear positions
        seq_lens: torch.Tensor,  # [num_reqs_padded] int32
        ancestor_bits: torch.Tensor,  # [S, W, NW] int32 the trees' bits by request state
        depths: torch.Tensor,  # [S, W] int64 the trees' row depths by request state
        num_reqs: int,
        num_reqs_padded: int,
        num_tokens_padded: int,
        has_trees: bool,
    ) -> None:
        """Write the step's rows: every verify row's ancestor bits and RoPE position,
        every request's prefix length and recompute end (one launch on the GPU,
        :func:`~vllm_ddtree.gpu.rows.fill_tree_rows`), and whether the step verifies
        trees."""
        fill_tree_rows(query_start, cu_num_logits, idx_mapping, positions, seq_lens,
                       ancestor_bits, depths, self.bits, self.positions, self.prefix_lens,
                       self.query_end, num_reqs, num_reqs_padded, num_tokens_padded)
        self.has_trees = has_trees

    def kernel_rows(self, max_query_len: int, uniform: bool) -> int:
        """Verify rows per request that a fused tree-attention launch covers in a step
        whose longest request has ``max_query_len <= max_rows`` rows.  A uniform batch
        (every request ``max_query_len`` rows: the decode steps CUDA-graph capture runs)
        takes the narrowest verify width that holds them, so an adaptive engine's narrow
        steps take the narrow tiling, one its capture compiled.  A mixed batch (short
        prefills beside trees, never captured) takes the widest: the tiling follows the
        width and the request count, and capture runs narrow widths only at the batch
        sizes that verify them, so a narrow width at another request count would compile
        mid-serving; vLLM's warm-up and capture compile the widest at every size class."""
        if not uniform:
            return self.max_rows
        widths = self.verify_widths
        return widths[min(bisect.bisect_left(widths, max_query_len), len(widths) - 1)]
