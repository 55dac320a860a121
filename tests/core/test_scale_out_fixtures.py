"""The ``heads=`` argument of the tiny fixtures: tensor parallelism needs the query heads
divisible by the TP size, so the TP = 4 / 8 runs ask for 8-head pairs."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_ddtree.testing.fixtures import (
    HEAD_DIM,
    KV_HEADS,
    TOKEN_A,
    make_tiny_pair,
    make_weights,
)


def test_heads_argument_writes_its_own_folder_and_shapes(tmp_path):
    t8, d8 = make_tiny_pair(tmp_path, "tree_beats_chain", heads=8)
    t4, _ = make_tiny_pair(tmp_path, "tree_beats_chain", heads=4)  # the usual count
    assert t8.parent.name == "tree_beats_chain-float32-h8"
    assert t4.parent.name == "tree_beats_chain-float32"
    for d in (t8, d8):
        cfg = json.loads((d / "config.json").read_text())
        assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (8, KV_HEADS)
    tw, dw = make_weights("tree_beats_chain", heads=8)
    assert tw["model.layers.0.self_attn.q_proj.weight"].shape == (8 * HEAD_DIM, 128)
    assert tw["model.layers.0.self_attn.k_proj.weight"].shape == (KV_HEADS * HEAD_DIM, 128)
    assert dw["layers.1.self_attn.o_proj.weight"].shape == (128, 8 * HEAD_DIM)


def test_eight_head_tree_beats_chain_keeps_its_margins(tmp_path):
    """The target still emits ``A`` everywhere (its residual stream is the embedding,
    whatever the head count)."""
    from transformers import AutoModelForCausalLM

    target, _ = make_tiny_pair(tmp_path, "tree_beats_chain", heads=8)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    assert model.config.num_attention_heads == 8
    with torch.no_grad():
        logits = model(torch.tensor([[104, 105, 106, 32, 120]])).logits[0]
    assert logits.argmax(-1).tolist() == [TOKEN_A] * 5
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 50.0


@pytest.mark.parametrize("heads", [0, 3, -2])
def test_heads_must_be_a_positive_multiple_of_the_kv_heads(tmp_path, heads):
    with pytest.raises(ValueError, match=f"heads={heads}"):
        make_tiny_pair(tmp_path, "random", heads=heads)
    assert not any(tmp_path.iterdir())  # refused before anything was written
