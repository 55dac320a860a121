"""Row-wise log-sum-exp of draft logits with NaN/inf sanitizing, in one read pass.

NaN counts as -inf and +inf as the dtype's largest finite value.  With
``sanitize_inplace`` the kernel also rewrites those (rare) entries in ``x`` itself,
with a masked store, so ``torch.topk`` can then run on ``x`` directly.  A piece of the
tree build's :func:`~vllm_ddtree.tree.build.depth_candidates_triton` (for ``k`` beyond
the top-k kernel); the reference is ``torch.logsumexp`` over the sanitized float32
logits (the tree build's ``sanitized_logits``, as
:func:`~vllm_ddtree.tree.build.depth_candidates_torch` computes it).
"""

from __future__ import annotations

import torch

from vllm_ddtree.kernels.triton_utils import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _lse_kernel(X, LSE, V, stride, big, SANITIZE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        x_row = X + row.to(tl.int64) * stride
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < V
            raw = tl.load(x_row + offs, mask=ok, other=float("-inf"))
            x = raw.to(tl.float32)
            bad_nan = x != x
            bad_inf = x == float("inf")
            x = tl.where(bad_nan, float("-inf"), x)
            x = tl.where(bad_inf, big, x)
            if SANITIZE:
                fix = (bad_nan | bad_inf) & ok
                tl.store(x_row + offs, x.to(raw.dtype), mask=fix)
            m_new = tl.maximum(m, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
            m = m_new
        mx = tl.max(m, 0)
        mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
        total = tl.sum(s * tl.exp(m - mx_safe), 0)
        tl.store(LSE + row, tl.where(total == 0.0, float("-inf"), mx_safe + tl.log(total)))


def logsumexp_sanitize_triton(
    x: torch.Tensor,  # [rows, V] logits, last dim contiguous
    sanitize_inplace: bool = False,
) -> torch.Tensor:
    """The Triton launcher: sanitized log-sum-exp of each row of ``x``, float32
    ``[rows]``, one program per row.  With ``sanitize_inplace``, NaN/+inf entries of
    ``x`` are overwritten by their sanitized values."""
    rows, V = x.shape
    assert x.stride(1) == 1
    lse = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        big = float(torch.finfo(x.dtype).max) if x.dtype.is_floating_point else 3.4e38
        _lse_kernel[(rows,)](x, lse, V, x.stride(0), min(big, 3.4028234663852886e38),
                             SANITIZE=sanitize_inplace, BLOCK=2048, num_warps=8)
    return lse
