"""The tiny checkpoint fixtures: deterministic, loadable, and with the promised margins."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_ddtree.testing import fixtures as fx
from vllm_ddtree.testing.fixtures import TOKEN_A, TOKEN_B, make_tiny_pair

DRAFTER_KEYS = {
    f"layers.{i}.{name}.weight"
    for i in range(2)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj", "input_layernorm", "post_attention_layernorm")
} | {"fc.weight", "hidden_norm.weight", "norm.weight"}


pytestmark = pytest.mark.usefixtures("one_thread")


def _files(d):
    return {p.relative_to(d).as_posix(): p.read_bytes()
            for p in sorted(d.rglob("*")) if p.is_file()}


def test_deterministic_bytes(tmp_path):
    for variant in fx.VARIANTS:
        a = make_tiny_pair(tmp_path / "a", variant)[0].parent
        b = make_tiny_pair(tmp_path / "b", variant)[0].parent
        fa, fb = _files(a), _files(b)
        assert set(fa) >= {"target/model.safetensors", "target/config.json",
                           "target/tokenizer.json", "target/tokenizer_config.json",
                           "drafter/model.safetensors", "drafter/config.json", ".complete"}
        assert fa == fb, variant
    # variants really differ
    assert (_files(tmp_path / "a" / "random-float32")
            != _files(tmp_path / "a" / "accept_all-float32"))


def test_cache_marker_and_errors(tmp_path):
    t, _ = make_tiny_pair(tmp_path, "random")
    st = t / "model.safetensors"
    st.write_bytes(b"sentinel")  # a completed pair is reused as is
    make_tiny_pair(tmp_path, "random")
    assert st.read_bytes() == b"sentinel"
    (t.parent / ".complete").unlink()  # no marker -> rewritten
    make_tiny_pair(tmp_path, "random")
    assert st.read_bytes() != b"sentinel"
    with pytest.raises(ValueError, match="accept_all"):
        make_tiny_pair(tmp_path, "nope")
    with pytest.raises(ValueError, match="bfloat16"):
        make_tiny_pair(tmp_path, "random", "int8")


def test_loads_with_transformers(root):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t, d = make_tiny_pair(root, "random")
    model = AutoModelForCausalLM.from_pretrained(t)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.vocab_size) == (6, 128, 4, 2, 64, 256, 512)
    assert not cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    # every stored tensor was loaded (no random re-init): compare with the file
    stored = load_file(str(t / "model.safetensors"))
    assert set(stored) == set(model.state_dict())
    assert all(torch.equal(stored[k], v) for k, v in model.state_dict().items())

    tok = AutoTokenizer.from_pretrained(t)
    assert len(tok) == 259 and tok.eos_token_id == 258 and tok.pad_token_id == 256
    text = "héllo, wörld\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [256, 257, 258]
    assert tok.encode("a<|im_end|>", add_special_tokens=False) == [TOKEN_A, 258]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    dcfg_raw = json.loads((d / "config.json").read_text())
    assert dcfg_raw["architectures"] == ["DFlashDraftModel"] and dcfg_raw["block_size"] == 16
    assert dcfg_raw["num_target_layers"] == 6
    assert dcfg_raw["dflash_config"] == {"mask_token_id": 259, "target_layer_ids": [1, 2, 4]}
    dcfg = AutoConfig.from_pretrained(d)
    assert dcfg.model_type == "qwen3" and dcfg.num_hidden_layers == 2
    assert set(load_file(str(d / "model.safetensors"))) == DRAFTER_KEYS


def test_bfloat16_variant(root):
    from safetensors.torch import load_file

    t, d = make_tiny_pair(root, "accept_all", "bfloat16")
    assert t.parent.name == "accept_all-bfloat16"
    for p in (t, d):
        sd = load_file(str(p / "model.safetensors"))
        assert {v.dtype for v in sd.values()} == {torch.bfloat16}
        assert json.loads((p / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _target(root, variant):
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.testing.reference_decode import DFlashDrafterRef

    t, d = make_tiny_pair(root, variant)
    return (AutoModelForCausalLM.from_pretrained(t, attn_implementation="eager").eval(),
            DFlashDrafterRef.from_pretrained(d))


def _prompts(n=6):
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, 260, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g)
            for _ in range(n)]


def _top3(logits):
    v, i = logits.topk(3, dim=-1)
    return v, i


@pytest.mark.parametrize("variant", ["accept_all", "tree_beats_chain"])
@torch.no_grad()
def test_constant_variant_margins(root, variant):
    target, drafter = _target(root, variant)
    for ids in _prompts():
        out = target(ids[None], output_hidden_states=True)
        v, i = _top3(out.logits[0])
        assert (i[:, 0] == TOKEN_A).all()
        assert (v[:, 0] - v[:, 1]).min() > 50
        ctx = drafter.context_features(out.hidden_states)
        root_tok = int(torch.randint(0, 260, (1,)))
        dv, di = _top3(drafter.draft_logits(target, ctx, root_tok))  # [15, 3]
        if variant == "accept_all":
            assert (di[:, 0] == TOKEN_A).all() and (dv[:, 0] - dv[:, 1]).min() > 50
        else:
            assert (di[:, 0] == TOKEN_B).all() and (di[:, 1] == TOKEN_A).all()
            assert (dv[:, 0] - dv[:, 1]).min() > 10
            assert (dv[:, 1] - dv[:, 2]).min() > 50


@torch.no_grad()
def test_random_variant_margins(root):
    target, drafter = _target(root, "random")
    gaps, dgaps = [], []
    for ids in _prompts(10):
        out = target(ids[None], output_hidden_states=True)
        v, i = _top3(out.logits[0])
        assert (i[:, 0] < 256).all()  # greedy never emits a special or padding id
        gaps.append(v[:, 0] - v[:, 1])
        dv, _ = _top3(drafter.draft_logits(target, drafter.context_features(out.hidden_states), 97))
        dgaps.append(dv[:, 0] - dv[:, 1])
    gaps, dgaps = torch.cat(gaps), torch.cat(dgaps)
    assert (gaps < 1e-3).float().mean() < 0.01  # fp32 token equality is not flaky
    assert 0.05 < gaps.median() < 2.0  # neither flat nor degenerate
    assert dgaps.median() > 0.02  # the drafter is not flat either


def test_eight_head_pairs_for_tensor_parallel_runs(tmp_path):
    """VLLM_DDTREE_FIXTURE_HEADS=8 (TP = 8 needs 8 query heads) writes its own folders, and
    the tree_beats_chain margins do not depend on the head count."""
    import subprocess
    import sys

    code = ("import json, torch; from transformers import AutoModelForCausalLM; "
            "from vllm_ddtree.testing.fixtures import make_tiny_pair; "
            f"t, d = make_tiny_pair({str(tmp_path)!r}, 'tree_beats_chain'); "
            "m = AutoModelForCausalLM.from_pretrained(str(t), dtype=torch.float32); "
            "print(t.parent.name, m.config.num_attention_heads, "
            "m(torch.tensor([[104, 105, 106]])).logits[0].argmax(-1).tolist())")
    env = {**__import__("os").environ, "VLLM_DDTREE_FIXTURE_HEADS": "8"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[:2] == ["tree_beats_chain-float32-h8", "8"]
    assert " ".join(out[2:]) == f"[{TOKEN_A}, {TOKEN_A}, {TOKEN_A}]"
