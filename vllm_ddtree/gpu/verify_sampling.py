"""Lossless tree verification at T > 0 that draws a full-vocabulary sample at one row per
request instead of every row.

The plain rule draws the target's token ``y ~ p`` at every verify row and follows the
child equal to ``y``.  Its path has the same distribution when each row instead draws
one uniform ``u`` and walks its children ``c_1 .. c_k`` (distinct tokens, in node order):
child ``c_j`` is taken when ``u`` falls in ``[P_{j-1}, P_j)`` with ``P_j = p(c_1) + ..
+ p(c_j)``, i.e. with probability ``p(c_j)``; when ``u >= P_k`` the walk stops and the
emitted token is drawn from ``p`` restricted to the other tokens (mass ``1 - P_k``), so
every token keeps its probability ``p(y)``.  A taken child that was not scheduled
(vLLM cut the tree short) stops the walk too and is itself the emitted token, a draw
with the right probability.

So one pass over the logits gives each row's log-sum-exp and its choice
(:func:`choose_children`: a child's token, or :data:`NO_CHILD`), the walk runs on those
choices as on drawn tokens, and only where a walk stopped on :data:`NO_CHILD` is a token
drawn from a full row, with its children masked (:func:`draw_stop_tokens`).  Greedy rows
take the argmax (lowest id on ties) as before.

Randomness: a row's ``u`` and the stop draw's Gumbel noise are keyed by (request seed,
row position), the key vLLM gives its own noise (which is vLLM's own hash, not these
draws): one Philox stream per key, the noise of token ``t`` at counter ``t`` and ``u``
at counter ``vocab_size`` (independent draws).  Rows of one depth share a key, and only
one of them lies on a path.  The stop draw is the Gumbel-max over the stop row's
processed logits with its children at ``-inf``, in the plugin's own two launches (no
call into vLLM's sampler between them).
"""

from __future__ import annotations

import torch

from vllm_ddtree.kernels.triton_utils import HAS_TRITON, next_pow2, tl, triton, use_triton

NO_CHILD = -3  # a row's choice when its uniform fell past every child's probability

_CHUNK = 4096  # vocabulary entries a stage-1 program reduces


def row_children(
    walk_tokens: torch.Tensor,  # [n, B] int64 node tokens (-1: never accepted)
    parents: torch.Tensor,  # [n, B] int64 node parents (verify rows)
    local: torch.Tensor,  # [n] row index within its request
) -> torch.Tensor:  # [n, B] bool
    """Which nodes are children of each row (in node order)."""
    return (parents == local.long().unsqueeze(1)) & (walk_tokens >= 0)


def choose_children_torch(
    logits: torch.Tensor,  # [N, V] processed logits (temperature, top-k/p applied)
    states: torch.Tensor,  # [N] int request state of each row
    local: torch.Tensor,  # [N] int row index within its request
    temperature: torch.Tensor,  # [S] float
    walk_tokens: torch.Tensor,  # [S, B] int64
    parents: torch.Tensor,  # [S, B] int64
    uniforms: torch.Tensor,  # [N] float32 each row's uniform in [0, 1)
) -> torch.Tensor:  # [N] int64
    """Reference of :func:`choose_children` with the rows' uniforms given."""
    x = logits.float()
    states = states.long()
    greedy = temperature[states] == 0
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # [N, 1]
    tokens, is_child = walk_tokens[states], row_children(walk_tokens[states],
                                                         parents[states], local)
    p = torch.where(is_child, torch.exp(x.gather(1, tokens.clamp(min=0)) - lse), 0.0)
    cum = torch.cumsum(p, dim=1)  # [N, B] P_j (constant past the last child)
    hit = is_child & (uniforms.unsqueeze(1) < cum)
    first = torch.where(hit, torch.arange(hit.shape[1], device=x.device), hit.shape[1])
    j = first.min(dim=1).values  # [N] the first child whose P_j exceeds u
    found = j < hit.shape[1]
    chosen = torch.where(found, tokens.gather(1, j.clamp(max=hit.shape[1] - 1)
                                              .unsqueeze(1)).squeeze(1), NO_CHILD)
    return torch.where(greedy, x.argmax(dim=-1), chosen)


if HAS_TRITON:
    NO_CHILD_TL = tl.constexpr(NO_CHILD)

    @triton.jit
    def _row_stats_kernel(X, s_x, IDX, TEMP, M, S, A, V, CHUNK: tl.constexpr):
        # stage 1: one (row, chunk) in one load: a greedy row's max and argmax (lowest id
        # on ties), a sampled row's max and sum of exp(x - max)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(X + row * s_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        out = row * tl.num_programs(1) + c
        if tl.load(TEMP + tl.load(IDX + row)) == 0.0:
            m, a = tl.max(x, axis=0, return_indices=True)
            tl.store(A + out, c * CHUNK + a.to(tl.int64))
        else:
            m = tl.max(x, axis=0)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            tl.store(S + out, tl.sum(tl.exp(x - m_safe), axis=0))
        tl.store(M + out, m)

    @triton.jit
    def _row_children(WTOK, PAR, state, s_wt, s_par, local, BUDGET: tl.constexpr,
                      BLOCK_B: tl.constexpr):
        # the tree nodes of request state ``state`` (in node order), their tokens, and
        # which are children of verify row ``local`` (row_children's rule)
        j = tl.arange(0, BLOCK_B)
        j_ok = j < BUDGET
        tok = tl.load(WTOK + state * s_wt + j, mask=j_ok, other=-1)
        par = tl.load(PAR + state * s_par + j, mask=j_ok, other=-1)
        return j, tok, j_ok & (par == local) & (tok >= 0)

    @triton.jit
    def _choose_kernel(X, s_x, M, S, A, IDX, LOC, POS, TEMP, SEEDS, WTOK, PAR, U, OUT,
                       s_wt, s_par, V, NUM_CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr,
                       BUDGET: tl.constexpr, BLOCK_B: tl.constexpr, HAS_U: tl.constexpr):
        # stage 2: one row: combine the chunks, then take the argmax or choose a child
        row = tl.program_id(0).to(tl.int64)
        state = tl.load(IDX + row).to(tl.int64)
        cs = tl.arange(0, BLOCK_C)
        c_ok = cs < NUM_CHUNKS
        m = tl.load(M + row * NUM_CHUNKS + cs, mask=c_ok, other=float("-inf"))
        s = tl.load(S + row * NUM_CHUNKS + cs, mask=c_ok, other=0.0)
        a = tl.load(A + row * NUM_CHUNKS + cs, mask=c_ok, other=0)
        m_max = tl.max(m, axis=0)
        if tl.load(TEMP + state) == 0.0:
            # the first chunk holding the max: lowest id on ties
            best = tl.min(tl.where(m == m_max, cs, BLOCK_C), axis=0)
            tl.store(OUT + row, tl.sum(tl.where(cs == best, a, 0), axis=0))
            return
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        lse = m_safe + tl.log(tl.sum(s * tl.exp(m - m_safe), axis=0))
        local = tl.load(LOC + row).to(tl.int64)
        j, tok, child = _row_children(WTOK, PAR, state, s_wt, s_par, local, BUDGET, BLOCK_B)
        x = tl.load(X + row * s_x + tl.where(child, tok, 0), mask=child,
                    other=float("-inf")).to(tl.float32)
        p = tl.where(child, tl.exp(x - lse), 0.0)
        cum = tl.cumsum(p, axis=0)
        if HAS_U:
            u = tl.load(U + row)
        else:
            seed = tl.load(SEEDS + state)
            pos = tl.load(POS + row)
            u = tl.rand(tl.randint(seed, pos), V)  # counter V: apart from the noise
        first = tl.min(tl.where(child & (u < cum), j, BLOCK_B), axis=0)
        chosen = tl.sum(tl.where(j == first, tok, 0), axis=0)
        tl.store(OUT + row, tl.where(first < BLOCK_B, chosen, NO_CHILD_TL))

    @triton.jit
    def _stop_row(PATH, s_path, NACC, CU, CHOICES, r):
        # the verify row a request's walk stopped at (local and in the logits), the
        # path slot of its emitted token, and whether that token is a stop draw
        last = tl.load(NACC + r) - 1
        stop_local = tl.load(PATH + r * s_path + last)
        stop_row = tl.load(CU + r).to(tl.int64) + stop_local
        return stop_local, stop_row, last, tl.load(CHOICES + stop_row) == NO_CHILD_TL

    @triton.jit
    def _stop_noise_kernel(X, s_x, PATH, s_path, NACC, CU, IDX, POS, SEEDS, CHOICES, WTOK,
                           PAR, G, s_g, M, A, s_wt, s_par, V, NUM_CHUNKS: tl.constexpr,
                           CHUNK: tl.constexpr, BUDGET: tl.constexpr, HAS_G: tl.constexpr):
        # stage 1: one (request, chunk) of a stop draw: the chunk's best logit + Gumbel
        # noise (children at -inf) and its token (lowest id on ties)
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        stop_local, stop_row, _, need = _stop_row(PATH, s_path, NACC, CU, CHOICES, r)
        if not need:
            return
        state = tl.load(IDX + r).to(tl.int64)
        start = c * CHUNK
        offs = start + tl.arange(0, CHUNK)
        ok = offs < V
        x = tl.load(X + stop_row * s_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
        if HAS_G:
            noise = tl.load(G + r * s_g + offs, mask=ok, other=0.0)
        else:
            seed = tl.load(SEEDS + state)
            key = tl.randint(seed, tl.load(POS + stop_row))
            u = tl.rand(key, offs)  # counters 0..V-1: apart from the choice's u
            noise = -tl.log(-tl.log(u))
        g = x + noise
        # the stop row's children that fall in this chunk -> -inf (a scalar loop over the
        # nodes: a [CHUNK, nodes] compare would not fit in registers)
        for j in range(BUDGET):
            t = tl.load(WTOK + state * s_wt + j)
            mine = tl.load(PAR + state * s_par + j) == stop_local
            if mine & (t >= start) & (t < start + CHUNK):
                g = tl.where(offs == t, float("-inf"), g)
        m, a = tl.max(g, axis=0, return_indices=True)
        tl.store(M + r * NUM_CHUNKS + c, m)
        tl.store(A + r * NUM_CHUNKS + c, c * CHUNK + a.to(tl.int64))

    @triton.jit
    def _stop_emit_kernel(SAMPLED, s_sampled, PATH, s_path, NACC, CU, IDX, CHOICES, WTOK,
                          PAR, M, A, s_wt, s_par, NUM_CHUNKS: tl.constexpr,
                          BLOCK_C: tl.constexpr, BUDGET: tl.constexpr,
                          BLOCK_B: tl.constexpr):
        # stage 2: one request: the best chunk's token (the first on ties) becomes the
        # emitted token of a walk that stopped on NO_CHILD; where every other token is
        # -inf (the children hold all the mass, the uniform fell in their sum's rounding
        # gap) the last child is
        r = tl.program_id(0).to(tl.int64)
        stop_local, _, last, need = _stop_row(PATH, s_path, NACC, CU, CHOICES, r)
        if need:
            cs = tl.arange(0, BLOCK_C)
            c_ok = cs < NUM_CHUNKS
            m = tl.load(M + r * NUM_CHUNKS + cs, mask=c_ok, other=float("-inf"))
            a = tl.load(A + r * NUM_CHUNKS + cs, mask=c_ok, other=0)
            m_max = tl.max(m, axis=0)
            best = tl.min(tl.where(m == m_max, cs, BLOCK_C), axis=0)
            drawn = tl.sum(tl.where(cs == best, a, 0), axis=0)
            state = tl.load(IDX + r).to(tl.int64)
            j, tok, child = _row_children(WTOK, PAR, state, s_wt, s_par, stop_local, BUDGET,
                                          BLOCK_B)
            last_child = tl.max(tl.where(child, j, -1), axis=0)
            fallback = tl.sum(tl.where(j == last_child, tok, 0), axis=0)
            tl.store(SAMPLED + r * s_sampled + last,
                     tl.where(m_max == float("-inf"), fallback, drawn))


def choose_children(
    logits: torch.Tensor,  # [N, V] processed logits (temperature, top-k/p applied)
    states: torch.Tensor,  # [N] int32 request state of each row (expanded_idx_mapping)
    local: torch.Tensor,  # [N] int32 row index within its request (expanded_local_pos)
    positions: torch.Tensor,  # [N] int64 each row's position (the noise key)
    temperature: torch.Tensor,  # [S] float32 by request state
    seeds: torch.Tensor,  # [S] int64 by request state
    walk_tokens: torch.Tensor,  # [S, B] int64 node tokens by state (-1: never accepted)
    parents: torch.Tensor,  # [S, B] int64 node parents (verify rows) by state
    uniforms: torch.Tensor | None = None,  # [N] float32; None: keyed draws (module doc)
) -> torch.Tensor:  # [N] int64 the argmax, a child's token, or NO_CHILD
    """Each row's choice (module docstring), no host sync.  Off the GPU the torch
    reference runs, which needs ``uniforms``."""
    if use_triton(logits):
        return choose_children_triton(logits, states, local, positions, temperature, seeds,
                                      walk_tokens, parents, uniforms)
    if uniforms is None:
        raise ValueError("choose_children: the torch reference needs uniforms")
    return choose_children_torch(logits, states, local, temperature, walk_tokens, parents,
                                 uniforms)


def choose_children_triton(
    logits: torch.Tensor,  # [N, V] processed logits (temperature, top-k/p applied)
    states: torch.Tensor,  # [N] int32 request state of each row (expanded_idx_mapping)
    local: torch.Tensor,  # [N] int32 row index within its request (expanded_local_pos)
    positions: torch.Tensor,  # [N] int64 each row's position (the noise key)
    temperature: torch.Tensor,  # [S] float32 by request state
    seeds: torch.Tensor,  # [S] int64 by request state
    walk_tokens: torch.Tensor,  # [S, B] int64 node tokens by state (-1: never accepted)
    parents: torch.Tensor,  # [S, B] int64 node parents (verify rows) by state
    uniforms: torch.Tensor | None = None,  # [N] float32; None: keyed draws (module doc)
) -> torch.Tensor:  # [N] int64
    """The Triton launcher of :func:`choose_children`: two launches."""
    N, V = logits.shape
    out = torch.empty(N, dtype=torch.int64, device=logits.device)
    if N == 0:
        return out
    assert logits.stride(1) == 1
    chunks = triton.cdiv(V, _CHUNK)
    m = torch.empty((N, chunks), dtype=torch.float32, device=logits.device)
    s = torch.empty_like(m)  # sampled rows only
    a = torch.empty((N, chunks), dtype=torch.int64, device=logits.device)  # greedy rows only
    _row_stats_kernel[(N, chunks)](logits, logits.stride(0), states, temperature, m, s, a,
                                   V, CHUNK=_CHUNK, num_warps=8)
    budget = walk_tokens.shape[1]
    _choose_kernel[(N,)](
        logits, logits.stride(0), m, s, a, states, local, positions, temperature, seeds,
        walk_tokens, parents, uniforms if uniforms is not None else m, out,
        walk_tokens.stride(0), parents.stride(0), V, NUM_CHUNKS=chunks,
        BLOCK_C=next_pow2(chunks), BUDGET=budget, BLOCK_B=next_pow2(budget),
        HAS_U=uniforms is not None, num_warps=4)
    return out


def draw_stop_tokens(
    processed: torch.Tensor,  # [N, V] the rows' processed logits
    choices: torch.Tensor,  # [N] int64 choose_children's result
    sampled: torch.Tensor,  # [R, 1 + B] int64 the walk's tokens, updated in place
    path: torch.Tensor,  # [R, D + 1] int64 accepted verify rows
    num_accepted: torch.Tensor,  # [R] int64 (root included)
    cu_num_logits: torch.Tensor,  # [R + 1] int32
    idx_mapping: torch.Tensor,  # [R] int32 batch row -> request state
    positions: torch.Tensor,  # [N] int64 each row's position (the noise key)
    walk_tokens: torch.Tensor,  # [S, B] int64
    parents: torch.Tensor,  # [S, B] int64
    seeds: torch.Tensor,  # [S] int64 by request state
    gumbel: torch.Tensor | None = None,  # [R, V] float32; None: keyed noise (module doc)
) -> None:
    """Where a walk stopped on :data:`NO_CHILD`, its emitted token (``sampled[r,
    num_accepted - 1]``) becomes a draw from the stop row's distribution without that
    row's children: the Gumbel-max over the row's logits, children at ``-inf``.  One
    full-vocabulary draw per request, no host sync: on the GPU two launches.  Off the
    GPU the torch reference runs, which needs ``gumbel``."""
    if idx_mapping.shape[0] == 0:
        return
    args = (processed, choices, sampled, path, num_accepted, cu_num_logits, idx_mapping)
    if use_triton(processed):
        draw_stop_tokens_triton(*args, positions, walk_tokens, parents, seeds, gumbel)
        return
    if gumbel is None:
        raise ValueError("draw_stop_tokens: the torch reference needs gumbel")
    draw_stop_tokens_torch(*args, walk_tokens, parents, gumbel)


def draw_stop_tokens_torch(
    processed: torch.Tensor,  # [N, V] the rows' processed logits
    choices: torch.Tensor,  # [N] int64 choose_children's result
    sampled: torch.Tensor,  # [R, 1 + B] int64 the walk's tokens, updated in place
    path: torch.Tensor,  # [R, D + 1] int64 accepted verify rows
    num_accepted: torch.Tensor,  # [R] int64 (root included)
    cu_num_logits: torch.Tensor,  # [R + 1] int32
    idx_mapping: torch.Tensor,  # [R] int32 batch row -> request state
    walk_tokens: torch.Tensor,  # [S, B] int64
    parents: torch.Tensor,  # [S, B] int64
    gumbel: torch.Tensor,  # [R, V] float32 each stop draw's noise
) -> None:
    """Reference of :func:`draw_stop_tokens` with the noise given."""
    R = idx_mapping.shape[0]
    last = (num_accepted - 1).unsqueeze(1)  # [R, 1]
    stop_local = path.gather(1, last)  # [R, 1] verify row the walk stopped at
    stop_row = cu_num_logits[:R].long() + stop_local.squeeze(1)  # [R]
    states = idx_mapping.long()
    rows = processed.index_select(0, stop_row).float() + gumbel  # [R, V]
    V = rows.shape[1]
    # the stop row's children -> -inf (non-children scatter into a spare column)
    children = row_children(walk_tokens[states], parents[states], stop_local.squeeze(1))
    cols = torch.where(children, walk_tokens[states], V)  # [R, B]
    masked = torch.cat([rows, rows.new_empty(R, 1)], dim=1)
    masked.scatter_(1, cols, float("-inf"))
    drawn = masked[:, :V].argmax(dim=-1)  # the first on ties
    # every other token -inf: the last child (the kernel's rule)
    node = torch.arange(children.shape[1], device=rows.device)
    last_child = torch.where(children, node, -1).max(dim=1).values.clamp(min=0)
    fallback = walk_tokens[states].gather(1, last_child.unsqueeze(1)).squeeze(1)
    fallback = torch.where(children.any(dim=1), fallback, 0)
    drawn = torch.where(torch.isneginf(masked[:, :V]).all(dim=1), fallback, drawn)
    emitted = sampled.gather(1, last).squeeze(1)
    need = choices.index_select(0, stop_row) == NO_CHILD
    sampled.scatter_(1, last, torch.where(need, drawn, emitted).unsqueeze(1))


def draw_stop_tokens_triton(
    processed: torch.Tensor,  # [N, V] the rows' processed logits
    choices: torch.Tensor,  # [N] int64 choose_children's result
    sampled: torch.Tensor,  # [R, 1 + B] int64 the walk's tokens, updated in place
    path: torch.Tensor,  # [R, D + 1] int64 accepted verify rows
    num_accepted: torch.Tensor,  # [R] int64 (root included)
    cu_num_logits: torch.Tensor,  # [R + 1] int32
    idx_mapping: torch.Tensor,  # [R] int32 batch row -> request state
    positions: torch.Tensor,  # [N] int64 each row's position (the noise key)
    walk_tokens: torch.Tensor,  # [S, B] int64
    parents: torch.Tensor,  # [S, B] int64
    seeds: torch.Tensor,  # [S] int64 by request state
    gumbel: torch.Tensor | None = None,  # [R, V] float32; None: keyed noise
) -> None:
    """The Triton launcher of :func:`draw_stop_tokens`: two launches (each chunk's best,
    then each request's)."""
    R, V = idx_mapping.shape[0], processed.shape[1]
    assert processed.stride(1) == 1 and sampled.stride(1) == 1 and path.stride(1) == 1
    dev = processed.device
    chunks = triton.cdiv(V, _CHUNK)
    m = torch.empty((R, chunks), dtype=torch.float32, device=dev)
    a = torch.empty((R, chunks), dtype=torch.int64, device=dev)
    g = gumbel if gumbel is not None else m  # not read without HAS_G
    _stop_noise_kernel[(R, chunks)](
        processed, processed.stride(0), path, path.stride(0), num_accepted, cu_num_logits,
        idx_mapping, positions, seeds, choices, walk_tokens, parents, g, g.stride(0), m, a,
        walk_tokens.stride(0), parents.stride(0), V, NUM_CHUNKS=chunks, CHUNK=_CHUNK,
        BUDGET=walk_tokens.shape[1], HAS_G=gumbel is not None, num_warps=8)
    _stop_emit_kernel[(R,)](
        sampled, sampled.stride(0), path, path.stride(0), num_accepted, cu_num_logits,
        idx_mapping, choices, walk_tokens, parents, m, a, walk_tokens.stride(0),
        parents.stride(0), NUM_CHUNKS=chunks, BLOCK_C=next_pow2(chunks),
        BUDGET=walk_tokens.shape[1], BLOCK_B=next_pow2(walk_tokens.shape[1]), num_warps=1)


def warm_choice_rule(
    logits: torch.Tensor,  # [n >= 1, V] logits as the verifier receives them
    states: torch.Tensor,  # [1] request state of a row, vLLM's dtype (expanded_idx_mapping)
    local: torch.Tensor,  # [1] row index within its request, vLLM's dtype
    idx_mapping: torch.Tensor,  # [1] batch row -> request state, vLLM's dtype
    cu_num_logits: torch.Tensor,  # [2] vLLM's dtype
    positions: torch.Tensor,  # [1] int64 a row's position
    temperature: torch.Tensor,  # [S] float32 the engine's temperatures by request state
    seeds: torch.Tensor,  # [S] int64 the engine's seeds by request state
    walk_tokens: torch.Tensor,  # [S, B] int64 the engine's node tokens by request state
    parents: torch.Tensor,  # [S, B] int64 the engine's node parents by request state
    max_depth: int,
) -> None:
    """Compile the choice rule's kernels before serving, for the dtype and layout of
    ``logits`` and for float32.  vLLM's warm-up samples with processed (float32) logits,
    but a request at temperature 1 without top-k/top-p reaches the verifier with the
    model's own (e.g. bf16) logits, and Triton compiles a kernel per pointer dtype: the
    first such request would otherwise wait for the compilations.  The index tensors
    are vLLM's own (their dtypes are part of what a launch specializes on), the state
    tensors the engine's (read only), the outputs scratch; one request row.  Off the GPU
    nothing is compiled."""
    if not use_triton(logits) or logits.shape[0] == 0:
        return
    dev, budget = logits.device, walk_tokens.shape[1]
    rows = logits[:1]
    for x in {rows.dtype: rows, torch.float32: rows.float()}.values():
        choices = choose_children_triton(x, states, local, positions, temperature, seeds,
                                         walk_tokens, parents)
        sampled = torch.full((1, 1 + budget), -1, dtype=torch.int64, device=dev)
        path = torch.zeros((1, max_depth + 1), dtype=torch.int64, device=dev)
        draw_stop_tokens_triton(
            x, choices, sampled, path, torch.ones(1, dtype=torch.int64, device=dev),
            cu_num_logits, idx_mapping, positions, walk_tokens, parents, seeds)
