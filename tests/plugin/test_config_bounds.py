"""The largest budget and depth DDTree accepts (``vllm_ddtree.config``, "Bounds"), each
refused with a message naming the field and the limit: at config time (before any
weights load) for the budget and the depth, when the scheduler is built for the verify
width against its token budget."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vllm_ddtree
from vllm_ddtree.config import (
    MAX_BUDGET,
    DDTreeConfigError,
    DDTreeParams,
    attach_params,
    check_verify_fits,
    ddtree_params,
)
from vllm_ddtree.drafter import DrafterInfo, resolve_depth

pytestmark = pytest.mark.vllm

_BASE: dict[str, Any] = {
    "model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 2048, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 256, "eos_token_id": 256,
}


def _pair(root: Path, vocab: int) -> tuple[str, str]:
    """Config-only target and DFlash drafter (block_size 16) with ``vocab`` tokens."""
    folders = []
    for name, extra in (
        ("target", {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 6}),
        ("drafter", {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 2,
                     "block_size": 16, "num_target_layers": 6,
                     "dflash_config": {"mask_token_id": 259,
                                       "target_layer_ids": [1, 2, 4]}}),
    ):
        folder = root / f"{name}-{vocab}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({**_BASE, **extra,
                                                        "vocab_size": vocab}))
        folders.append(str(folder))
    return folders[0], folders[1]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Any, str]]:
    """vocab size -> (target ModelConfig, drafter folder)."""
    from vllm.config import ModelConfig

    vllm_ddtree.register()
    root = tmp_path_factory.mktemp("bounds")
    out = {}
    for vocab in (512, 4096):
        target, drafter = _pair(root, vocab)
        out[vocab] = (ModelConfig(model=target, tokenizer=target, skip_tokenizer_init=True),
                      drafter)
    return out


def budget_depth(speculative_config: Any) -> tuple[int, int]:
    params = ddtree_params(speculative_config)
    return params.budget, params.depth


def spec(pair: tuple[Any, str], **kwargs: Any) -> Any:
    from vllm.config import ParallelConfig
    from vllm.config.speculative import SpeculativeConfig

    vllm_ddtree.register()
    return SpeculativeConfig(method="ddtree", model=pair[1], target_model_config=pair[0],
                             target_parallel_config=ParallelConfig(), **kwargs)


# ------------------------------------------------------------------ budget


def test_largest_budget_accepted_and_one_more_refused(pairs) -> None:
    assert budget_depth(spec(pairs[4096], num_speculative_tokens=MAX_BUDGET)) == \
        (MAX_BUDGET, 15)
    for budget in (MAX_BUDGET + 1, 100000):
        with pytest.raises(DDTreeConfigError,
                           match=rf"num_speculative_tokens={budget} exceeds the largest "
                                 rf"tree budget method='ddtree' supports, {MAX_BUDGET}"):
            spec(pairs[4096], num_speculative_tokens=budget)


def test_budget_refused_above_the_vocabulary(pairs) -> None:
    assert budget_depth(spec(pairs[512], num_speculative_tokens=512)) == (512, 15)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=513 exceeds the target "
                                         r"Qwen3ForCausalLM vocab_size=512"):
        spec(pairs[512], num_speculative_tokens=513)


def test_budget_bound_through_engine_args(pairs) -> None:
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = pairs[4096]
    args = EngineArgs(model=target.model, skip_tokenizer_init=True, max_model_len=256,
                      speculative_config={"method": "ddtree", "model": drafter,
                                          "num_speculative_tokens": 100000})
    with pytest.raises(ValueError, match=f"supports, {MAX_BUDGET}"):
        args.create_engine_config()


# ------------------------------------------------------------------- depth


def test_depth_up_to_block_size_minus_one(pairs) -> None:
    assert budget_depth(spec(pairs[512], num_speculative_tokens=32,
                             ddtree_max_depth=15)) == (32, 15)
    for depth in (16, 100):
        with pytest.raises(ValueError, match=rf"ddtree_max_depth={depth} exceeds what the "
                                             r"drafter can draft: block_size - 1 = 15"):
            spec(pairs[512], num_speculative_tokens=4, ddtree_max_depth=depth)


def test_depth_bound_for_a_drafter_vllm_fetched(pairs, monkeypatch) -> None:
    """Hub ids: block_size comes from the config vLLM loaded, still before weights."""
    from vllm_ddtree import drafter

    monkeypatch.setattr(drafter, "load_drafter_config", lambda model: None)
    with pytest.raises(ValueError, match="ddtree_max_depth=100 exceeds"):
        spec(pairs[512], num_speculative_tokens=4, ddtree_max_depth=100)


def test_resolve_depth() -> None:
    dflash16, dflash8 = DrafterInfo("dflash", 16, 15), DrafterInfo("dflash", 8, 7)
    assert resolve_depth(32, dflash16, None) == 15
    assert resolve_depth(4, dflash16, 9) == 4  # a cap above B does not bind
    assert resolve_depth(32, dflash8, 7) == 7
    with pytest.raises(DDTreeConfigError, match="ddtree_max_depth <= 7"):
        resolve_depth(32, dflash8, 8)
    # DSpark: the anchor slot predicts too, and its block must be drafted whole
    dspark = DrafterInfo("dspark", 8, 8, min_depth=8)
    assert resolve_depth(32, dspark, None) == 8
    with pytest.raises(DDTreeConfigError, match="below the DSpark drafter's "
                                                "dspark_block_size=8"):
        resolve_depth(6, dspark, None)
    with pytest.raises(DDTreeConfigError, match="dspark_block_size=8"):
        resolve_depth(32, dspark, 7)


# ---------------------------------------------- verify width vs. the scheduler


def test_check_verify_fits() -> None:
    check_verify_fits(63, 15, 79, None)  # 64 verify rows + 15 drafter slots
    check_verify_fits(63, 0, 64, 64)
    with pytest.raises(DDTreeConfigError,
                       match=r"num_speculative_tokens=63 needs 64 verify tokens per request "
                             r"and step, but the scheduler fits 63 \(max_num_batched_tokens"
                             r"=78, 15 reserved for the drafter\)\. Set "
                             r"num_speculative_tokens <= 62"):
        check_verify_fits(63, 15, 78, None)
    with pytest.raises(DDTreeConfigError, match="max_num_scheduled_tokens=32"):
        check_verify_fits(63, 0, 4096, 32)


def test_scheduler_check_reads_vllms_budgets() -> None:
    from vllm_ddtree._patch.online_budget import check_verify_fits as scheduler_check

    def scheduler(budget: int, batched: int, scheduled: int | None) -> SimpleNamespace:
        spec = SimpleNamespace(method="dflash", num_speculative_tokens=budget,
                               max_num_new_slots_for_drafting=15)
        attach_params(spec, DDTreeParams(budget, 15))
        config = SimpleNamespace(speculative_config=spec,
                                 scheduler_config=SimpleNamespace(
                                     max_num_batched_tokens=batched,
                                     max_num_scheduled_tokens=None))
        return SimpleNamespace(vllm_config=config, max_num_scheduled_tokens=scheduled)

    scheduler_check(scheduler(63, 2048, 2048))
    with pytest.raises(DDTreeConfigError, match="fits 64"):
        scheduler_check(scheduler(100, 2048, 64))
    with pytest.raises(DDTreeConfigError, match="fits 49"):
        scheduler_check(scheduler(100, 64, None))
    other = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=None))
    scheduler_check(other)  # not DDTree: inert


@pytest.mark.slow
def test_engine_refuses_a_tree_wider_than_its_token_budget(monkeypatch, root) -> None:
    """max_num_batched_tokens=64 with B = 100 and D = 15: one request's 101 verify rows
    never fit the 49 tokens left per step."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the error raises here
    from vllm import LLM

    from vllm_ddtree.testing.fixtures import make_tiny_pair

    target, drafter = make_tiny_pair(root, "random", "float32")
    with pytest.raises(DDTreeConfigError, match=r"num_speculative_tokens=100 needs 101 "
                                                r"verify tokens .* fits 49"):
        LLM(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True,
            max_num_seqs=4, max_num_batched_tokens=64, gpu_memory_utilization=0.2,
            speculative_config={"method": "ddtree", "model": str(drafter),
                                "num_speculative_tokens": 100})
