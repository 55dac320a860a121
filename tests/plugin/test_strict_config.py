"""Strict ``--speculative-config``, tried as a careless user would: ``ddtree*`` keys that
are no option (the settings vllm-ddtree derives itself among them) refused for every
method, and option values refused as written, before pydantic's lax coercion turns
``"4"`` into a depth or ``1`` into ``true``."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vllm_ddtree
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
