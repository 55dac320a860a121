"""Broken drafter checkpoints fail when the speculative config is built (before vLLM loads
any weights), each with one message naming the file and the field or tensor: NaN/inf
weights, a truncated safetensors file, a ``config.json`` with fields of the wrong type,
and a drafter whose vocabulary differs from the target's.  The broken checkpoints are
copies of :func:`vllm_ddtree.testing.fixtures.make_tiny_pair`'s drafter."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vllm_ddtree
from vllm_ddtree.config import DDTreeConfigError, ddtree_params
from vllm_ddtree.drafter import check_finite, load_drafter_config
from vllm_ddtree.testing.fixtures import make_tiny_pair

pytestmark = pytest.mark.vllm

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def tiny(root: Path) -> dict[str, Any]:
    """The target's ModelConfig and the untouched drafter folder, per dtype."""
    from vllm.config import ModelConfig

    vllm_ddtree.register()
    out = {}
    for dtype in ("float32", "bfloat16"):
        target, drafter = make_tiny_pair(root, "random", dtype)
        out[dtype] = (ModelConfig(model=str(target), dtype=dtype), drafter)
    return out


def spec(target_config: Any, drafter: Path | str) -> Any:
    from vllm.config import ParallelConfig
    from vllm.config.speculative import SpeculativeConfig

    vllm_ddtree.register()
    return SpeculativeConfig(method="ddtree", model=str(drafter), num_speculative_tokens=8,
                             target_model_config=target_config,
                             target_parallel_config=ParallelConfig())


def broken_copy(drafter: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "drafter"
    shutil.copytree(drafter, copy)
    return copy


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        section, _, field = key.rpartition("__")
        (config[section] if section else config)[field] = value
    path.write_text(json.dumps(config))


def test_the_untouched_pair_is_accepted(tiny) -> None:
    for target_config, drafter in tiny.values():
        params = ddtree_params(spec(target_config, drafter))
        assert (params.budget, params.depth) == (8, 8)


# ------------------------------------------------------------- NaN/inf weights


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_weights(tiny, tmp_path: Path, dtype: str, value: float) -> None:
    from safetensors.torch import load_file, save_file

    target_config, drafter = tiny[dtype]
    folder = broken_copy(drafter, tmp_path)
    weights = load_file(str(folder / WEIGHTS))
    name = "layers.1.mlp.up_proj.weight"
    weights[name][7, 3] = value
    save_file(weights, str(folder / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{WEIGHTS} holds NaN/inf values in tensor "
                                         rf"'{name}': the drafter checkpoint is corrupt"):
        spec(target_config, folder)


def test_finite_scan_each_dtype_and_once_per_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    check_finite.cache_clear()
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16,
              torch.float8_e5m2, torch.float8_e4m3fn]
    for dtype in dtypes:
        for bad in (None, float("nan"), float("inf")):
            if bad == float("inf") and dtype == torch.float8_e4m3fn:
                continue  # no inf in e4m3fn (it saturates)
            tensors = {"a": torch.ones(5, 7).to(dtype), "ids": torch.arange(9),
                       "b": torch.zeros(300).to(dtype)}
            if bad is not None:
                tensors["b"][299] = bad
            file = tmp_path / f"{dtype}-{bad}.safetensors"
            save_file(tensors, str(file))
            header_len = struct.unpack("<Q", file.read_bytes()[:8])[0]
            header = json.loads(file.read_bytes()[8:8 + header_len])
            entries = tuple(sorted((k, (v["dtype"], *v["data_offsets"]))
                                   for k, v in header.items() if k != "__metadata__"))
            info = file.stat()
            found = check_finite(str(file), info.st_size, info.st_mtime_ns, 8 + header_len,
                                 entries)
            assert found == (None if bad is None else "b"), (dtype, bad)
    hits = check_finite.cache_info().hits
    check_finite(str(file), info.st_size, info.st_mtime_ns, 8 + header_len, entries)
    assert check_finite.cache_info().hits == hits + 1  # scanned once per file


# --------------------------------------------------------- truncated weights


def test_truncated_safetensors(tiny, tmp_path: Path) -> None:
    target_config, drafter = tiny["float32"]
    folder = broken_copy(drafter, tmp_path)
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"drafter weights .*{WEIGHTS} is truncated: "
                                         rf"{len(data) // 2} bytes, its header describes "
                                         rf"{len(data)}"):
        spec(target_config, folder)
    (folder / WEIGHTS).write_bytes(data[:100])  # the header itself cut
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        spec(target_config, folder)


# ------------------------------------------------------ config.json field types


@pytest.mark.parametrize(("changes", "match"), [
    ({"num_hidden_layers": "five"},
     r"has num_hidden_layers='five': it must be an integer >= 1"),
    ({"block_size": None},
     r"config.json has block_size=None; a block drafter needs an integer block_size >= 2"),
    ({"hidden_size": "128"}, r"has hidden_size='128': it must be an integer >= 1"),
    ({"num_attention_heads": 4.5}, r"has num_attention_heads=4.5"),
    ({"vocab_size": True}, r"has vocab_size=True"),
    ({"rms_norm_eps": "small"}, r"has rms_norm_eps='small': it must be a number"),
    ({"dflash_config__mask_token_id": "mask"}, r"has dflash_config.mask_token_id='mask'"),
    ({"dflash_config__target_layer_ids": [1, "2"]},
     r"has dflash_config.target_layer_ids=\[1, '2'\]"),
    ({"dflash_config__num_hidden_layers": 0}, r"has dflash_config.num_hidden_layers=0"),
])
def test_config_json_with_wrong_types(tiny, tmp_path: Path, changes: dict[str, Any],
                                      match: str) -> None:
    target_config, drafter = tiny["float32"]
    folder = broken_copy(drafter, tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(ValueError, match=match) as info:
        spec(target_config, folder)
    assert str(folder) in str(info.value)


def test_config_json_not_an_object(tiny, tmp_path: Path) -> None:
    target_config, drafter = tiny["float32"]
    folder = broken_copy(drafter, tmp_path)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json is not a JSON object"):
        spec(target_config, folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read .*config.json"):
        spec(target_config, folder)


# --------------------------------------------------------- vocabulary mismatch


def test_drafter_vocabulary_differs(tiny, tmp_path: Path) -> None:
    target_config, drafter = tiny["float32"]
    folder = broken_copy(drafter, tmp_path)
    edit_config(folder, vocab_size=1024)
    with pytest.raises(ValueError, match=r"drafter vocab_size=1024 differs from the target "
                                         r"Qwen3ForCausalLM vocab_size=512"):
        spec(target_config, folder)


def test_errors_are_ddtree_config_errors(tiny, tmp_path: Path) -> None:
    """pydantic wraps what __post_init__ raises; the cause is the DDTreeConfigError."""
    target_config, drafter = tiny["float32"]
    folder = broken_copy(drafter, tmp_path)
    edit_config(folder, num_hidden_layers="five")
    with pytest.raises(ValueError) as info:
        spec(target_config, folder)
    message = str(info.value)
    assert "Traceback" not in message and message.count("num_hidden_layers") == 1
    with pytest.raises(DDTreeConfigError):
        load_drafter_config(str(folder))
