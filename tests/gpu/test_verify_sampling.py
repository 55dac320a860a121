"""Tree verification at T > 0 with one full-vocabulary draw per request
(:mod:`vllm_ddtree.gpu.verify_sampling`): the Triton choice kernel
(``choose_children_triton``) against its torch reference, the keyed uniforms, the stop
draw's launcher against its reference, and the whole scheme (choose -> walk -> stop draw)
against the exact distribution of the per-row rule, with a mutation that the test
catches."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from vllm_ddtree.gpu.tree_state import TreeStates
from vllm_ddtree.gpu.verify_sampling import (
    NO_CHILD,
    choose_children_torch,
    choose_children_triton,
    draw_stop_tokens,
    draw_stop_tokens_torch,
    draw_stop_tokens_triton,
)
from vllm_ddtree.tree import build_tree

DEV = "cuda" if torch.cuda.is_available() else "cpu"
P_MIN = 1e-3


def _trees(num_states: int, budget: int, depth: int, draft_logits: torch.Tensor,
           chain_rows: list[int] = ()) -> TreeStates:
    """Request states 0..n-1 hold the trees of ``draft_logits [n, depth, V]``."""
    ts = TreeStates(num_states, budget, depth, "cpu")
    n = draft_logits.shape[0]
    draft_tokens = torch.zeros(num_states, budget, dtype=torch.int64)
    ts.store_batch(build_tree(draft_logits, budget), draft_logits, draft_tokens,
                   torch.arange(n))
    if chain_rows:
        ts.apply_chain_fallback(torch.tensor(chain_rows), torch.tensor(chain_rows),
                                draft_tokens)
    return ts


def _rows(num_reqs: int, width: int, states=None):
    """(states, local rows, positions, cu_num_logits) of ``width`` rows a request."""
    states = torch.arange(num_reqs) if states is None else states
    expanded = states.repeat_interleave(width).to(torch.int32)
    local = torch.arange(width).repeat(num_reqs).to(torch.int32)
    positions = 100 + local.long()
    cu = torch.arange(num_reqs + 1, dtype=torch.int32) * width
    return expanded, local, positions, cu


@pytest.mark.triton
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("V", "budget"), [(40, 12), (5000, 31), (9000, 6)])
def test_choice_kernel_matches_reference(seed, V, budget):
    """Random trees (one a chain fallback), greedy and sampled rows, logits with bf16
    ties and -inf (top-k) entries, uniforms anywhere in [0, 1) including 0: the kernel's
    choice equals the reference's, row for row.  Chunked stats (V > 4096) included."""
    g = torch.Generator().manual_seed(seed)
    R, D = 3, 4
    ts = _trees(R, budget, D, torch.randn(R, D, V, generator=g) * 2, chain_rows=[2])
    width = budget + 1
    states, local, positions, _ = _rows(R, width)
    logits = (torch.randn(R * width, V, generator=g) * 3).bfloat16().float()
    logits[:, V // 2:] = logits[:, V // 2:].masked_fill(
        torch.rand(R * width, V - V // 2, generator=g) < 0.3, float("-inf"))
    # make the drafted tokens likely, so that children are chosen often
    tokens = ts.walk_tokens[states.long()].clamp(min=0)
    logits.scatter_(1, tokens, 14.0 + torch.randn(tokens.shape, generator=g).bfloat16().float())
    temperature = torch.tensor([0.0, 1.0, 1.0])  # state 0 greedy
    uniforms = torch.rand(R * width, generator=g)
    uniforms[::7] = 0.0
    want = choose_children_torch(logits, states, local, temperature, ts.walk_tokens,
                                 ts.parents, uniforms)
    got = choose_children_triton(
        logits.to(DEV), states.to(DEV), local.to(DEV), positions.to(DEV),
        temperature.to(DEV), torch.zeros(R, dtype=torch.int64, device=DEV),
        ts.walk_tokens.to(DEV), ts.parents.to(DEV), uniforms.to(DEV))
    assert got.cpu().tolist() == want.tolist()
    greedy = want[:width]
    assert greedy.tolist() == logits[:width].argmax(dim=-1).tolist()
    assert (want[width:] == NO_CHILD).any() and (want[width:] >= 0).any()


@pytest.mark.triton
def test_keyed_uniforms():
    """Without given uniforms each row's uniform is keyed by (seed, position): the same
    keys give the same choices, also at other rows of a launch; over 600 positions a
    child of probability 0.3 is chosen at 0.3 (binomial, 4.5 sigma) and the choice
    depends on the seed.  (The repeat and the other seed run 100 of the positions: a
    launch of 600 rows takes ~10 s under the interpreter.)"""
    V, n = 16, 600
    walk_tokens = torch.full((2, 1), 5)  # one node, child of the root, token 5
    parents = torch.zeros((2, 1), dtype=torch.int64)
    logits = torch.full((n, V), float("-inf"))
    logits[:, 5] = torch.tensor(0.3).log()
    logits[:, 6] = torch.tensor(0.7).log()
    states = torch.zeros(n, dtype=torch.int32)
    local = torch.zeros(n, dtype=torch.int32)
    positions = torch.arange(n, dtype=torch.int64) * 3 + 11
    temperature = torch.ones(2)

    def run(seed, rows=slice(None)):
        seeds = torch.full((2,), seed, dtype=torch.int64)
        return choose_children_triton(logits[rows].to(DEV), states[rows].to(DEV),
                                      local[rows].to(DEV), positions[rows].to(DEV),
                                      temperature.to(DEV), seeds.to(DEV),
                                      walk_tokens.to(DEV), parents.to(DEV)).cpu()

    # the last 100 positions again, as rows 0-99 of a launch of their own
    a, b, c = run(1234), run(1234, slice(500, None)), run(99, slice(500, None))
    assert torch.equal(a[500:], b)
    assert set(a.tolist()) <= {5, NO_CHILD}
    rate = (a == 5).float().mean().item()
    assert abs(rate - 0.3) < 4.5 * (0.3 * 0.7 / n) ** 0.5, rate
    assert not torch.equal(a[500:], c)


def _exact(probs: torch.Tensor, tokens: list[int], parents: list[int], row: int = 0,
           prefix: tuple = (), mass: float = 1.0, out=None) -> dict[tuple, float]:
    """The per-row rule's distribution of one verify step's emitted tokens: at row i draw
    y ~ probs[i]; a child with token y continues the walk, any other y ends it."""
    out = {} if out is None else out
    kids = {tokens[j]: j + 1 for j in range(len(tokens)) if parents[j] == row
            and tokens[j] >= 0}
    for y, p in enumerate(probs[row].tolist()):
        if p == 0.0:
            continue
        if y in kids:
            _exact(probs, tokens, parents, kids[y], prefix + (y,), mass * p, out)
        else:
            out[prefix + (y,)] = out.get(prefix + (y,), 0.0) + mass * p
    return out


def _gumbel(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Standard Gumbel noise: argmax(logits + noise) is an exact draw from the softmax."""
    return -torch.log(-torch.log(torch.rand(shape, generator=g).clamp(min=1e-12)))


def _scheme_counts(seed: int, mask_children: bool) -> tuple[Counter, dict, int]:
    """Emitted tokens of N one-step verifies of one tree, through choose (torch) ->
    walk -> draw_stop_tokens; ``mask_children=False`` is a broken stop draw."""
    g = torch.Generator().manual_seed(seed)
    N, V, budget, D = 20000, 5, 6, 3
    draft = torch.tensor([[3.0, 2.5, 0.0, -1.0, -2.0]] * D)  # a bushy tree over 0 and 1
    ts = _trees(N, budget, D, draft.expand(N, D, V).clone())
    width = budget + 1
    probs = torch.softmax(torch.randn(width, V, generator=g) * 1.5, dim=-1)  # per row
    states, local, positions, cu = _rows(N, width)
    logits = probs.log().repeat(N, 1)
    choices = choose_children_torch(logits, states, local, torch.ones(N), ts.walk_tokens,
                                    ts.parents, torch.rand(N * width, generator=g))
    sampled, acc = ts.walk(choices, cu, torch.arange(N, dtype=torch.int32), N)
    parents = ts.parents if mask_children else torch.full_like(ts.parents, -1)
    draw_stop_tokens(logits, choices, sampled, acc.path, acc.num_accepted, cu,
                     torch.arange(N, dtype=torch.int32), positions, ts.walk_tokens, parents,
                     torch.zeros(N, dtype=torch.int64), _gumbel((N, V), g))
    seqs = Counter(tuple(sampled[b, : int(acc.num_accepted[b])].tolist()) for b in range(N))
    exact = _exact(probs, ts.walk_tokens[0].tolist(), ts.parents[0].tolist())
    return seqs, exact, N


def _gof_p(seqs: Counter, exact: dict, n: int) -> float:
    """Chi-square goodness of fit; sequences expected < 5 times pooled into one cell,
    and any emitted sequence the rule never emits lands in that cell too."""
    big = [s for s, p in exact.items() if p * n >= 5]
    obs = [seqs.get(s, 0) for s in big]
    exp = [exact[s] * n for s in big]
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
    return chisquare(obs, exp).pvalue


@pytest.mark.parametrize("seed", [0, 1])
def test_scheme_has_the_per_row_distribution(seed):
    """Threshold p > 1e-3 on 20000 one-step verifies of a bushy 6-node tree, per-row
    target distributions at random; every emitted sequence is one the rule can emit."""
    seqs, exact, n = _scheme_counts(seed, mask_children=True)
    assert set(seqs) <= set(exact)
    assert len(exact) > 20 and max(len(s) for s in seqs) >= 3  # the tree is used
    p = _gof_p(seqs, exact, n)
    assert p > P_MIN, p


def test_scheme_test_catches_an_unmasked_stop_draw():
    """Power: a stop draw that may return a child's token emits sequences the rule
    cannot, and the same test rejects it (p < 1e-3)."""
    seqs, exact, n = _scheme_counts(0, mask_children=False)
    assert _gof_p(seqs, exact, n) < P_MIN


def test_stop_draw_replaces_only_no_child_stops():
    """A stop on NO_CHILD takes the draw (children masked: their noise is the largest
    here, yet token 9 is drawn); a stop on a chosen but unscheduled child keeps that
    child's token; greedy argmax stops stay."""
    walk_tokens = torch.tensor([[4, 7]] * 3)
    parents = torch.zeros((3, 2), dtype=torch.int64)  # two children of the root
    cu = torch.tensor([0, 3, 6, 9], dtype=torch.int32)
    choices = torch.tensor([NO_CHILD, 0, 0, 7, 0, 0, 2, 0, 0])
    sampled = torch.tensor([[NO_CHILD, -1, -1], [7, -1, -1], [2, -1, -1]])
    path = torch.tensor([[0, -1, -1]] * 3)
    noise = torch.zeros(3, 10)
    noise[:, [4, 7]] = 100.0
    noise[:, 9] = 50.0
    args = (torch.zeros(9, 10), choices, sampled, path, torch.ones(3, dtype=torch.int64), cu,
            torch.arange(3, dtype=torch.int32), torch.arange(9), walk_tokens, parents,
            torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="needs gumbel"):
        draw_stop_tokens(*args)  # the torch reference takes its noise explicitly
    draw_stop_tokens(*args, noise)
    assert sampled[:, 0].tolist() == [9, 7, 2]


@pytest.mark.triton
@pytest.mark.parametrize("V", [10, 5000])
def test_stop_row_without_other_mass_emits_its_last_child(V):
    """Top-k/top-p can leave only a row's children finite; their probabilities' float32
    sum may still fall short of 1 and the uniform land in the gap (NO_CHILD): the stop
    then emits the row's last child, never a token of probability 0.  Both sides, one
    chunk and several."""
    walk_tokens = torch.tensor([[3, 7, 8]])  # 3 and 7 under the root, 8 under node 0
    parents = torch.tensor([[0, 0, 1]])
    logits = torch.full((1, V), float("-inf"))
    logits[0, [3, 7]] = 0.0
    args = [logits, torch.tensor([NO_CHILD]), torch.full((1, 3), -1),
            torch.zeros((1, 2), dtype=torch.int64), torch.ones(1, dtype=torch.int64),
            torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)]
    noise = torch.zeros(1, V)
    draw_stop_tokens_torch(*args, walk_tokens, parents, noise)
    assert args[2][0, 0] == 7
    args[2] = torch.full((1, 3), -1, device=DEV)
    draw_stop_tokens_triton(*(t.to(DEV) for t in args), torch.zeros(1, dtype=torch.int64,
                            device=DEV), walk_tokens.to(DEV), parents.to(DEV),
                            torch.zeros(1, dtype=torch.int64, device=DEV))
    assert int(args[2][0, 0]) == 7


def _stop_case(seed: int, V: int, budget: int):
    """Five requests (batch rows -> states 3, 0, 4, 1, 2; states 1 and 3 greedy) walked
    on the torch choice rule: stops that take a draw and greedy stops that do not."""
    g = torch.Generator().manual_seed(seed)
    R, D = 5, 4
    ts = _trees(R, budget, D, torch.randn(R, D, V, generator=g) * 3)
    states = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
    width = budget + 1
    expanded, local, positions, cu = _rows(R, width, states.long())
    logits = torch.randn(R * width, V, generator=g)
    temperature = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    choices = choose_children_torch(logits, expanded, local, temperature, ts.walk_tokens,
                                    ts.parents, torch.rand(R * width, generator=g))
    sampled, acc = ts.walk(choices, cu, states, R)
    stop_rows = cu[:-1].long() + acc.path.gather(1, (acc.num_accepted - 1)[:, None])[:, 0]
    need = choices[stop_rows] == NO_CHILD
    assert need.any() and not need.all()
    return g, ts, states, positions, cu, logits, choices, sampled, acc, need


@pytest.mark.triton
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("V", "budget"), [(40, 6), (3000, 31), (9000, 200)])
def test_stop_draw_kernel_matches_torch(seed, V, budget):
    """Given the same noise, the two-launch stop draw (``draw_stop_tokens_triton``, with
    chunked rows where V > 4096) writes the tokens of the torch one; the noise favours
    the children, so an unmasked child would show."""
    g, ts, states, positions, cu, logits, choices, sampled, acc, need = _stop_case(
        seed, V, budget)
    noise = _gumbel((5, V), g)
    walk = ts.walk_tokens[states.long()]
    noise.scatter_(1, walk.clamp(min=0), torch.where(walk >= 0, 30.0, noise.gather(
        1, walk.clamp(min=0))))  # the children's noise is the largest
    out = {}
    for impl, stop in (("torch", draw_stop_tokens_torch), ("triton", draw_stop_tokens_triton)):
        out[impl] = sampled.clone().to(DEV)
        common = [t.to(DEV) for t in (logits, choices)] + [out[impl]] + [
            t.to(DEV) for t in (acc.path, acc.num_accepted, cu, states)]
        if impl == "torch":
            stop(*common, *(t.to(DEV) for t in (ts.walk_tokens, ts.parents, noise)))
        else:
            stop(*common, *(t.to(DEV) for t in (positions, ts.walk_tokens, ts.parents,
                                                torch.zeros(5, dtype=torch.int64), noise)))
    assert torch.equal(out["torch"].cpu(), out["triton"].cpu())
    changed = (out["torch"].cpu() != sampled).any(dim=1)
    assert torch.equal(changed, need)  # exactly the NO_CHILD stops were drawn


@pytest.mark.triton
def test_keyed_stop_draws_have_the_rows_distribution_without_children():
    """Without given noise each stop draw is keyed by (seed, position): the same keys
    give the same tokens, another seed others; 400 stops of one row (p over 8 tokens,
    token 2 a child of the stop row) follow p without token 2, renormalized
    (chi-square, threshold p > 1e-3), and the same counts reject p itself (the test
    can fail).  (400 requests: a launch of this size takes seconds under the
    interpreter.)"""
    n, V = 400, 8
    p = torch.tensor([0.05, 0.1, 0.3, 0.15, 0.2, 0.05, 0.1, 0.05])
    walk_tokens = torch.tensor([[2, 5]])  # node 0 (token 2) under the root, 1 under node 0
    parents = torch.tensor([[0, 1]])
    logits = p.log().expand(n, V).contiguous()
    choices = torch.full((n,), NO_CHILD)
    cu = torch.arange(n + 1, dtype=torch.int32)  # one row per request: the root
    path = torch.zeros((n, 2), dtype=torch.int64)
    num_accepted = torch.ones(n, dtype=torch.int64)
    idx = torch.zeros(n, dtype=torch.int32)
    positions = torch.arange(n, dtype=torch.int64) * 5 + 17

    def run(seed, rows=slice(None)):
        m = len(range(n)[rows])
        sampled = torch.full((m, 3), -1, dtype=torch.int64)
        sampled = sampled.to(DEV)
        draw_stop_tokens_triton(
            logits[rows].to(DEV), choices[rows].to(DEV), sampled, path[rows].to(DEV),
            num_accepted[rows].to(DEV), cu[: m + 1].to(DEV), idx[rows].to(DEV),
            positions[rows].to(DEV), walk_tokens.to(DEV), parents.to(DEV),
            torch.tensor([seed], dtype=torch.int64, device=DEV))
        return sampled[:, 0].cpu()

    a, b, c = run(7), run(7, slice(300, None)), run(8, slice(300, None))
    assert torch.equal(a[300:], b) and not torch.equal(b, c)
    counts = torch.bincount(a, minlength=V).double()
    assert counts[2] == 0  # the child is never drawn
    keep = torch.arange(V) != 2
    q = p.double()
    assert chisquare(counts[keep], q[keep] / q[keep].sum() * n).pvalue > P_MIN
    assert chisquare(counts, q / q.sum() * n).pvalue < P_MIN  # p itself is rejected


@pytest.mark.triton
def test_keyed_stop_draws_over_several_chunks():
    """A row of 9000 tokens (three chunks) whose mass sits on two tokens in different
    chunks, one of them a child: the keyed draw never takes the child, takes both
    others' tokens at their odds (p > 1e-3 binomial test, 60 stops; the test rejects a
    draw confined to one chunk), and the same keys give the same tokens."""
    from scipy.stats import binomtest

    n, V = 60, 9000
    walk_tokens = torch.tensor([[8500]])  # one node, child of the root, in chunk 2
    parents = torch.zeros((1, 1), dtype=torch.int64)
    logits = torch.full((n, V), float("-inf"))
    logits[:, [100, 4200, 8500]] = torch.tensor([0.3, 0.5, 0.2]).log()
    sampled = torch.full((n, 2), -1, dtype=torch.int64, device=DEV)
    args = [t.to(DEV) for t in (logits, torch.full((n,), NO_CHILD))]
    rest = [t.to(DEV) for t in (torch.zeros((n, 2), dtype=torch.int64),
                                torch.ones(n, dtype=torch.int64),
                                torch.arange(n + 1, dtype=torch.int32),
                                torch.zeros(n, dtype=torch.int32),
                                torch.arange(n, dtype=torch.int64) * 3 + 5,
                                walk_tokens, parents, torch.tensor([11]))]
    draw_stop_tokens_triton(*args, sampled, *rest)
    got = sampled[:, 0].cpu()
    again = torch.full((n, 2), -1, dtype=torch.int64, device=DEV)
    draw_stop_tokens_triton(*args, again, *rest)
    assert torch.equal(again[:, 0].cpu(), got)
    assert set(got.tolist()) <= {100, 4200}
    k = int((got == 100).sum())
    assert binomtest(k, n, 0.3 / 0.8).pvalue > P_MIN, k
    assert binomtest(k, n, 1.0).pvalue < P_MIN  # one chunk only would be rejected


@pytest.mark.triton
def test_warm_up_compiles_both_logits_dtypes_on_the_engines_buffers(monkeypatch):
    """``warm_choice_rule`` launches the choice and stop-draw kernels once for the
    logits' own dtype and once for float32, on the index tensors and engine buffers it
    is given (their dtypes are what a launch specializes on), which it leaves as they
    were; off the GPU (no kernels to compile) it does nothing."""
    import vllm_ddtree.gpu.verify_sampling as vs

    trees = _trees(4, 6, 4, torch.randn(4, 4, 50, generator=torch.Generator().manual_seed(0)))
    walk_tokens, parents = trees.walk_tokens.to(DEV), trees.parents.to(DEV)
    states = torch.zeros(1, dtype=torch.int64, device=DEV)  # vLLM 0.34's index dtype
    local = torch.zeros(1, dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    positions = torch.zeros(1, dtype=torch.int64, device=DEV)
    temperature = torch.ones(4, device=DEV)
    seeds = torch.zeros(4, dtype=torch.int64, device=DEV)
    engine = (walk_tokens, parents, temperature, seeds)
    before = [t.clone() for t in engine]
    launched = []

    def recorded(name, index_args):
        fn = getattr(vs, name)

        def record(*args):
            launched.append((name, args[0].dtype, tuple(args[0].shape),
                             all(args[i] is t for i, t in index_args)))
            return fn(*args)
        return record

    monkeypatch.setattr(vs, "choose_children_triton", recorded(
        "choose_children_triton", [(1, states), (2, local), (3, positions),
                                   (4, temperature), (5, seeds)]))
    monkeypatch.setattr(vs, "draw_stop_tokens_triton", recorded(
        "draw_stop_tokens_triton", [(5, cu), (6, states), (7, positions), (10, seeds)]))

    def warm(x):
        vs.warm_choice_rule(x, states, local, states, cu, positions, temperature, seeds,
                            walk_tokens, parents, 4)

    logits = torch.randn(3, 50, device=DEV).bfloat16()
    if not logits.is_cuda:
        warm(logits)
        assert launched == []  # the torch reference runs off the GPU: nothing to compile
        monkeypatch.setattr(vs, "use_triton", lambda t: True)  # the interpreter runs them
    warm(logits[:0])
    assert launched == []  # no row to launch on
    warm(logits)
    assert launched == [(name, dtype, (1, 50), True)
                        for dtype in (torch.bfloat16, torch.float32)
                        for name in ("choose_children_triton", "draw_stop_tokens_triton")]
    assert all(torch.equal(t, b) for t, b in zip(engine, before))
