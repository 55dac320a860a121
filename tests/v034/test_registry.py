"""DDTree as a method of vLLM 0.34's speculator registry: registration, the
``SpeculatorConfig`` vLLM gets for ``method="ddtree"``, and how the DDTree options reach
it.  Fails when vLLM's registry or the config classes DDTree builds on change."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import vllm_ddtree
from vllm_ddtree import config as ddcfg

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def registered():
    vllm_ddtree.register()


def test_ddtree_is_a_registered_method_built_on_dflash():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.gpu.spec_decode.dflash.config import DFlashSpeculatorConfig
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
    from vllm.v1.worker.gpu.spec_decode.speculator_config import (
        get_custom_speculator_config_class,
        registered_speculative_methods,
    )

    from vllm_ddtree.gpu.speculator_config import DDTreeSpeculatorConfig

    assert "ddtree" in registered_speculative_methods()
    cls = get_custom_speculator_config_class("ddtree")  # vLLM resolves and checks it
    assert cls is DDTreeSpeculatorConfig and issubclass(cls, DFlashSpeculatorConfig)
    assert cls.base_method == "dflash"
    assert cls.supported_options == frozenset({"speculator_options"})
    # vLLM itself refuses its method-specific options that DDTree does not list, e.g.
    # dspark_draft_topk (the chain's Markov bias on the top-k base candidates only: a
    # tree node ranks its children over the whole draft vocabulary)
    from vllm.config.speculative import _METHOD_SPECIFIC_OPTIONS

    assert "dspark_draft_topk" in _METHOD_SPECIFIC_OPTIONS
    assert issubclass(resolve_obj_by_qualname(cls.speculator_class), DFlashSpeculator)
    dspark = cls(_spec("dspark", budget=15, depth=16))
    assert issubclass(resolve_obj_by_qualname(dspark.speculator_class), DSparkSpeculator)


def test_register_again_is_a_no_op_and_the_name_stays_ours():
    from vllm.v1.worker.gpu.spec_decode.speculator_config import (
        SpeculatorConfig,
        register_speculative_method,
    )

    vllm_ddtree.register()
    register_speculative_method("ddtree", vllm_ddtree.SPECULATOR_CONFIG)  # same: allowed
    with pytest.raises(ValueError, match="already registered"):
        register_speculative_method("ddtree", SpeculatorConfig)


def _spec(method: str, budget: int, depth: int) -> SimpleNamespace:
    """A set-up DDTree speculative config, the fields the config class reads."""
    spec = SimpleNamespace(method=method, num_speculative_tokens=budget)
    ddcfg.attach_params(spec, ddcfg.DDTreeParams(budget, depth, dspark=method == "dspark"))
    return spec


@pytest.mark.parametrize(("method", "lookahead", "queries", "lane"), [
    ("dflash", 64, 1 + 15, False),  # bonus + D mask rows; DFlash's reservation B + 1
    ("dspark", 63, 16, True),  # D slots (the anchor drafts); DSpark's reservation B
])
def test_traits_follow_the_drafter_family(method, lookahead, queries, lane):
    """vLLM reads the speculator's traits from the registered class: the drafter
    family's own (DSpark drafts in its own workspace lane), DDTree's drafter pass of one
    block per request whatever the budget, and no watermarking (the tree verifier
    replaces the sampler that applies it)."""
    from vllm_ddtree.gpu.speculator_config import DDTreeSpeculatorConfig

    config = DDTreeSpeculatorConfig(_spec(method, budget=63, depth=queries - (method != "dspark")))
    assert config.num_lookahead_tokens == lookahead
    assert config.max_num_draft_seqs(8192) == 8192 // queries
    assert config.uses_separate_workspace_lane is lane
    assert config.uses_aux_hidden_states and config.parallel_drafting
    assert config.supports_watermarking is False
    assert config.max_num_new_slots_for_drafting == 0  # a separate query pass, as DFlash


def _construct(**kwargs):
    from vllm.config.speculative import SpeculativeConfig

    return SpeculativeConfig(**kwargs)


@pytest.mark.parametrize("options", [
    {},
    {"ddtree_max_depth": 4, "ddtree_adaptive_budget": True},
    {"speculator_options": {"max_depth": 4, "adaptive_budget": "online"}},
])
def test_options_reach_ddtree_in_either_spelling(options):
    """The documented ``ddtree_*`` keys and vLLM's ``speculator_options`` both pass
    vLLM's schema and reach DDTree's checks (here the first one fails: no drafter)."""
    with pytest.raises(ValueError, match="speculative_config.model is missing"):
        _construct(method="ddtree", num_speculative_tokens=15, **options)


@pytest.mark.parametrize(("options", "message"), [
    ({"ddtree_max_depth": True}, "ddtree_max_depth=True"),
    ({"ddtree_max_depth": "4"}, "ddtree_max_depth='4'"),
    ({"ddtree_adaptive_budget": 1}, "ddtree_adaptive_budget=1"),
    ({"num_speculative_tokens": "15"}, "num_speculative_tokens='15'"),
    ({"ddtree_max_depth": 4, "speculator_options": {"max_depth": 3}}, "both"),
    ({"speculator_options": {"depth": 3}}, "speculator_options"),
    ({"speculator_options": {"max_depth": 4.0}}, "max_depth=4.0"),
    ({"speculator_options": ["max_depth"]}, "speculator_options"),
    ({"ddtree_depth": 3}, "ddtree_depth"),
])
def test_bad_options_are_refused_by_name(options, message):
    kwargs = {"method": "ddtree", "model": "no-such/drafter", "num_speculative_tokens": 15,
              **options}
    with pytest.raises(ValueError) as info:
        _construct(**kwargs)
    assert message in str(info.value)


def test_ddtree_options_with_another_method_are_refused():
    with pytest.raises(ValueError, match="only applies to method='ddtree'"):
        _construct(method="ngram", num_speculative_tokens=3, ddtree_max_depth=4)


def test_configure_sets_vllm_up_for_the_drafter_family(tmp_path, monkeypatch):
    """``configure`` validates before vLLM builds the drafter config, runs vLLM's DFlash
    set-up, or for a DSpark checkpoint ``method="dspark"`` and vLLM's DSpark set-up, and
    attaches the resolved DDTreeParams."""
    from vllm.v1.worker.gpu.spec_decode.dflash.config import DFlashSpeculatorConfig
    from vllm.v1.worker.gpu.spec_decode.dspark.config import DSparkSpeculatorConfig

    from vllm_ddtree.gpu.speculator_config import DDTreeSpeculatorConfig
    from vllm_ddtree.testing import dspark_fixture
    from vllm_ddtree.testing.fixtures import make_tiny_pair

    calls = []
    for cls in (DFlashSpeculatorConfig, DSparkSpeculatorConfig):
        monkeypatch.setattr(cls, "configure", classmethod(
            lambda c, spec: calls.append((c.__name__, spec.method))))
    target, drafter = make_tiny_pair(tmp_path, "accept_all", "float32")
    dspark = dspark_fixture.write_dspark_drafter(tmp_path, "markov_steers", "float32")
    target_config = SimpleNamespace(architectures=["Qwen3ForCausalLM"],
                                    get_vocab_size=lambda: None, get_hidden_size=lambda: None)
    for model, method, depth in ((drafter, "dflash", 4), (dspark, "dspark", 16)):
        spec = SimpleNamespace(
            method="dflash", model=str(model), num_speculative_tokens=31,
            speculator_options={"max_depth": depth} if method == "dflash" else None,
            target_model_config=target_config, target_parallel_config=None,
            num_speculative_tokens_per_batch_size=None)
        DDTreeSpeculatorConfig.configure(spec)
        assert spec.method == method
        params = ddcfg.ddtree_params(spec)
        assert (params.budget, params.depth, params.dspark) == (31, depth, method == "dspark")
    assert calls == [("DDTreeSpeculatorConfig", "dflash"),
                     ("DSparkSpeculatorConfig", "dspark")]
