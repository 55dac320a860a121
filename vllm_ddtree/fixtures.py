"""Tiny, deterministic Qwen3 target + DFlash drafter checkpoints for tests.

``make_tiny_pair(root, variant, dtype)`` writes (no downloads, fixed seeds) a pair in the
published formats (docs: dflash-format.md sections 2 and 5) and returns
``(target_dir, drafter_dir)``:

* target: ``Qwen3ForCausalLM``, 6 layers, hidden 128, 4 heads / 2 KV heads, head_dim 64,
  intermediate 256, untied, vocab 512 padded past a 259-token byte-level BPE tokenizer
  (id = byte value for 0..255, then ``<|endoftext|>`` 256, ``<|im_start|>`` 257,
  ``<|im_end|>`` 258) with a ChatML template.
* drafter: ``DFlashDraftModel`` (z-lab key set), 2 layers, ``block_size`` 16,
  ``num_target_layers`` 6, ``dflash_config {mask_token_id: 259, target_layer_ids:
  [1, 2, 4]}``, root-level weight names, no ``embed_tokens`` / ``lm_head``.

Variants:

``random``
    Gaussian weights: projections (and ``fc``) std 0.1, embeddings std 0.02, so the
    layers outweigh the embedding and greedy text does not collapse into a repeated
    token; ``lm_head`` std 0.1 (top-1/top-2 logit gap: median ~0.25, < 1e-3 at ~0.5% of
    positions) with rows >= 256 zero, so greedy decoding emits byte tokens only (never
    EOS or a padding id); RMSNorm weights ``1 + N(0, 0.1)``.
``accept_all``
    Every ``o_proj`` / ``down_proj`` is zero in both models, so the residual stream is
    the token embedding.  Every embedding row (mask row included) is ``1.0`` on dims 0
    and 1 plus U(-0.01, 0.01) noise elsewhere; ``lm_head`` row ``A`` = 10 e0, row ``B`` =
    10 e1, other rows N(0, 0.02); final norms (target ``model.norm``, drafter ``norm``)
    are 1 on dim 0, 0 on dim 1, U(0, 0.01) elsewhere.  Both models emit ``A`` at every
    position with a logit margin of about 80.
``tree_beats_chain``
    As ``accept_all``, but the drafter's ``norm`` has 1.2 on dim 1: the drafter's top-1 is
    always ``B`` (logit ~96), its runner-up ``A`` (~80), the third token far below.  A
    DFlash chain accepts nothing; a tree with budget >= D + 1 holds ``A`` at depth 1.

``A`` = ``TOKEN_A`` = 97 (byte "a"), ``B`` = ``TOKEN_B`` = 98 (byte "b").

CLI: ``python -m vllm_ddtree.fixtures OUT_DIR [--dtype float32]`` prints the paths.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import torch

FIXTURE_VERSION = "1"
VARIANTS = ("random", "accept_all", "tree_beats_chain")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

TOKEN_A, TOKEN_B = 97, 98  # bytes "a", "b"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
MASK_TOKEN_ID = 259
BOS_ID, EOS_ID = 256, 258
VOCAB, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 512, 128, 256, 4, 2, 64
TARGET_LAYERS, DRAFT_LAYERS, BLOCK_SIZE = 6, 2, 16
TARGET_LAYER_IDS = [1, 2, 4]
ROPE_THETA, RMS_EPS, MAX_POS = 1_000_000.0, 1e-6, 4096
EMBED_STD, LINEAR_STD, LM_HEAD_STD, NORM_STD = 0.02, 0.1, 0.1, 0.1

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ---------------------------------------------------------------- configs ------------
def _common_config(num_layers: int, dtype: str) -> dict:
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "layer_types": ["full_attention"] * num_layers,
        "max_position_embeddings": MAX_POS,
        "max_window_layers": num_layers,
        "model_type": "qwen3",
        "num_attention_heads": HEADS,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": RMS_EPS,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "torch_dtype": dtype,
        "dtype": dtype,
        "transformers_version": "4.57.3",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }


def target_config(dtype: str = "float32") -> dict:
    cfg = _common_config(TARGET_LAYERS, dtype)
    cfg.update(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False,
               pad_token_id=BOS_ID, tokenizer_class="PreTrainedTokenizerFast")
    return cfg


def drafter_config(dtype: str = "float32") -> dict:
    cfg = _common_config(DRAFT_LAYERS, dtype)
    cfg.update(architectures=["DFlashDraftModel"],
               auto_map={"AutoModel": "dflash.DFlashDraftModel"},
               block_size=BLOCK_SIZE, num_target_layers=TARGET_LAYERS,
               dflash_config={"mask_token_id": MASK_TOKEN_ID,
                              "target_layer_ids": list(TARGET_LAYER_IDS)},
               tie_word_embeddings=True)
    return cfg


# ---------------------------------------------------------------- weights ------------
def _layer_shapes(prefix: str) -> dict[str, tuple[int, ...]]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {
        f"{prefix}self_attn.q_proj.weight": (q, HIDDEN),
        f"{prefix}self_attn.k_proj.weight": (kv, HIDDEN),
        f"{prefix}self_attn.v_proj.weight": (kv, HIDDEN),
        f"{prefix}self_attn.o_proj.weight": (HIDDEN, q),
        f"{prefix}self_attn.q_norm.weight": (HEAD_DIM,),
        f"{prefix}self_attn.k_norm.weight": (HEAD_DIM,),
        f"{prefix}mlp.gate_proj.weight": (INTER, HIDDEN),
        f"{prefix}mlp.up_proj.weight": (INTER, HIDDEN),
        f"{prefix}mlp.down_proj.weight": (HIDDEN, INTER),
        f"{prefix}input_layernorm.weight": (HIDDEN,),
        f"{prefix}post_attention_layernorm.weight": (HIDDEN,),
    }


def _target_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(TARGET_LAYERS):
        shapes.update(_layer_shapes(f"model.layers.{i}."))
    shapes.update({"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)})
    return shapes


def _drafter_shapes() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(DRAFT_LAYERS):
        shapes.update(_layer_shapes(f"layers.{i}."))
    shapes.update({"fc.weight": (HIDDEN, len(TARGET_LAYER_IDS) * HIDDEN),
                   "hidden_norm.weight": (HIDDEN,), "norm.weight": (HIDDEN,)})
    return shapes


def _gen(tag: str) -> torch.Generator:
    """A generator seeded by the tensor's name alone (order-independent, stable)."""
    return torch.Generator().manual_seed(zlib.crc32(f"vllm-ddtree-fixture:{tag}".encode()))


def _random_weights(shapes: dict[str, tuple[int, ...]], model: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in shapes.items():
        g = _gen(f"{model}:{name}")
        if name.endswith("norm.weight"):
            out[name] = 1.0 + NORM_STD * torch.randn(shape, generator=g)
        elif name == "lm_head.weight":
            out[name] = LM_HEAD_STD * torch.randn(shape, generator=g)
            out[name][len(_byte_unicode()):] = 0.0  # specials and padding never win at T=0
        else:
            std = EMBED_STD if name.endswith("embed_tokens.weight") else LINEAR_STD
            out[name] = std * torch.randn(shape, generator=g)
    return out


def _constant_edit(tw: dict, dw: dict, drafter_b_weight: float) -> None:
    """In-place edit for accept_all / tree_beats_chain (see module docstring)."""
    for sd in (tw, dw):
        for name in sd:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                sd[name].zero_()
    emb = (torch.rand(VOCAB, HIDDEN, generator=_gen("const:embed")) * 2 - 1) * 0.01
    emb[:, 0:2] = 1.0
    tw["model.embed_tokens.weight"] = emb
    head = 0.02 * torch.randn(VOCAB, HIDDEN, generator=_gen("const:lm_head"))
    head[TOKEN_A] = 0.0
    head[TOKEN_B] = 0.0
    head[TOKEN_A, 0] = 10.0
    head[TOKEN_B, 1] = 10.0
    tw["lm_head.weight"] = head
    norm = torch.rand(HIDDEN, generator=_gen("const:norm")) * 0.01
    norm[0], norm[1] = 1.0, 0.0
    tw["model.norm.weight"] = norm
    dnorm = norm.clone()
    dnorm[1] = drafter_b_weight
    dw["norm.weight"] = dnorm


def make_weights(variant: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """float32 (target, drafter) state dicts of ``variant``."""
    if variant not in VARIANTS:
        raise ValueError(f"Unknown fixture variant {variant!r}; valid: {', '.join(VARIANTS)}")
    tw = _random_weights(_target_shapes(), "target")
    dw = _random_weights(_drafter_shapes(), "drafter")
    if variant == "accept_all":
        _constant_edit(tw, dw, drafter_b_weight=0.0)
    elif variant == "tree_beats_chain":
        _constant_edit(tw, dw, drafter_b_weight=1.2)
    return tw, dw


# ---------------------------------------------------------------- tokenizer ----------
def _byte_unicode() -> list[str]:
    """GPT-2 byte -> printable unicode char table (what ByteLevel pre-tokenizers use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def write_tokenizer(out: Path) -> None:
    """tokenizer.json (byte-level BPE, no merges) + tokenizer_config.json (ChatML)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(_byte_unicode())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    added = {str(256 + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True}
             for i, t in enumerate(SPECIAL_TOKENS)}
    cfg = {
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MAX_POS,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    _write_json(out / "tokenizer_config.json", cfg)


# ---------------------------------------------------------------- writing ------------
def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _save(weights: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    sd = {k: weights[k].to(dtype).contiguous() for k in sorted(weights)}
    save_file(sd, str(path), metadata={"format": "pt"})


def make_tiny_pair(root: str | Path, variant: str = "random",
                   dtype: str = "float32") -> tuple[Path, Path]:
    """Write (once) and return ``(target_dir, drafter_dir)`` under ``root/<variant>-<dtype>``.

    A finished pair holds a ``.complete`` marker naming ``FIXTURE_VERSION``; a pair with
    a matching marker is reused as is, anything else there is rewritten.
    """
    if variant not in VARIANTS:
        raise ValueError(f"Unknown fixture variant {variant!r}; valid: {', '.join(VARIANTS)}")
    if dtype not in DTYPES:
        raise ValueError(f"Unknown fixture dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    root = Path(root)
    final = root / f"{variant}-{dtype}"
    marker = final / ".complete"
    pair = (final / "target", final / "drafter")
    if marker.is_file() and marker.read_text() == FIXTURE_VERSION:
        return pair
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{variant}-{dtype}.", dir=root))
    try:
        tw, dw = make_weights(variant)
        t_dir, d_dir = tmp / "target", tmp / "drafter"
        t_dir.mkdir()
        d_dir.mkdir()
        _save(tw, t_dir / "model.safetensors", DTYPES[dtype])
        _write_json(t_dir / "config.json", target_config(dtype))
        write_tokenizer(t_dir)
        _save(dw, d_dir / "model.safetensors", DTYPES[dtype])
        _write_json(d_dir / "config.json", drafter_config(dtype))
        (tmp / ".complete").write_text(FIXTURE_VERSION)
        for p in [tmp, t_dir, d_dir]:
            os.chmod(p, 0o755)  # mkdtemp makes 0700, safetensors 0600 files
        for p in tmp.rglob("*"):
            if p.is_file():
                os.chmod(p, 0o644)
        if final.exists():
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished the same pair first
            if not (marker.is_file() and marker.read_text() == FIXTURE_VERSION):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return pair


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m vllm_ddtree.fixtures",
                                description="Write the tiny Qwen3 + DFlash test pairs.")
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = p.parse_args(argv)
    for variant in VARIANTS:
        target, drafter = make_tiny_pair(args.out_dir, variant, args.dtype)
        print(f"{variant}: target={target} drafter={drafter}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
