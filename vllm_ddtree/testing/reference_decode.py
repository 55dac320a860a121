"""Plain-PyTorch oracles (no vLLM): the DFlash drafter forward and batch-1 DFlash /
DDTree decode loops over a Hugging Face target.

Correctness over speed: every step reruns the target on the whole committed prefix plus
the drafted block/tree (no KV cache), with explicit positions and a 4-D float mask.
Load the target with ``attn_implementation="eager"`` or ``"sdpa"`` (custom 4-D masks).

Conventions (as in z-lab's ``spec_generate`` and the DDTree reference):

* The *root* of a step is the last committed token (the previous bonus), at position
  ``start``; the drafter's context is the target's features of positions ``0..start-1``.
* ``accept_lengths[i]`` = tokens committed by step ``i`` = drafted tokens accepted + 1
  (the bonus), so ``D + 1`` at most.  The token sampled from the prefill is not a step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_ddtree.tree import DraftTree, build_tree, walk_tree


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm (computed in float32, weight applied in the input dtype)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style RoPE on ``x [T, heads, head_dim]`` at positions ``pos [T]``."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = pos.float()[:, None] * inv[None, :]
    cos = torch.cat([ang, ang], -1).cos()[:, None, :].to(x.dtype)
    sin = torch.cat([ang, ang], -1).sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class DFlashDrafterRef:
    """The z-lab ``DFlashDraftModel`` forward (the published reference implementation), batch 1."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor]):
        self.cfg = config
        self.w = weights
        dc = config.get("dflash_config") or {}
        self.mask_token_id = int(dc.get("mask_token_id", config.get("mask_token_id")))
        self.target_layer_ids = [int(i) for i in dc["target_layer_ids"]]
        self.block_size = int(dc.get("block_size") or config["block_size"])
        self.num_layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config["num_key_value_heads"])
        self.head_dim = int(config.get("head_dim") or config["hidden_size"] // self.heads)
        self.eps = float(config["rms_norm_eps"])
        rope = config.get("rope_parameters") or {}
        self.theta = float(config.get("rope_theta") or rope["rope_theta"])

    @classmethod
    def from_pretrained(cls, path: str | Path,
                        dtype: torch.dtype | None = None) -> DFlashDrafterRef:
        from safetensors.torch import load_file

        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        weights = {}
        for f in sorted(path.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        if dtype is not None:
            weights = {k: v.to(dtype) for k, v in weights.items()}
        return cls(config, weights)

    def context_features(self, hidden_states) -> torch.Tensor:
        """HF ``output_hidden_states`` (batch 1) -> ``[T, n_ids * H]`` drafter context."""
        return torch.cat([hidden_states[i + 1][0] for i in self.target_layer_ids], dim=-1)

    def forward(self, context: torch.Tensor, block_embeds: torch.Tensor) -> torch.Tensor:
        """``context [n, n_ids*H]`` (positions 0..n-1), ``block_embeds [bs, H]`` (positions
        n..n+bs-1) -> final-normed block hidden states ``[bs, H]``."""
        w, eps, hd = self.w, self.eps, self.head_dim
        dt = w["fc.weight"].dtype
        ctx = _rms(F.linear(context.to(dt), w["fc.weight"]), w["hidden_norm.weight"], eps)
        x = block_embeds.to(dt)
        n, bs = ctx.shape[0], x.shape[0]
        pos = torch.arange(n + bs)
        for i in range(self.num_layers):
            p = f"layers.{i}."
            h = _rms(x, w[p + "input_layernorm.weight"], eps)
            q = F.linear(h, w[p + "self_attn.q_proj.weight"]).view(bs, self.heads, hd)
            kv_in = torch.cat([ctx, h], dim=0)
            k = F.linear(kv_in, w[p + "self_attn.k_proj.weight"]).view(n + bs, self.kv_heads, hd)
            v = F.linear(kv_in, w[p + "self_attn.v_proj.weight"]).view(n + bs, self.kv_heads, hd)
            q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"], eps), pos[n:], self.theta)
            k = _rope(_rms(k, w[p + "self_attn.k_norm.weight"], eps), pos, self.theta)
            rep = self.heads // self.kv_heads  # GQA: query head j reads KV head j // rep
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            att = torch.einsum("qhd,khd->hqk", q, k).float() * hd ** -0.5
            o = torch.einsum("hqk,khd->qhd", att.softmax(-1).to(v.dtype), v)  # non-causal
            x = x + F.linear(o.reshape(bs, -1), w[p + "self_attn.o_proj.weight"])
            h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            mlp = (F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"]))
                   * F.linear(h, w[p + "mlp.up_proj.weight"]))
            x = x + F.linear(mlp, w[p + "mlp.down_proj.weight"])
        return _rms(x, w["norm.weight"], eps)

    __call__ = forward

    @torch.no_grad()
    def draft_logits(self, target, context: torch.Tensor, root_token: int) -> torch.Tensor:
        """Float32 logits ``[bs-1, V]`` of block rows 1..bs-1 (target embed + lm_head)."""
        dev = context.device
        block = torch.full((self.block_size,), self.mask_token_id, dtype=torch.long, device=dev)
        block[0] = int(root_token)
        h = self.forward(context, target.get_input_embeddings()(block))
        head = target.get_output_embeddings()
        return head(h[1:].to(head.weight.dtype)).float()


# ------------------------------------------------------------------- decoding -------
def _pick(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """Per-row token: argmax at T=0, else one independent sample per row."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _verify(target, seq: list[int], tokens: torch.Tensor, parents: torch.Tensor,
            depths: torch.Tensor):
    """Run the target on ``seq[:-1] + [root] + tokens`` (root = ``seq[-1]``), each node
    seeing the prefix, its ancestors and itself.  Returns (float32 logits ``[1+n, V]`` of
    the root and the nodes, the HF hidden-states tuple, the root's position)."""
    dev = target.device
    start, n = len(seq) - 1, tokens.numel()
    ids = torch.tensor(seq, device=dev)
    ids = torch.cat([ids, tokens.to(dev)])[None]
    pos = torch.cat([torch.arange(start + 1), start + depths.cpu()]).to(dev)[None]
    total = start + 1 + n
    allowed = torch.ones(total, total, dtype=torch.bool).tril()
    allowed[start + 1:, start + 1:] = False
    for j in range(n):  # row of node j = ancestors (via its parent's row) + itself
        r = start + 1 + j
        par = int(parents[j])
        allowed[r, start + par] = True
        if par > 0:
            allowed[r, start + 1:] |= allowed[start + par, start + 1:]
        allowed[r, r] = True
    dt = target.get_input_embeddings().weight.dtype
    mask = torch.zeros(total, total, dtype=dt)
    mask.masked_fill_(~allowed, torch.finfo(dt).min)
    out = target(input_ids=ids, position_ids=pos, attention_mask=mask[None, None].to(dev),
                 output_hidden_states=True, use_cache=False)
    return out.logits[0, start:].float(), out.hidden_states, start


def _decode(target, drafter: DFlashDrafterRef, input_ids, max_new_tokens: int,
            temperature: float, generator, propose):
    seq = [int(t) for t in torch.as_tensor(input_ids).reshape(-1).tolist()]
    n_prompt = len(seq)
    with torch.no_grad():
        out = target(input_ids=torch.tensor([seq], device=target.device), output_hidden_states=True,
                     use_cache=False)
        seq.append(int(_pick(out.logits[0, -1].float(), temperature, generator)))
        ctx = drafter.context_features(out.hidden_states)
        accept_lengths = []
        while len(seq) - n_prompt < max_new_tokens:
            logits = drafter.draft_logits(target, ctx, seq[-1])
            tokens, parents, depths, walk = propose(logits)
            t_logits, hidden, start = _verify(target, seq, tokens, parents, depths)
            picks = _pick(t_logits, temperature, generator)
            path, bonus = walk(picks)  # accepted rows (0 = root, j+1 = node j), bonus
            seq += [int(tokens[j - 1]) for j in path[1:]] + [int(bonus)]
            feats = drafter.context_features(hidden)
            ctx = torch.cat([ctx, feats[start + torch.tensor(path, device=feats.device)]])
            accept_lengths.append(len(path))
    return seq[n_prompt:n_prompt + max_new_tokens], accept_lengths


def ddtree_generate(target, drafter: DFlashDrafterRef, input_ids, max_new_tokens: int,
                    budget: int, temperature: float = 0.0, generator=None):
    """DDTree at batch 1: tree of ``budget`` nodes over ``D = min(bs-1, budget)`` draft
    depths (``vllm_ddtree.tree.build_tree``, untempered draft logits), one target pass
    with an ancestor mask, walk (``walk_tree``) along the target's per-node picks.

    Returns ``(tokens, accept_lengths)``: the ``max_new_tokens`` generated ids and the
    tokens committed per step (accepted nodes + bonus)."""
    depth = min(drafter.block_size - 1, budget)

    def propose(logits):
        tree: DraftTree = build_tree(logits[None, :depth], budget)
        n = int(tree.num_nodes[0])

        def walk(picks):
            full = torch.full((1, tree.width + 1), -1, dtype=torch.int64)
            full[0, : n + 1] = picks.cpu()
            acc, num, bonus = walk_tree(tree, full)
            return acc[0, : int(num[0])].tolist(), int(bonus[0])

        return tree.token_ids[0, :n], tree.parents[0, :n], tree.depths[0, :n], walk

    return _decode(target, drafter, input_ids, max_new_tokens, temperature, generator, propose)


def dflash_generate(target, drafter: DFlashDrafterRef, input_ids, max_new_tokens: int,
                    num_draft: int | None = None, temperature: float = 0.0, generator=None):
    """DFlash chain at batch 1: the drafter's argmax at each of ``num_draft`` (default
    bs-1) depths, accept the longest prefix matching the target's picks."""
    depth = drafter.block_size - 1 if num_draft is None else min(num_draft, drafter.block_size - 1)

    def propose(logits):
        drafts = logits[:depth].argmax(-1).cpu()

        def walk(picks):
            picks = picks.cpu()
            acc = int((drafts == picks[:-1]).long().cumprod(0).sum())
            return list(range(acc + 1)), int(picks[acc])

        return drafts, torch.arange(depth), torch.arange(1, depth + 1), walk

    return _decode(target, drafter, input_ids, max_new_tokens, temperature, generator, propose)
