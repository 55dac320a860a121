"""How vLLM 0.34's Model Runner V2 calls the plugin's GPU pieces, checked on CPU against
vLLM 0.34's own classes (its V2 modules import here; they cannot run): the speculator's
propose, the model state's hooks, the verifier's pipeline and the tree attention's
metadata builder, with vLLM's engine-bound constructors replaced by what the pieces
read from them."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm


def test_the_runner_calls_fit_the_signatures():
    """vLLM 0.34 calls ``rejection_sampler(logits, input_batch, draft_logits)`` and the
    speculator's ``propose`` with its base class's parameters, by the same names."""
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

    from vllm_ddtree.gpu.speculator import DDTreeSpeculator
    from vllm_ddtree.gpu.verifier import DDTreeVerifier

    inspect.signature(DDTreeVerifier.__call__).bind(object(), "logits", "batch", None)
    assert DDTreeVerifier.enable_adaptive_verification is False  # read by vLLM's warm-up
    ours = inspect.signature(DDTreeSpeculator.propose).parameters
    base = inspect.signature(BaseSpeculator.propose).parameters
    assert list(ours) == list(base)
    assert [p.default for p in ours.values()] == [p.default for p in base.values()]


class _Sampler:
    """vLLM 0.34's sampler as the verifier reads it; records which method drew."""

    logprobs_mode, compute_nans, use_fp64_gumbel = "raw_logprobs", False, False

    def __init__(self, temperature, seeded, top_k=None, top_p=None, vocab=8):
        self.calls = []
        temp = np.array(temperature, dtype=np.float32)
        n = len(temp)
        self.sampling_states = SimpleNamespace(
            vocab_size=vocab,
            top_k=SimpleNamespace(np=np.array(top_k or [vocab] * n, dtype=np.int32)),
            top_p=SimpleNamespace(np=np.array(top_p or [1.0] * n, dtype=np.float32)),
            temperature=SimpleNamespace(np=temp, gpu=torch.from_numpy(temp)),
            seeds=SimpleNamespace(gpu=torch.arange(len(temp), dtype=torch.int64)),
            any_explicit_seed=lambda idx: bool(np.any(np.array(seeded)[idx])))
        self.req_states = SimpleNamespace(prefill_len=SimpleNamespace(gpu=None))

    def get_logprobs_dims(self, idx_mapping_np):
        return None

    def sample(self, logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos,
               input_ids, expanded_local_pos, seq_lens_upper_bound_np, return_logprobs=False):
        self.calls.append("sample")
        return logits.argmax(dim=-1), logits

    def apply_sampling_params(self, logits, expanded_idx_mapping, idx_mapping, idx_mapping_np,
                              pos, input_ids, expanded_local_pos, seq_lens_upper_bound_np,
                              skip_top_k_top_p=False):
        self.calls.append(f"apply_sampling_params(skip_top_k_top_p={skip_top_k_top_p})")
        return logits


def _binding(budget=6, depth=6, max_num_reqs=4, max_num_tokens=32):
    from vllm_ddtree.gpu.step_rows import StepRows
    from vllm_ddtree.gpu.target_binding import TargetBinding
    from vllm_ddtree.gpu.tree_state import TreeStates

    accepted = []
    binding = TargetBinding(TreeStates(max_num_reqs, budget, depth, "cpu"),
                            StepRows(max_num_reqs, max_num_tokens, budget, "cpu"),
                            accepted.append)
    return binding, accepted


def _store_chains(trees, tokens: list[int], num_reqs: int) -> None:
    """Every request's tree the chain ``tokens`` (node j's parent is row j)."""
    from vllm_ddtree.tree import DraftTree

    budget = len(tokens)
    t = torch.tensor([tokens] * num_reqs)
    tree = DraftTree(t, torch.arange(budget).expand(num_reqs, -1).clone(),
                     torch.arange(1, budget + 1).expand(num_reqs, -1).clone(),
                     torch.full((num_reqs,), budget), torch.zeros(num_reqs, budget), budget)
    draft = torch.zeros(num_reqs, budget, dtype=torch.int64)
    trees.store_batch(tree, torch.zeros(num_reqs, trees.max_depth, 4), draft,
                      torch.arange(num_reqs))


@pytest.mark.parametrize(("temperature", "seeded", "masks", "rule"), [
    ([0.0, 0.0], [False, False], {}, "argmax"),  # greedy: every row's argmax, one launch
    ([0.0, 0.0], [True, False], {}, "argmax"),  # a seed changes no greedy token
    ([0.0, 0.0], [False, False], {"top_k": [8, 3]}, "sample"),  # vLLM masks, then argmax
    ([0.0, 0.0], [False, False], {"top_p": [0.9, 1.0]}, "sample"),
    ([1.0, 0.7], [False, False], {}, "choice"),
    ([0.0, 1.0], [False, False], {}, "choice"),  # greedy rows take the argmax in the kernel
    ([1.0, 1.0], [False, True], {}, "sample"),  # a seeded request: vLLM's noise at every row
])
def test_verifier_draws_with_the_choice_rule_when_it_may(monkeypatch, temperature, seeded,
                                                         masks, rule):
    """Sampled batches without per-request seeds: vLLM's processing of the logits, the
    choice rule, the walk, and the stop draws (noise keyed by the requests' seeds);
    greedy batches without top-k/top-p: vLLM's processing of the logits and their
    argmax; otherwise vLLM's sampler at every row.  Either way the runner gets the
    walk's tokens and the speculator the accepted paths."""
    import vllm_ddtree.gpu.verifier as verifier
    from vllm_ddtree.gpu.verify_sampling import choose_children_torch, draw_stop_tokens_torch

    budget, V = 3, 8
    binding, accepted = _binding(budget=budget, depth=3, max_num_reqs=2)
    _store_chains(binding.trees, [1, 2, 3], 2)
    draws = []
    monkeypatch.setattr(verifier, "choose_children", lambda x, s, loc, pos, t, seeds, w, p:
                        choose_children_torch(x, s, loc, t, w, p, torch.full((len(s),), 0.5)))

    def draw_stop_tokens(*args):
        positions, walk_tokens, parents, seeds = args[7:]
        assert seeds is sampler.sampling_states.seeds.gpu  # keyed by the requests' seeds
        # the nodes' positions (root + depth) and the committed trees
        assert torch.equal(positions, binding.rows.positions[batch.logits_indices])
        assert walk_tokens is binding.trees.walk_tokens and parents is binding.trees.parents
        draws.append(args)
        zero_noise = torch.zeros(args[6].shape[0], args[0].shape[1])
        draw_stop_tokens_torch(*args[:7], *args[8:10], zero_noise)

    monkeypatch.setattr(verifier, "draw_stop_tokens", draw_stop_tokens)
    monkeypatch.setattr(verifier, "get_num_sampled_and_rejected",
                        lambda num_sampled, *args: (num_sampled, torch.zeros_like(num_sampled)))
    sampler = _Sampler(temperature, seeded, **masks)
    ddtree = object.__new__(verifier.DDTreeVerifier)
    ddtree.sampler, ddtree.binding = sampler, binding
    W = budget + 1
    logits = torch.full((2 * W, V), -5.0)
    logits[torch.arange(2 * W), torch.tensor([1, 2, 7, 0] * 2)] = 5.0  # 1, 2, then off-tree
    batch = SimpleNamespace(
        logits_indices=torch.arange(2 * W), input_ids=torch.zeros(2 * W, dtype=torch.int64),
        seq_lens_cpu_upper_bound=torch.zeros(2), idx_mapping_np=np.arange(2),
        idx_mapping=torch.arange(2, dtype=torch.int32),
        expanded_idx_mapping=torch.arange(2, dtype=torch.int32).repeat_interleave(W),
        expanded_local_pos=torch.arange(W, dtype=torch.int32).repeat(2),
        cu_num_logits=torch.tensor([0, W, 2 * W], dtype=torch.int32), num_reqs=2,
        seq_lens=None)
    out = ddtree(logits, batch, None)
    want = {"sample": ["sample"],
            "argmax": ["apply_sampling_params(skip_top_k_top_p=True)"],
            "choice": ["apply_sampling_params(skip_top_k_top_p=False)"]}[rule]
    assert sampler.calls == want
    assert len(draws) == (rule == "choice")
    # u = 0.5: rows 0 and 1 take their child (p ~ 1), row 2 stops (its child has p ~ 0)
    # and draws 7; argmax rows give the same tokens
    assert out.sampled_token_ids[:, :3].tolist() == [[1, 2, 7]] * 2
    assert out.num_sampled.tolist() == [3, 3]
    assert len(accepted) == 1 and accepted[0].num_accepted.tolist() == [3, 3]


@pytest.mark.parametrize(("temperature", "seeded", "masks", "batch", "rule"), [
    ([0.0, 0.5, 0.0], [False] * 3, {}, [0, 2], "argmax"),  # only the batch's rows count
    ([0.0, 0.5, 0.0], [False] * 3, {}, [1, 2], "choice"),
    ([0.0, 1e-6, 0.0], [False] * 3, {}, [1], "choice"),  # vLLM samples any T != 0
    ([0.0, 0.0, 0.0], [False] * 3, {"top_k": [8, 8, 7]}, [0, 1], "argmax"),
    ([0.0, 0.0, 0.0], [False] * 3, {"top_k": [8, 8, 7]}, [2, 0], "sample"),
    ([0.0, 0.0, 0.0], [False] * 3, {"top_p": [1.0, 0.99, 1.0]}, [1], "sample"),
    ([0.0, 0.0, 0.0], [False] * 3, {}, [], "argmax"),  # an empty batch draws nothing
])
def test_draw_rule_reads_the_batchs_requests(temperature, seeded, masks, batch, rule):
    """The host-side rule reads the sampling parameters of the batch's own request
    states: an argmax where none samples and none sets top-k or top-p."""
    import vllm_ddtree.gpu.verifier as verifier

    ddtree = object.__new__(verifier.DDTreeVerifier)
    ddtree.sampler = _Sampler(temperature, seeded, **masks)
    assert ddtree._draw_rule(np.array(batch, dtype=np.int32)) == rule


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllms_greedy_draw_is_torchs_argmax(dtype):
    """A greedy batch's verify rows take ``argmax`` of vLLM's processed logits where
    vLLM's sampler runs its Gumbel kernel at temperature 0: the same token, ties within
    and across the kernel's 1024-entry blocks and a row of ties included, so DDTree at
    T = 0 emits what decoding without speculation emits."""
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    g = torch.Generator().manual_seed(0)
    V = 3 * 1024 + 77
    x = torch.randn(64, V, generator=g).mul(2).round().div(2)  # many ties in every row
    x[0, [5, 2000, V - 1]] = 50.0  # the max in three blocks
    x[1, [101, 100]] = 50.0  # in one block
    x[2, [1500, 1024]] = 50.0  # a block's first entry
    x[3] = 0.0
    x = x.to(dtype).cuda()
    n = x.shape[0]
    drawn = gumbel_sample(x, torch.zeros(n, dtype=torch.int32, device="cuda"),
                          torch.zeros(1, device="cuda"),
                          torch.zeros(1, dtype=torch.int64, device="cuda"),
                          torch.arange(n, device="cuda"), apply_temperature=False,
                          is_drafting=False)
    assert drawn[:4].tolist() == [5, 100, 1024, 0]
    assert torch.equal(drawn, x.argmax(dim=-1))


@pytest.mark.parametrize(("kwargs", "real"), [
    ({"num_speculative_tokens": 15}, True),
    ({"num_speculative_tokens": 0}, False),  # vLLM skips the query pass: no new trees
    ({"num_speculative_tokens": 15, "dummy_run": True}, False),
])
def test_propose_after_the_pass(monkeypatch, kwargs, real):
    """After a real drafter pass: the NaN/inf report, and the chain fallback of the
    chain-flagged requests (their batch rows and request states); after a dummy pass:
    its count dropped, and the trees it stored at the dummy batch's states dropped; a
    step without a query pass: neither."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.gpu.nonfinite_count import NonfiniteCount
    from vllm_ddtree.gpu.speculator import DDTreeSpeculator

    monkeypatch.setattr(DFlashSpeculator, "propose", lambda self, *a, **k: "drafts")
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no GPU here
    binding, _ = _binding()
    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)
    spec.trees, spec.online, spec._accepted = binding.trees, None, None
    spec.device, spec.draft_tokens = torch.device("cpu"), None
    spec._nonfinite = NonfiniteCount("cpu")
    spec._nonfinite.add(torch.tensor([True, False]))  # this pass's NaN/inf request
    binding.trees.add_request(3, as_chain=True)
    chains, drops = [], []
    monkeypatch.setattr(binding.trees, "apply_chain_fallback",
                        lambda rows, states, _: chains.append((rows.tolist(), states.tolist())))
    monkeypatch.setattr(binding.trees, "drop_trees", lambda s: drops.append(s.tolist()))
    # batch rows 0, 1, 2 hold states 1, 3, 0; state 3 is verified as a chain
    batch = SimpleNamespace(num_reqs=3, idx_mapping_np=np.array([1, 3, 0, 2]),
                            idx_mapping=torch.tensor([1, 3, 0, 2], dtype=torch.int32))
    out = spec.propose(batch, None, None, None, None, None, None, None, None, None, None,
                       **kwargs)
    assert out == "drafts"
    assert chains == ([([1], [3])] if real else [])
    assert drops == ([[1, 3, 0]] if kwargs.get("dummy_run") else [])
    # a real pass reports (its copy brings the count); a dummy pass's count is dropped
    assert spec._nonfinite.seen == real
    spec._nonfinite.report()
    assert spec._nonfinite.seen == (0 if kwargs.get("dummy_run") else 1)


ADAPTIVE = [(1, 1, 63), (2, 3, 31), (4, 1 << 20, 15)]


@pytest.mark.parametrize(("schedule", "online", "mode", "max_tokens", "want"), [
    # graphs of 1, 2, 4, 8 requests (16 query rows each): batch 3 replays the 4-request
    # graph; batches 9-10 run eagerly
    (ADAPTIVE, False, "FULL_DECODE_ONLY", 512, [0, 63, 31, 31, 31, 15, 15, 15, 15, 15, 15]),
    # 32 tokens hold 2 requests: graphs of 1 and 2; eager passes build the 2-request
    # graph's width (compiled at capture) rather than a new one
    (ADAPTIVE, False, "FULL_DECODE_ONLY", 32, [0, 63, 31] + [31] * 8),
    (ADAPTIVE, False, "NONE", 512, None),  # no drafter graphs: one width, the budget
    (ADAPTIVE, True, "FULL_DECODE_ONLY", 512, None),  # online: any budget at any batch
    (None, False, "FULL_DECODE_ONLY", 512, None),  # a fixed budget
])
def test_drafter_pass_builds_the_budget_its_graph_serves(schedule, online, mode, max_tokens,
                                                         want):
    """The tree each drafter pass builds, from vLLM's own schedule lookup and its own
    rule for the drafter's graph sizes; the online policy, fixed budgets and drafters
    without graphs build the full budget."""
    from vllm.config.compilation import CUDAGraphMode

    from vllm_ddtree.gpu.speculator import DDTreeSpeculator

    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)
    spec.budget, spec.max_num_reqs, spec.num_query_per_req = 63, 10, 16
    spec.online = object() if online else None
    spec.speculative_config = SimpleNamespace(num_speculative_tokens_per_batch_size=schedule)
    spec.query_cudagraph_manager = SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode])
    spec.vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(
        decode_cudagraph_capture_request_sizes=[1, 2, 4, 8],
        max_cudagraph_capture_size=max_tokens, max_decode_cudagraph_capture_tokens=None))
    spec._tree_budgets = spec._drafter_budgets()
    assert spec._tree_budgets == want
    got = [spec._pass_budget(n) for n in range(1, 11)]
    assert got == (want[1:] if want else [63] * 10)


def test_drafter_graph_context_covers_the_verify_rows_of_its_steps():
    """A captured drafter pass stores as context one verify per request at the widest
    tree its graph's steps verify (vLLM's rule at the pass budget): every decode step the
    graph serves fits (more rows, e.g. a prefill, vLLM stores before the replay), and an
    adaptive engine's graphs of 4 requests and up compute 16 rows a request, not 64.
    Without a schedule (or before the graphs are known): vLLM's own rule."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    from vllm_ddtree.gpu.speculator import DDTreeSpeculator

    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)
    spec.num_speculative_steps, spec.max_num_tokens = 63, 512
    assert [spec._num_graph_context_tokens(n) for n in (1, 4, 8, 10)] == [64, 256, 512, 512]
    spec.budget, spec._tree_budgets = 63, [0, 63, 31, 31, 31, 15, 15, 15, 15, 15, 15]
    got = [spec._num_graph_context_tokens(n) for n in (1, 2, 4, 8)]
    assert got == [64, 64, 128, 128]
    step_budget = build_dynamic_sd_schedule_lookup(ADAPTIVE, 10, 63)
    for k in range(1, 9):  # batch k replays the graph of the next captured size
        graph = next(n for n in (1, 2, 4, 8) if n >= k)
        assert k * (1 + step_budget[k]) <= spec._num_graph_context_tokens(graph), k


def test_draft_tree_builds_the_pass_budget():
    """Both speculators build the tree of ``_pass_budget(num_reqs)`` (the DFlash one
    from its logits, the DSpark one with its Markov head)."""
    from vllm_ddtree.gpu.dspark_speculator import DDTreeDSparkSpeculator
    from vllm_ddtree.gpu.speculator import DDTreeSpeculator
    from vllm_ddtree.tree.conditioned import MarkovHead

    R, D, V = 3, 4, 40
    logits = torch.randn(R * D, V, generator=torch.Generator().manual_seed(0))
    for cls in (DDTreeSpeculator, DDTreeDSparkSpeculator):
        spec = cls.__new__(cls)
        spec.budget, spec.max_depth = 15, D
        spec._tree_budgets = [0, 9, 9, 6, 6]
        spec.sample_indices = torch.arange(R * 15)
        spec._sample_rows = lambda n: torch.arange(n * D)
        spec.model = SimpleNamespace(compute_logits=lambda h: h,
                                     compute_draft_logits=lambda h: h)
        spec.input_buffers = SimpleNamespace(input_ids=torch.zeros(R * D, dtype=torch.int32))
        spec._anchor_idx = torch.arange(R) * D
        spec._markov_head = MarkovHead(torch.zeros(V, 2), torch.zeros(V, 2))
        spec._draft_to_target = None
        tree, _ = spec._draft_tree(logits, R)
        assert tree.token_ids.shape == (R, 6), cls.__name__
        assert (tree.token_ids >= 0).all()


def test_markov_head_reads_the_drafters_factors_and_refuses_what_it_cannot():
    """The build's Markov head: the embedding's weight, the projection's draft-vocabulary
    rows (ParallelLMHead pads its rows) and the logits processor's scale; a recurrent or
    quantized head, or a soft cap, is refused with the method that serves it."""
    from vllm_ddtree.gpu.markov_head import markov_head_of

    w1, w2 = torch.randn(50, 4), torch.randn(64, 4)  # 40 draft tokens padded to 64

    def model(**kw):
        head = SimpleNamespace(markov_w1=SimpleNamespace(weight=kw.get("w1", w1)),
                               markov_w2=SimpleNamespace(weight=w2))
        processor = SimpleNamespace(scale=0.5, soft_cap=kw.get("soft_cap"),
                                    org_vocab_size=40)
        return SimpleNamespace(model=SimpleNamespace(markov_head=head),
                               logits_processor=processor,
                               has_recurrent_markov_head=kw.get("recurrent", False))

    head = markov_head_of(model())
    assert head.w1 is w1 and head.w2.shape == (40, 4) and head.scale == 0.5
    assert head.w2.data_ptr() == w2.data_ptr()  # a view of the loaded weight
    for bad in (dict(recurrent=True), dict(w1=torch.zeros(50, 4, dtype=torch.uint8))):
        with pytest.raises(ValueError, match="two dense factors.*method='dspark'"):
            markov_head_of(model(**bad))
    with pytest.raises(ValueError, match="soft cap"):
        markov_head_of(model(soft_cap=30.0))


def test_dummy_sampler_run_compiles_the_choice_rule_for_the_models_logits():
    """vLLM's start-up sampler pass reaches the verifier's warm-up with the model's own
    logits of one sampled row (the dtype a temperature-1 request brings), and vLLM's
    default pass still runs (False)."""
    from vllm_ddtree.gpu.model_state import DDTreeModelState

    state = DDTreeModelState.__new__(DDTreeModelState)
    state._verifier = None
    hidden = torch.randn(4, 3)
    assert state.dummy_sampler_run("sampler", hidden) is False  # no verifier: nothing
    warmed = []
    state._verifier = SimpleNamespace(warm_up=warmed.append)
    state.compute_sample_logits = lambda h: torch.cat([h, h], dim=1).bfloat16()
    assert state.dummy_sampler_run("sampler", hidden) is False
    assert len(warmed) == 1 and warmed[0].shape == (1, 6)
    assert warmed[0].dtype == torch.bfloat16


def test_verifier_warm_up_launches_on_vllms_index_dtypes_and_the_engines_buffers(
        monkeypatch):
    """The warm-up compiles on the engine's own node and sampling-state buffers and on
    index tensors of vLLM's own dummy batch: a launch specializes on pointer dtypes, and
    vLLM 0.34's steps map rows to request states with int64 (the model runner's
    ``idx_mapping``; ``expanded_local_pos`` and ``cu_num_logits`` int32).  Int32 state
    indices compiled kernels no step used: the first sampled request compiled them."""
    import vllm_ddtree.gpu.verifier as verifier

    binding, _ = _binding(budget=5, depth=4)
    calls = []
    monkeypatch.setattr(verifier, "warm_choice_rule", lambda *a: calls.append(a))
    ddtree = object.__new__(verifier.DDTreeVerifier)
    ddtree.binding = binding
    states = SimpleNamespace(temperature=SimpleNamespace(gpu=torch.ones(4)),
                             seeds=SimpleNamespace(gpu=torch.zeros(4, dtype=torch.int64)))
    ddtree.sampler = SimpleNamespace(sampling_states=states)
    logits = torch.zeros(1, 8)
    ddtree.warm_up(logits)
    (x, rows_states, local, idx_mapping, cu_num_logits, positions, temperature, seeds,
     walk_tokens, parents, depth), = calls
    assert x is logits and depth == 4
    assert [t.dtype for t in (rows_states, local, idx_mapping, cu_num_logits)] == [
        torch.int64, torch.int32, torch.int64, torch.int32]
    assert rows_states.tolist() == [0] and idx_mapping.tolist() == [0]
    assert local.tolist() == [0] and cu_num_logits.tolist() == [0, 1]
    assert positions.dtype == torch.int64 and positions.shape == (1,)
    assert positions.data_ptr() == binding.rows.positions.data_ptr()
    assert temperature is states.temperature.gpu and seeds is states.seeds.gpu
    assert walk_tokens.data_ptr() == binding.trees.walk_tokens.data_ptr()
    assert parents.data_ptr() == binding.trees.parents.data_ptr()


@pytest.mark.parametrize("engine_chain", [None, "custom logits processors"])
def test_add_request_clears_the_slots_old_tree(monkeypatch, engine_chain):
    """A reused request slot must not keep its previous request's tree: vLLM pads a new
    request's first step with placeholder drafts (prefix-cache hit), and a stale node
    equal to the target's token would be accepted."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vllm_ddtree.gpu.model_state import DDTreeModelState

    monkeypatch.setattr(DefaultModelState, "add_request", lambda self, i, data: None)
    binding, _ = _binding()
    state = DDTreeModelState.__new__(DDTreeModelState)
    state.binding, state._engine_chain = binding, engine_chain
    _store_chains(binding.trees, [4, 5, 6, 7, 8, 9], 4)
    state.add_request(2, SimpleNamespace(req_id="r", sampling_params=None))
    assert binding.trees.walk_tokens[2].tolist() == [-1] * 6
    assert binding.trees.walk_tokens[1].tolist() == [4, 5, 6, 7, 8, 9]  # untouched
    assert binding.trees.chain_rows(np.arange(4)).tolist() == \
        ([2] if engine_chain is not None else [])


def test_chain_warning_is_left_for_the_first_real_request(monkeypatch):
    """vLLM's sampler warm-up sends requests with every sampling feature (penalties too):
    they are verified as a chain, but the one-time warning must wait for a user's request
    (otherwise it is spent at start-up and never shows for real penalty requests).  The
    dedup is vLLM's warning_once (by message and arguments: one warning per reason)."""
    from vllm import logger as vllm_logger
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from vllm_ddtree.gpu import model_state as ms

    monkeypatch.setattr(DefaultModelState, "add_request", lambda self, i, data: None)
    vllm_logger._print_warning_once.cache_clear()  # forget earlier tests' warnings
    warned = []
    monkeypatch.setattr(ms.logger, "warning", lambda msg, *a, **_: warned.append(msg % a))
    state = ms.DDTreeModelState.__new__(ms.DDTreeModelState)
    state.binding, state._engine_chain = _binding()[0], None
    penalty = SimpleNamespace(repetition_penalty=1.2, presence_penalty=0.0,
                              frequency_penalty=0.0)
    state.add_request(0, SimpleNamespace(req_id="_warmup_0_", sampling_params=penalty))
    chain = state.binding.trees.chain_rows
    assert chain(np.arange(4)).tolist() == [0] and warned == []
    state.add_request(1, SimpleNamespace(req_id="cmpl-1", sampling_params=penalty))
    state.add_request(2, SimpleNamespace(req_id="cmpl-2", sampling_params=penalty))
    assert chain(np.arange(4)).tolist() == [0, 1, 2] and len(warned) == 1
    assert "penalties" in warned[0]
    state.add_request(3, SimpleNamespace(req_id="cmpl-3",
                                         sampling_params=SimpleNamespace(bad_words=["x"])))
    assert len(warned) == 2 and "bad words" in warned[1]  # a new reason: a new warning


def _attention_layer():
    """A target-shaped ``Attention`` on FlashAttention, without vLLM's constructor."""
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


def _load_speculator(layers):
    """A DDTree speculator whose load_model switches the target ``layers``."""
    from vllm_ddtree.gpu.speculator import DDTreeSpeculator

    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers))
    speculator = object.__new__(DDTreeSpeculator)
    speculator.vllm_config = config
    binding, _ = _binding()
    speculator.trees, speculator.step_rows = binding.trees, binding.rows
    speculator.load_model(torch.nn.Linear(1, 1))
    return speculator


def _engine():
    """One engine's DDTree pieces, built the way vLLM's V2 runner builds them: the
    speculator, then (after its load_model) the model state from the target model, its
    verifier, and the target layers' attention metadata builder."""
    from vllm_ddtree.gpu.speculator import DDTreeSpeculator

    forward_context = {name: _attention_layer() for name in [*TARGET_LAYERS, "draft.attn"]}
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=forward_context),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        model_config=SimpleNamespace(logits_processors=None), speculative_config=None)
    speculator = object.__new__(DDTreeSpeculator)
    speculator.vllm_config = config
    binding, _ = _binding()
    speculator.trees, speculator.step_rows = binding.trees, binding.rows
    speculator._accepted = None
    target = torch.nn.Linear(1, 1)
    speculator.load_model(target)
    # vLLM's init_model_state: cls(vllm_config, model, encoder_cache, device)
    state = target.get_model_state_cls()(config, target, None, "cpu")
    _, verify = state.custom_sampler("sampler")
    # vLLM's attention groups: one builder per backend, over that backend's layers
    builder = forward_context[TARGET_LAYERS[0]].get_attn_backend().get_builder_cls()(
        None, TARGET_LAYERS, config, "cpu")
    return SimpleNamespace(speculator=speculator, trees=speculator.trees,
                           rows=speculator.step_rows, layers=forward_context, state=state,
                           verifier=verify, builder=builder)


def _common(query_start: list[int], seq_lens: list[int], max_query_len: int):
    """vLLM's CommonAttentionMetadata, the fields the tree builder reads (and its
    ``replace``)."""
    fields = dict(num_reqs=len(seq_lens), max_query_len=max_query_len, causal=True,
                  num_actual_tokens=query_start[-1],
                  query_start_loc=torch.tensor(query_start, dtype=torch.int32),
                  seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
    common = SimpleNamespace(**fields)
    common.replace = lambda **kw: SimpleNamespace(**{**fields, **kw})
    return common


def _fill_rows(engine, common, has_trees: bool = True) -> None:
    """The model state's per-step fill for the batch ``common`` describes (every request
    a tree of its q_len rows)."""
    n = common.num_reqs
    query_start = common.query_start_loc
    num_tokens = int(query_start[-1])
    engine.trees.fill_rows(engine.rows, query_start, query_start.clone(),
                           torch.arange(n, dtype=torch.int32), torch.arange(num_tokens),
                           common.seq_lens, n, n, num_tokens, has_trees=has_trees)


def test_two_engines_in_one_process_keep_their_own_state(v2_stubs):
    """Each engine's trees and step rows belong to its speculator and reach its model
    state, verifier, attention layers and metadata builder through that engine's own
    objects (target model, static_forward_context): a second engine in the same process
    neither replaces nor reads the first one's; the verifier's walk goes back to its own
    speculator."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    from vllm_ddtree.gpu.attention import DDTreeFlashAttentionBuilder

    first, second = _engine(), _engine()
    assert first.trees is not second.trees and first.rows is not second.rows
    for engine in (first, second):
        assert engine.state.binding.trees is engine.trees
        assert engine.state.binding.rows is engine.rows
        assert engine.verifier.binding is engine.state.binding
        assert engine.state.binding.on_accepted.__self__ is engine.speculator
        assert type(engine.builder) is DDTreeFlashAttentionBuilder
        assert engine.builder._step_rows is engine.rows
        assert all(engine.layers[name].impl.step_rows is engine.rows
                   for name in TARGET_LAYERS)
        drafter = engine.layers["draft.attn"]  # the drafter keeps vLLM's attention
        assert drafter.attn_backend is FlashAttentionBackend
        assert not hasattr(drafter.impl, "step_rows")

    # one engine's step drives only its own attention metadata
    common = _common(query_start=[0, 7, 14], seq_lens=[20, 30], max_query_len=7)
    _fill_rows(first, common)
    meta = first.builder.build(0, common)
    assert meta.ddtree.row_bits is first.rows.bits
    assert meta.ddtree.max_rows == 7 and meta.ddtree.fused
    assert meta.ddtree.prefix_lens.tolist() == [13, 23]
    assert second.builder.build(0, common).ddtree is None

    # the model state writes and reads only its own engine's state
    _store_chains(first.trees, [5] * 6, 4)
    _store_chains(second.trees, [5] * 6, 4)
    second.state.add_request(1, SimpleNamespace(req_id="r", sampling_params=None))
    assert second.trees.walk_tokens[1].tolist() == [-1] * 6
    assert first.trees.walk_tokens[1].tolist() == [5] * 6
    positions = first.state.prepare_inputs(SimpleNamespace(num_tokens_after_padding=4),
                                           None)["positions"]
    assert positions.data_ptr() == first.rows.positions.data_ptr()


def test_fused_tree_step_builds_fa3_schedule_for_the_prefix_call(v2_stubs):
    """In a fused tree step (every request within 1 + budget rows) vLLM's builder gets
    the prefix call's inputs (its FA3 schedule is the one forward's prefix call uses):
    each request's prefix length, non-causal, no cascade.  Other steps get vLLM's own."""
    engine = _engine()
    common = _common([0, 7, 10], [20, 30], max_query_len=7)
    _fill_rows(engine, common)
    meta = engine.builder.build(5, common)
    prefix_len, given = meta.args[:2]
    assert meta.ddtree.fused and prefix_len == 0
    assert given.causal is False and given.seq_lens.tolist() == [13, 27]
    assert given.seq_lens.data_ptr() == meta.ddtree.prefix_lens.data_ptr()
    assert meta.ddtree.max_rows == 7  # 1 + budget
    # an engine that also verifies 4-row trees: a uniform 3-row step launches over 4
    # rows; a mixed one (3 and 2 rows: a short prefill beside a tree, never captured)
    # over 1 + budget, a width whose tilings start-up compiles
    engine.rows.verify_widths = [4, 7]
    assert engine.builder.build(5, _common([0, 3, 6], [20, 30], 3)).ddtree.max_rows == 4
    assert engine.builder.build(5, _common([0, 3, 5], [20, 30], 3)).ddtree.max_rows == 7
    assert engine.builder.build(5, _common([0, 5, 6], [20, 30], 5)).ddtree.max_rows == 7
    # a step with a prefill chunk (8 rows > 1 + budget): vLLM's causal metadata
    common = _common([0, 8, 9], [20, 30], max_query_len=8)
    _fill_rows(engine, common)
    meta = engine.builder.build(5, common)
    assert not meta.ddtree.fused and meta.args[:2] == (5, common)
    # the tree kernel recomputes request 1 (1 row <= 1 + budget), not the chunk
    assert meta.ddtree.query_end.tolist() == [0, 9]
    assert meta.ddtree.prefix_lens.tolist() == [12, 29]
    # a step without trees: vLLM's metadata, no tree part
    _fill_rows(engine, common, has_trees=False)
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


def test_missing_wiring_fails_clearly(v2_stubs):
    """A model state or tree attention builder whose engine never bound its state
    refuses to start (instead of serving trees from another engine's, or none)."""
    from vllm_ddtree.gpu.attention import DDTreeFlashAttentionBuilder
    from vllm_ddtree.gpu.model_state import DDTreeModelState

    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={
            name: _attention_layer() for name in TARGET_LAYERS}),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        model_config=SimpleNamespace(logits_processors=None))
    with pytest.raises(RuntimeError, match="carries no DDTree state"):
        DDTreeModelState(config, torch.nn.Linear(1, 1), None, "cpu")
    with pytest.raises(RuntimeError, match="found no DDTree step rows"):
        DDTreeFlashAttentionBuilder(None, TARGET_LAYERS, config, "cpu")


def test_unsupported_target_layers_are_refused(v2_stubs):
    """Target layers with features the tree attention lacks stop the engine at load
    time, naming the layer and every feature; so does a layer on another backend."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from vllm_ddtree.gpu.attention import check_target_layer

    layer = _attention_layer()
    layer.impl.sliding_window = (127, 0)
    layer.impl.head_size = 96
    engine_layers = {"model.layers.3.attn": layer}
    with pytest.raises(NotImplementedError) as info:
        _load_speculator(engine_layers)
    message = str(info.value)
    assert "model.layers.3.attn" in message
    assert "sliding-window attention" in message and "head size 96" in message
    other = TritonAttentionImpl.__new__(TritonAttentionImpl)
    other.sliding_window, other.alibi_slopes, other.logits_soft_cap = None, None, None
    other.sinks, other.kv_cache_dtype = None, "fp8"
    with pytest.raises(NotImplementedError) as info:
        check_target_layer("model.layers.0.attn", other)
    assert "TritonAttentionImpl (DDTree needs FLASH_ATTN)" in str(info.value)
    assert "an fp8 KV cache" in str(info.value)


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
                        lambda self, batch, mode, tables, slots, groups, config, *a:
                        seen.append(groups))
    engine = _engine()
    monkeypatch.setattr(engine.trees, "fill_rows", lambda *args, **kwargs: None)
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


@pytest.mark.gpu
@pytest.mark.parametrize("sample_from_anchor", [False, True])  # DFlash, DSpark
def test_batch_states_read_vllms_dflash_input_kernel(sample_from_anchor):
    """The drafter pass stores each tree at the request state vLLM's own DFlash input
    kernel wrote for its batch row: the batch's states in batch order, -1 in the rows a
    padded CUDA graph adds (on a GPU: vLLM compiles its kernels only where one is)."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import prepare_dflash_inputs

    from vllm_ddtree.gpu.speculator import DDTreeSpeculator

    dev = torch.device("cuda")
    budget, depth, max_reqs, max_tokens = 7, 3, 6, 128
    num_query = depth if sample_from_anchor else 1 + depth
    q_lens = [1 + budget] * 3  # three tree verifies
    n = len(q_lens)
    qsl = torch.tensor([0] + np.cumsum(q_lens).tolist(), dtype=torch.int32, device=dev)

    def ints(size, dtype=torch.int64, fill=0):
        return torch.full((size,), fill, dtype=dtype, device=dev)

    buffers = SimpleNamespace(input_ids=ints(max_tokens, torch.int32),
                              positions=ints(max_tokens),
                              is_padding=ints(max_tokens, torch.bool),
                              query_start_loc=ints(max_reqs + 1, torch.int32),
                              seq_lens=ints(max_reqs, torch.int32))
    batch = SimpleNamespace(num_reqs=n, num_scheduled_tokens=np.array(q_lens),
                            positions=torch.arange(int(qsl[-1]), device=dev) + 50,
                            query_start_loc=qsl,
                            idx_mapping=torch.tensor([4, 0, 2], dtype=torch.int32, device=dev))
    spec = SimpleNamespace(sample_idx_mapping=ints(max_reqs * budget, fill=-1), budget=budget)
    spec.sample_idx_mapping[: max_reqs * budget: budget] = 5  # stale rows of a last step
    samples = max_reqs * budget
    prepare_dflash_inputs(
        buffers, ints(max_tokens), ints(max_tokens), ints(max_tokens), ints(samples),
        ints(samples), spec.sample_idx_mapping, torch.ones(samples, device=dev),
        ints(samples), batch, torch.ones(n, dtype=torch.int32, device=dev),
        torch.zeros(n, dtype=torch.int32, device=dev), ints(max_reqs), ints(max_reqs),
        torch.ones(max_reqs, device=dev), ints(max_reqs),
        torch.arange(max_reqs * 8, dtype=torch.int32, device=dev).view(max_reqs, 8),
        16, 0, 1, 1, 9, num_query, budget, max_reqs, max_tokens, 1024,
        sample_from_anchor=sample_from_anchor)
    # a graph of 5 requests replays this batch of 3
    assert DDTreeSpeculator._batch_states(spec, 5).tolist() == [4, 0, 2, -1, -1]
