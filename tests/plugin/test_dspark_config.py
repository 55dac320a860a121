"""``method: "ddtree"`` with a DSpark drafter: detected from the checkpoint, mapped onto
vLLM's DSpark plumbing (``method="dspark"``), depth bounded by the DSpark block, and the
DSpark tree speculator selected in the GPU runner.  DSpark drafting is GPU-only in vLLM,
so on this CPU build the platform check is replaced where a test needs the GPU answer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vllm_ddtree
from vllm_ddtree.config import ddtree_params, is_ddtree
from vllm_ddtree.testing import dspark_fixture as dx
from vllm_ddtree.testing import fixtures as fx

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dspark-config")


@pytest.fixture(autouse=True)
def registered() -> None:
    vllm_ddtree.register()


@pytest.fixture
def on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer a GPU platform gives to the DSpark platform check."""
    from vllm_ddtree._patch import speculative_config as patch

    monkeypatch.setattr(patch, "_check_dspark_platform", lambda: None)


def budget_depth(speculative_config: Any) -> tuple[int, int]:
    params = ddtree_params(speculative_config)
    return params.budget, params.depth


def spec(root: Path, vd: int | None = None, **kwargs: Any) -> Any:
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.config.speculative import SpeculativeConfig

    target, _ = fx.make_tiny_pair(root, dx.PAIRED_TARGET["random"])
    drafter = dx.write_dspark_drafter(root, "random", draft_vocab_size=vd)
    mc = ModelConfig(model=str(target), dtype="float32", max_model_len=256,
                     enforce_eager=True)
    kwargs.setdefault("num_speculative_tokens", 20)
    return SpeculativeConfig(method="ddtree", model=str(drafter), target_model_config=mc,
                             target_parallel_config=ParallelConfig(), **kwargs)


@pytest.mark.parametrize("vd", [None, 100])
def test_dspark_drafter_runs_on_vllm_dspark_plumbing(root, on_gpu, vd) -> None:
    """Full and reduced draft vocabularies; depth = block_size (16): the anchor's slot
    predicts depth 1, so a DSpark pass drafts one position more than a DFlash one."""
    s = spec(root, vd)
    assert s.method == "dspark" and s.use_dspark() and s.parallel_drafting
    assert is_ddtree(s) and budget_depth(s) == (20, 16) and ddtree_params(s).dspark
    assert s.draft_model_config.architectures == ["Qwen3DSparkModel"]
    assert budget_depth(spec(root, vd, num_speculative_tokens=8)) == (8, 8)
    assert budget_depth(spec(root, vd, ddtree_max_depth=16)) == (20, 16)


def test_dspark_depth_bound(root, on_gpu) -> None:
    with pytest.raises(ValueError, match=r"ddtree_max_depth=17 exceeds what the drafter "
                                         r"can draft: block_size = 16"):
        spec(root, ddtree_max_depth=17)


def test_dspark_is_refused_on_cpu(root) -> None:
    with pytest.raises(ValueError, match="with a DSpark drafter runs on GPUs only"):
        spec(root)
