"""Strict ``--speculative-config``, tried as a careless user would: ``ddtree*`` keys that
are no option (the settings vllm-ddtree derives itself among them) refused for every
method, option values refused as written, before pydantic's lax coercion turns
``"4"`` into a depth or ``1`` into ``true``, and drafter files that are no regular file,
too big or nested too deeply refused by name, at once."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vllm_ddtree
from vllm_ddtree import drafter
from vllm_ddtree.config import (
    PARAMS_ATTR,
    DDTreeConfigError,
    check_raw_options,
    ddtree_params,
    is_ddtree,
)

DERIVED = {"ddtree_enabled": True, "ddtree_depth": 4, "ddtree_online_channel": "abc123"}
OPTIONS_NAMED = r"the options are ddtree_max_depth, ddtree_adaptive_budget\.$"


# ------------------------------------------------- the raw options (no vLLM)


@pytest.mark.parametrize("kwargs", [
    {"method": "ddtree", "num_speculative_tokens": 15},
    {"method": "ddtree", "num_speculative_tokens": 15, "ddtree_max_depth": 4},
    {"method": "ddtree", "num_speculative_tokens": 15, "ddtree_max_depth": None},
    {"method": "ddtree", "num_speculative_tokens": 15, "ddtree_adaptive_budget": True},
    {"method": "ddtree", "num_speculative_tokens": 15, "ddtree_adaptive_budget": False},
    {"method": "ddtree", "num_speculative_tokens": 15, "ddtree_adaptive_budget": "online"},
    {"method": "dflash", "num_speculative_tokens": 15},
    {"method": "ngram", "num_speculative_tokens": 3, "ddtree_max_depth": None,
     "ddtree_adaptive_budget": False},  # the defaults, spelled out
    {"num_speculative_tokens": 3},  # no method: vLLM infers one, not DDTree
])
def test_raw_options_accepted(kwargs: dict[str, Any]) -> None:
    check_raw_options(kwargs)


@pytest.mark.parametrize("method", ["ddtree", "dflash", "ngram", "eagle3", None])
@pytest.mark.parametrize("key", sorted(DERIVED))
def test_derived_settings_are_no_options(method: str | None, key: str) -> None:
    """What vllm-ddtree derives (the marker, the depth, the online channel's name) is
    refused as a key for every method, with what sets it and the real options."""
    with pytest.raises(DDTreeConfigError,
                       match=rf"^speculative_config\.{key} is not a DDTree option: .*"
                             rf"{OPTIONS_NAMED}"):
        check_raw_options({"method": method, "num_speculative_tokens": 4, key: DERIVED[key]})


@pytest.mark.parametrize(("key", "match"), [
    ("ddtree_enabled", "method='ddtree' selects DDTree"),
    ("ddtree_depth", "the depth follows from the drafter and the budget, ddtree_max_depth "
                     "caps it"),
    ("ddtree_online_channel", "vllm-ddtree names the online budget's statistics channel"),
    ("DDTree_Max_Depth", "did you mean 'ddtree_max_depth'"),
    ("ddtree_adaptive", "did you mean 'ddtree_adaptive_budget'"),
])
def test_unknown_ddtree_keys_say_what_to_set(key: str, match: str) -> None:
    with pytest.raises(DDTreeConfigError, match=match):
        check_raw_options({"method": "ddtree", "num_speculative_tokens": 4, key: 1})


@pytest.mark.parametrize(("key", "value"), [
    ("ddtree_max_depth", True),
    ("ddtree_max_depth", False),
    ("ddtree_max_depth", "4"),
    ("ddtree_max_depth", 4.0),
    ("ddtree_max_depth", 0),
    ("ddtree_max_depth", [4]),
    ("ddtree_adaptive_budget", 1),
    ("ddtree_adaptive_budget", 0),
    ("ddtree_adaptive_budget", "true"),
    ("ddtree_adaptive_budget", "Online"),
    ("ddtree_adaptive_budget", None),
    ("num_speculative_tokens", True),
    ("num_speculative_tokens", "15"),
    ("num_speculative_tokens", 15.0),
    ("num_speculative_tokens", 0),
])
def test_option_values_checked_as_written(key: str, value: Any) -> None:
    kwargs = {"method": "ddtree", "num_speculative_tokens": 15, key: value}
    with pytest.raises(DDTreeConfigError, match=rf"speculative_config\.{key}="
                                                rf"{re.escape(repr(value))} is invalid"):
        check_raw_options(kwargs)


@pytest.mark.parametrize("method", ["dflash", "ngram", None])
@pytest.mark.parametrize(("key", "value"), [
    ("ddtree_max_depth", 4), ("ddtree_max_depth", "4"),
    ("ddtree_adaptive_budget", True), ("ddtree_adaptive_budget", 0),
])
def test_options_refused_with_another_method(method: str | None, key: str,
                                             value: Any) -> None:
    """An option with another method is refused (it would be ignored), whatever its
    value: ``0`` is not the default ``false``, only what pydantic would make of it."""
    with pytest.raises(DDTreeConfigError, match=rf"{key} is set but method={method!r}: it "
                                                "only applies to method='ddtree'"):
        check_raw_options({"method": method, "num_speculative_tokens": 4, key: value})


# ------------------------------------------- the same through vLLM's config layer


@pytest.fixture(scope="module")
def tiny(root: Path) -> tuple[Any, str]:
    """The target's ModelConfig and a drafter folder (tiny random weights)."""
    from vllm.config import ModelConfig

    from vllm_ddtree.testing.fixtures import make_tiny_pair

    vllm_ddtree.register()
    target, folder = make_tiny_pair(root, "random", "float32")
    return ModelConfig(model=str(target), dtype="float32"), str(folder)


def spec(tiny: tuple[Any, str], **kwargs: Any) -> Any:
    from vllm.config import ParallelConfig
    from vllm.config.speculative import SpeculativeConfig

    vllm_ddtree.register()
    kwargs.setdefault("model", tiny[1])
    kwargs.setdefault("num_speculative_tokens", 8)
    return SpeculativeConfig(target_model_config=tiny[0],
                             target_parallel_config=ParallelConfig(), **kwargs)


@pytest.mark.vllm
@pytest.mark.parametrize("method", ["ddtree", "dflash", "ngram"])
def test_vllm_refuses_the_derived_settings(tiny, method: str) -> None:
    for key, value in DERIVED.items():
        with pytest.raises(DDTreeConfigError, match=rf"{key} is not a DDTree option: .*"
                                                    rf"{OPTIONS_NAMED}"):
            spec(tiny, method=method, **{key: value})


@pytest.mark.vllm
def test_dflash_never_turns_into_ddtree(tiny) -> None:
    plain = spec(tiny, method="dflash")
    assert plain.method == "dflash" and not is_ddtree(plain)
    with pytest.raises(ValueError, match="ddtree_enabled is not a DDTree option"):
        spec(tiny, method="dflash", ddtree_enabled=True)
    with pytest.raises(ValueError, match="Unexpected keyword argument"):  # pydantic's
        spec(tiny, method="dflash", **{PARAMS_ATTR: "anything"})
    for key, value in (("ddtree_max_depth", 4), ("ddtree_adaptive_budget", "online")):
        with pytest.raises(ValueError, match=f"{key} is set but method='dflash'"):
            spec(tiny, method="dflash", **{key: value})
    # the DDTree config of the same drafter: mapped onto DFlash, and only it is DDTree
    tree = spec(tiny, method="ddtree")
    assert tree.method == "dflash" and is_ddtree(tree)


@pytest.mark.vllm
@pytest.mark.parametrize(("key", "value"), [
    ("ddtree_max_depth", True), ("ddtree_max_depth", "4"), ("ddtree_max_depth", 4.0),
    ("ddtree_adaptive_budget", 1), ("ddtree_adaptive_budget", 0),
    ("ddtree_adaptive_budget", "true"),
    ("num_speculative_tokens", True), ("num_speculative_tokens", "8"),
    ("num_speculative_tokens", 8.0),
])
def test_vllm_takes_the_options_as_written(tiny, key: str, value: Any) -> None:
    """Without the raw check pydantic would run depth 4, an adaptive or a fixed budget
    and B = 8 for these."""
    with pytest.raises(DDTreeConfigError, match=rf"{key}={re.escape(repr(value))} is "
                                                "invalid"):
        spec(tiny, method="ddtree", **{key: value})
    assert ddtree_params(spec(tiny, method="ddtree", ddtree_max_depth=4)).depth == 4


@pytest.mark.vllm
def test_cli_json_options_as_written(tiny, root: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    for extra, match in (({"ddtree_max_depth": "4"}, "ddtree_max_depth='4' is invalid"),
                         ({"ddtree_adaptive_budget": 1}, "ddtree_adaptive_budget=1 is"),
                         ({"ddtree_depth": 4}, "ddtree_depth is not a DDTree option")):
        cli = parser.parse_args([
            "--model", tiny[0].model, "--skip-tokenizer-init", "--max-model-len", "256",
            "--speculative-config", json.dumps({"method": "ddtree", "model": tiny[1],
                                                "num_speculative_tokens": 8, **extra})])
        with pytest.raises(ValueError, match=match):
            EngineArgs.from_cli_args(cli).create_engine_config()


# --------------------------------------------------------------- drafter files


@pytest.fixture
def no_hang() -> Iterator[None]:
    """Fail, rather than block the run, if a read blocks (a FIFO without a writer)."""

    def blocked(signum: int, frame: Any) -> None:
        raise TimeoutError("blocked reading a drafter file")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(30)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def folder_with(tmp_path: Path, config: bytes | None = b'{"block_size": 16}') -> Path:
    folder = tmp_path / "drafter"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_bytes(config)
    return folder


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a": ' * 100_000, "[" * 100_000 + "]"])
def test_deeply_nested_config_json(tmp_path: Path, text: str) -> None:
    folder = folder_with(tmp_path, text.encode())
    with pytest.raises(DDTreeConfigError, match=r"config.json nests JSON arrays or objects "
                                                r"deeper than the parser allows") as info:
        drafter.load_drafter_config(str(folder))
    assert str(folder / "config.json") in str(info.value)


def test_config_json_fifo(tmp_path: Path, no_hang: None) -> None:
    folder = folder_with(tmp_path, None)
    os.mkfifo(folder / "config.json")
    with pytest.raises(DDTreeConfigError, match=re.escape(f"{folder / 'config.json'} is a "
                                                          "FIFO, not a regular file")):
        drafter.load_drafter_config(str(folder))


def test_config_json_directory(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, None)
    (folder / "config.json").mkdir()
    with pytest.raises(DDTreeConfigError, match=re.escape(f"{folder / 'config.json'} is a "
                                                          "directory, not a regular file")):
        drafter.load_drafter_config(str(folder))


def test_config_json_too_big_is_not_read(tmp_path: Path, no_hang: None) -> None:
    folder = folder_with(tmp_path, None)
    with open(folder / "config.json", "wb") as f:
        f.truncate(1 << 36)  # sparse: 64 GiB that a read would try to hold in memory
    with pytest.raises(DDTreeConfigError, match=rf"config.json is {1 << 36} bytes, more than "
                                                rf"a drafter config.json can be "
                                                rf"\({drafter.MAX_CONFIG_BYTES} bytes\); "
                                                "it was not read"):
        drafter.load_drafter_config(str(folder))


def test_config_json_growing_past_the_bound(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose size says nothing (``st_size`` 0, as in /proc) is read up to the
    bound only."""
    folder = folder_with(tmp_path, b"{" + b" " * 64 + b"}")
    monkeypatch.setattr(drafter, "MAX_CONFIG_BYTES", 16)
    real_fstat = os.fstat
    monkeypatch.setattr(drafter.os, "fstat",
                        lambda fd: os.stat_result((*real_fstat(fd)[:6], 0, *real_fstat(fd)[7:])))
    with pytest.raises(DDTreeConfigError, match="holds more than 16 bytes"):
        drafter.load_drafter_config(str(folder))


def test_config_json_symlink_to_a_file_is_read(tmp_path: Path) -> None:
    """The Hub cache's layout: config.json links to a blob."""
    blob = tmp_path / "blob"
    blob.write_text('{"block_size": 16}')
    folder = folder_with(tmp_path, None)
    (folder / "config.json").symlink_to(blob)
    assert drafter.load_drafter_config(str(folder)) == {"block_size": 16}


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_safetensors_entry_not_a_file(tmp_path: Path, no_hang: None, kind: str) -> None:
    folder = folder_with(tmp_path)
    entry = folder / "model.safetensors"
    os.mkfifo(entry) if kind == "fifo" else entry.mkdir()
    what = "a FIFO" if kind == "fifo" else "a directory"
    with pytest.raises(DDTreeConfigError, match=re.escape(f"drafter weights {entry} is "
                                                          f"{what}, not a regular file")):
        drafter.load_drafter_config(str(folder))


@pytest.mark.parametrize(("header", "match"), [
    (b"[" * 100_000, "its header nests JSON deeper than the parser allows"),
    (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}',
     r"tensor 'w' has data_offsets \[-4, 0\]"),
])
def test_safetensors_header_refused(tmp_path: Path, header: bytes, match: str) -> None:
    folder = folder_with(tmp_path)
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(DDTreeConfigError, match=rf"model.safetensors is not a readable "
                                                rf"safetensors file \(.*{match}"):
        drafter.load_drafter_config(str(folder))


@pytest.mark.vllm
def test_vllm_names_the_fifo(tiny, tmp_path: Path, no_hang: None) -> None:
    """Through vLLM's config layer: refused at once, the file named."""
    folder = folder_with(tmp_path, None)
    os.mkfifo(folder / "config.json")
    with pytest.raises(ValueError, match=re.escape(f"{folder / 'config.json'} is a FIFO")):
        spec(tiny, method="ddtree", model=str(folder))
