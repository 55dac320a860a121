"""Per-node target sampling for lossless tree verification at T > 0.

Every verify row (the root and each node) draws the target's own token from that row's
processed distribution; the walk then follows the child equal to the draw.  Each
committed token is therefore a plain sample of the target given its accepted prefix,
whatever the tree (the DDTree paper's rule; SpecInfer/EAGLE with deterministic drafts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_EPS = 1e-5


# (logits [N, V], top_k [N] or None, top_p [N] or None) -> masked logits [N, V]
TopKTopP = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


def top_k_top_p_torch(
    logits: torch.Tensor,  # [N, V]
    k: torch.Tensor | None,  # [N] top-k per row
    p: torch.Tensor | None,  # [N] top-p per row
) -> torch.Tensor:
    """Mask logits outside each row's top-k / top-p set (k >= vocab or p >= 1: no-op).
    The signature of vLLM's ``apply_top_k_top_p``, which a runner may pass to
    :func:`sample_rows` instead."""
    if k is None and p is None:
        return logits
    srt, idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        kk = k.to(torch.long).clamp(1, logits.shape[-1])
        thresh = srt.gather(1, (logits.shape[-1] - kk).unsqueeze(1))
        srt = srt.masked_fill(srt < thresh, float("-inf"))
    if p is not None:
        cum = srt.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - p.unsqueeze(1)
        drop[:, -1] = False
        srt = srt.masked_fill(drop, float("-inf"))
    return logits.scatter(-1, idx, srt)


def sample_rows(
    logits: torch.Tensor,  # [N, V] float32
    temperature: torch.Tensor,  # [N]
    top_k: torch.Tensor | None = None,  # [N]
    top_p: torch.Tensor | None = None,  # [N]
    min_p: torch.Tensor | None = None,  # [N]
    generators: dict[int, torch.Generator] | None = None,  # row -> its generator
    top_k_top_p: TopKTopP = top_k_top_p_torch,
) -> torch.Tensor:  # [N] int64
    """One token per row of ``logits [N, V]`` (float32).

    Rows with ``temperature < 1e-5`` take the argmax.  Otherwise: temperature, then
    min-p, then top-k/top-p, then an exponential race (``argmax(probs / Exp(1))``, an
    exact draw from ``probs``) whose noise comes from ``generators[row]`` when given.
    """
    greedy = logits.argmax(dim=-1)
    t = temperature.to(logits.dtype).clamp(min=_EPS).unsqueeze(1)
    x = logits / t
    if min_p is not None:
        probs = x.softmax(dim=-1)
        keep = probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        x = x.masked_fill(~keep, float("-inf"))
    x = top_k_top_p(x, top_k, top_p)
    probs = x.softmax(dim=-1)
    q = torch.empty_like(probs)
    if not generators or len(generators) != probs.shape[0]:
        q.exponential_()
    for row, gen in (generators or {}).items():
        q[row].exponential_(generator=gen)
    drawn = (probs / q).argmax(dim=-1)
    return torch.where(temperature < _EPS, greedy, drawn)


def keyed_generator(seed: int, position: int) -> torch.Generator:
    """A CPU generator whose state depends only on (request seed, token position)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (1 << 63)
    return torch.Generator().manual_seed(mixed)
