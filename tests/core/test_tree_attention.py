"""Tree attention: reference = causal attention over each node's root path; the Triton
kernel (TRITON_INTERPRET=1 on CPU) = the reference; prefix/tree split + merge = whole."""


import pytest
import torch

from vllm_ddtree.kernels.tree_attention import (
    merge_attn_states,
    tree_attention_torch,
    tree_attention_triton,
)
from vllm_ddtree.tree import build_tree, tree_layout


def _case(seed, R=3, Hq=4, Hkv=2, hd=64, budget=20, D=5, dtype=torch.float32, bs=16):
    g = torch.Generator().manual_seed(seed)
    tree = build_tree(torch.randn(R, D, 11, generator=g), budget)
    lay = tree_layout(tree, torch.zeros(R, dtype=torch.long))
    n = budget + 1
    prefix = torch.randint(0, 40, (R,), generator=g)
    per_req_blocks = (int(prefix.max()) + n + bs - 1) // bs
    nblocks = R * per_req_blocks + 3
    perm = torch.randperm(nblocks, generator=g)[: R * per_req_blocks]
    block_table = perm.view(R, per_req_blocks).to(torch.int32)
    k = torch.randn(nblocks, bs, Hkv, hd, generator=g).to(dtype)
    v = torch.randn(nblocks, bs, Hkv, hd, generator=g).to(dtype)
    q = torch.randn(R * n, Hq, hd, generator=g).to(dtype)
    qs = torch.arange(R + 1, dtype=torch.int32) * n
    anc = lay.ancestor_bits.reshape(R * n, -1).contiguous()
    return dict(q=q, k_cache=k, v_cache=v, block_table=block_table, query_start=qs,
                prefix_lens=prefix.to(torch.int32), ancestor_bits=anc), lay, tree


def test_reference_equals_root_path_causal_attention():
    args, lay, tree = _case(0)
    out, lse = tree_attention_torch(**args)
    q, kc, vc, bt = args["q"], args["k_cache"], args["v_cache"], args["block_table"]
    R, n = bt.shape[0], lay.positions.shape[1]
    for r in range(R):
        p = int(args["prefix_lens"][r])
        par = [-1] + tree.parents[r].tolist()
        for row in range(int(tree.num_nodes[r]) + 1):
            path = []
            a = row
            while a >= 0:
                path.append(a)
                a = par[a] if a > 0 else -1
            idx = list(range(p)) + [p + x for x in sorted(path)]
            pos = torch.tensor(idx)
            blocks = bt[r].long()[pos // 16]
            k = kc[blocks, pos % 16].repeat_interleave(2, 1)  # [L, Hq, hd]
            v = vc[blocks, pos % 16].repeat_interleave(2, 1)
            qq = q[r * n + row].unsqueeze(1)  # [Hq, 1, hd]
            ref = torch.nn.functional.scaled_dot_product_attention(
                qq, k.transpose(0, 1), v.transpose(0, 1))
            torch.testing.assert_close(out[r * n + row], ref.squeeze(1), atol=1e-5, rtol=1e-5)


def test_merge_of_prefix_and_tree_parts():
    args, _, _ = _case(1)
    full, lse = tree_attention_torch(**args)
    tree_part, lse_t = tree_attention_torch(**args, include_prefix=False)
    # prefix part: everything but the tree (a mask of no tree bits, prefix on)
    pre_args = dict(args, ancestor_bits=torch.zeros_like(args["ancestor_bits"]))
    pre, lse_p = tree_attention_torch(**pre_args)
    merged, lse_m = merge_attn_states(pre, lse_p, tree_part, lse_t)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_m, lse, atol=1e-5, rtol=1e-5)




@pytest.mark.triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-3),
                                       (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hd,Hq,Hkv", [(64, 4, 2), (128, 2, 1)])
@pytest.mark.parametrize("include_prefix", [True, False])
def test_triton_matches_reference(dtype, tol, hd, Hq, Hkv, include_prefix):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args, _, _ = _case(2, Hq=Hq, Hkv=Hkv, hd=hd, dtype=dtype, budget=24)
    args = {k: v.to(dev) for k, v in args.items()}
    out, lse = tree_attention_triton(**args, include_prefix=include_prefix, max_rows=25)
    ref, ref_lse = tree_attention_torch(**args, include_prefix=include_prefix)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logsumexp_sanitize_kernel(dtype):
    from vllm_ddtree.kernels.logsumexp import logsumexp_sanitize_triton
    from vllm_ddtree.tree.build import sanitized_logits

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 5000, generator=g) * 4).to(dtype)
    x[1, 7] = float("nan")
    x[2, :] = float("nan")
    x[3, 11] = float("inf")
    x[4, :] = float("-inf")
    x = x.to(dev)
    ref = torch.logsumexp(sanitized_logits(x), dim=-1)
    got = logsumexp_sanitize_triton(x.clone())
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
    y = x.clone()
    logsumexp_sanitize_triton(y, sanitize_inplace=True)
    assert not torch.isnan(y).any() and not torch.isposinf(y).any()
    assert torch.equal(y[0], x[0])  # clean rows untouched


# The dtype enters the kernels only where they load the logits (to float32 at once) and
# in the value +inf becomes (the dtype's largest finite value); after the load, where k
# picks the paths, everything is float32 whatever the dtype.  Both dtypes run every k of
# both variants up to 16; the pruned k = 33 and 64 (the slowest under the interpreter)
# run in float32 here and in bfloat16 in test_chunked_topk_lse_reduction_paths.
_TOPK_CASES = ([(dtype, k, prune) for k, prune in [(1, False), (5, False), (16, False),
                                                   (1, True), (5, True), (16, True)]
                for dtype in (torch.float32, torch.bfloat16)]
               + [(torch.float32, 33, True), (torch.float32, 64, True)])
_DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.triton
@pytest.mark.parametrize("dtype,k,prune", _TOPK_CASES,
                         ids=lambda v: str(v).removeprefix("torch.") if v in _DTYPES else None)
def test_chunked_topk_lse_kernel(dtype, k, prune):
    """Both variants against a stable sort, with values or log-probabilities and the
    non-finite flags.  Pruned, V = 9000 leaves >= k chunks (the bound is used) for
    k <= 33; k = 64 runs at V = 1832, which leaves fewer than k chunks (no bound), as
    9000 does, in 8 chunks instead of 36 (:func:`_topk_vocab`)."""
    _check_topk_lse(dtype, k, prune, None)


@pytest.mark.triton
@pytest.mark.parametrize("k,prune", [(5, True), (16, False), (33, True), (64, True)])
def test_chunked_topk_lse_reduction_paths(k, prune):
    """The bound by ``k - 1`` max-reductions and the merge by ``k`` of them (no sort),
    under other warps, give the same tokens and values as the stable sort.  (The
    default settings sort; at k = 33 their merge takes both paths: rows of random
    values sort their few live keys, the heavy-tie rows fill every slot and reduce.)"""
    from vllm_ddtree.kernels.topk_lse import TopkTuning

    _check_topk_lse(torch.bfloat16, k, prune, TopkTuning(4, 2, 8, 2, False, 0))


def _topk_vocab(k: int) -> int:
    """The test's vocabulary: 9000 up to k = 33 (above 32 x 256, so the pruned variant's
    smallest chunks, 256 entries, leave >= 33 of them: the bound is used); for k = 64,
    where the point is fewer chunks than k, 1832 = 7 x 256 + 40: 8 chunks rather than 36
    (each runs k reductions: ~30 s a test at 9000 under the interpreter), the last again
    of 40 entries, fewer than k."""
    return 9000 if k <= 33 else 1832


def _check_topk_lse(dtype, k, prune, tuning):
    from vllm_ddtree.kernels.topk_lse import _prune_chunk, topk_lse_triton
    from vllm_ddtree.tree.build import sanitized_logits

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    V = _topk_vocab(k)
    g = torch.Generator().manual_seed(k)
    x = torch.randint(0, 4, (6, V), generator=g).to(dtype)  # heavy ties
    x[1, 17] = float("nan")
    x[2, :] = float("-inf")
    x[2, V - 1] = 1.0
    x[3, V * 4 // 9] = float("inf")
    x[4] = torch.randn(V, generator=g).to(dtype)
    x[5] = float("-inf")  # signed zeros tie: ranked by index, like the stable sort
    x[5, [3, 100, V * 5 // 9, V * 8 // 9]] = torch.tensor([-0.0, 0.0, -0.0, 0.0], dtype=dtype)
    x = x.to(dev)
    if prune:
        chunk = _prune_chunk(V, k)
        assert (-(-V // chunk) >= k) == (k <= 33)
        if -(-V // chunk) > k:  # then row 4 has chunks wholly below the bound (skipped)
            m = sanitized_logits(x[4:5].cpu().float())
            m = torch.nn.functional.pad(m, (0, -V % chunk), value=float("-inf"))
            maxima = m.view(-1, chunk).max(dim=-1).values
            assert (maxima < maxima.topk(k).values[-1]).any()
    args = dict(chunk=None if prune else 1024, pruned=prune, tuning=tuning)
    vals, idx, lse = topk_lse_triton(x, k, **args)
    ref = sanitized_logits(x.cpu())
    rv, ri = torch.sort(ref, dim=-1, descending=True, stable=True)
    assert torch.equal(idx.cpu(), ri[:, :k])
    assert torch.equal(vals.cpu(), rv[:, :k])
    torch.testing.assert_close(lse.cpu(), torch.logsumexp(ref, -1), atol=1e-4, rtol=1e-5)
    lp, idx2, lse2, bad = topk_lse_triton(x, k, **args, logprobs=True, return_nonfinite=True)
    assert torch.equal(idx2, idx) and torch.equal(lse2, lse)
    assert torch.equal(lp, vals - lse.unsqueeze(1))
    assert bad.tolist() == [False, True, True, True, False, True]
    none = torch.full((1, V), float("-inf"), dtype=dtype, device=dev)
    lp, _, lse = topk_lse_triton(none, k, **args, logprobs=True)  # -inf - -inf: -inf, not NaN
    assert lse.item() == float("-inf") and lp.eq(float("-inf")).all()


@pytest.mark.triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_triton_merge_into_prefix_output_and_row_subset(dtype, tol):
    """The GPU backend's two uses: (1) tree keys merged in place into a prefix result
    given as FlashAttention's ``[H, T]`` LSE (+inf/-inf = no prefix keys); (2) a subset of
    requests recomputed in place (``query_end``), other rows untouched."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args, _, _ = _case(3, dtype=dtype, budget=24)
    args["prefix_lens"][1] = 0  # a request with no prefix at all
    args = {k: v.to(dev) for k, v in args.items()}
    full, _ = tree_attention_torch(**args)
    no_tree = torch.zeros_like(args["ancestor_bits"])
    pre, lse_p = tree_attention_torch(**dict(args, ancestor_bits=no_tree))
    lse_hT = lse_p.transpose(0, 1).contiguous()  # FlashAttention's layout
    qs = args["query_start"]
    lse_hT[:, qs[1]:qs[2]] = float("inf")  # FA's "empty" marker for request 1
    out = pre.clone()
    out[qs[1]:qs[2]] = 7.0  # garbage where the prefix is empty: must be ignored
    res, lse = tree_attention_triton(**args, include_prefix=False, max_rows=25, out=out,
                                     prefix_out_lse=lse_hT, return_lse=False)
    assert res is out and lse is None
    torch.testing.assert_close(out.float(), full.float(), atol=tol, rtol=tol)

    # recompute request 2 only, in place
    qe = qs[1:].clone()
    qe[:2] = qs[:2]
    out2 = torch.full_like(full, 3.0)
    tree_attention_triton(**args, max_rows=25, query_end=qe, out=out2, return_lse=False)
    a, b = int(qs[2]), int(qs[3])
    torch.testing.assert_close(out2[a:b].float(), full[a:b].float(), atol=tol, rtol=tol)
    assert torch.all(out2[:a] == 3.0)
    ref_sub, _ = tree_attention_torch(**args, query_end=qe)
    assert torch.all(ref_sub[:a] == 0) and torch.allclose(ref_sub[a:b].float(), full[a:b].float())


def _ragged_case(seed, rows, prefix, budget, Hq, Hkv, hd, dtype, bs=16, pad_rows=3):
    """Requests with ``rows[r]`` verify rows (the first rows of a budget-``budget`` tree)
    after ``prefix[r]`` context tokens, packed back to back, then ``pad_rows`` rows of
    no request; a paged cache of ``bs``-token blocks under a shuffled block table."""
    g = torch.Generator().manual_seed(seed)
    R = len(rows)
    tree = build_tree(torch.randn(R, 5, 11, generator=g), budget)
    lay = tree_layout(tree, torch.zeros(R, dtype=torch.long))
    words = lay.ancestor_bits.shape[-1]
    anc = torch.cat([lay.ancestor_bits[r, :n] for r, n in enumerate(rows)]
                    + [torch.zeros(pad_rows, words, dtype=torch.int32)]).contiguous()
    qs = torch.tensor([0] + rows, dtype=torch.int32).cumsum(0).to(torch.int32)
    per_req_blocks = max(-(-(p + n) // bs) for p, n in zip(prefix, rows))
    nblocks = R * per_req_blocks + 5
    perm = torch.randperm(nblocks, generator=g)[: R * per_req_blocks]
    T = int(qs[-1]) + pad_rows
    return dict(
        q=torch.randn(T, Hq, hd, generator=g).to(dtype),
        k_cache=torch.randn(nblocks, bs, Hkv, hd, generator=g).to(dtype),
        v_cache=torch.randn(nblocks, bs, Hkv, hd, generator=g).to(dtype),
        block_table=perm.view(R, per_req_blocks).to(torch.int32), query_start=qs,
        prefix_lens=torch.tensor(prefix, dtype=torch.int32), ancestor_bits=anc)


# (budget, rows per request, prefix per request): max_rows 16 (budget 15), 64 (budget 63,
# two bit words), 5 (budget 4); ragged row counts, prefixes across and on block edges
_SHAPES = {
    "b15": (15, [16, 9, 1, 16], [37, 0, 16, 5]),
    "b63": (63, [64, 40, 17], [3, 0, 50]),
    "b4": (4, [5, 3, 5], [21, 0, 32]),
}


def _check_rows(got, ref, rows, tol):
    torch.testing.assert_close(got[rows].float(), ref[rows].float(), atol=tol, rtol=tol)


@pytest.mark.triton
@pytest.mark.parametrize("shape", list(_SHAPES))
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2), (8, 2), (8, 1), (6, 2)])  # GROUP 1,2,4,8,3
@pytest.mark.parametrize("mode", ["merge", "prefix", "tree"])
def test_triton_grouped_heads_ragged_requests(shape, Hq, Hkv, mode):
    """All query heads of a KV head in one program, against the reference, for every
    launch mode: ``merge`` (tree keys merged into a prefix result whose ``[H, T]`` LSE
    view has -inf / +inf "no prefix keys" entries; NaN garbage there), ``prefix``
    (``include_prefix`` over a row subset given by ``query_end``), ``tree`` (tree keys
    only, with the LSE)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    budget, rows, prefix = _SHAPES[shape]
    args = _ragged_case(4, rows, prefix, budget, Hq, Hkv, 32, torch.float32)
    args = {k: v.to(dev) for k, v in args.items()}
    qs = args["query_start"].tolist()
    T, max_rows, tol = args["q"].shape[0], budget + 1, 1e-4
    inside = torch.zeros(T, dtype=torch.bool, device=dev)
    inside[: qs[-1]] = True
    if mode == "merge":
        full, _ = tree_attention_torch(**args)
        no_tree = torch.zeros_like(args["ancestor_bits"])
        pre, lse_p = tree_attention_torch(**dict(args, ancestor_bits=no_tree))
        lse_wide = torch.zeros(Hq, T + 7, device=dev)  # a strided [H, T] view
        lse_hT = lse_wide[:, :T]
        lse_hT.copy_(lse_p.transpose(0, 1))
        assert torch.isneginf(lse_hT[:, qs[1]:qs[2]]).all()  # request 1: no prefix
        lse_hT[:, qs[2]:qs[3]] = float("inf")  # FA's "empty" marker, a request with keys
        out = pre.clone()
        out[qs[1]:qs[3]] = float("nan")
        out[qs[-1]:] = 5.0  # rows of no request: untouched
        tree_only, _ = tree_attention_torch(**args, include_prefix=False)
        ref_full = full.clone()
        ref_full[qs[2]:qs[3]] = tree_only[qs[2]:qs[3]]  # +inf: the prefix part is dropped
        tree_attention_triton(**args, include_prefix=False, max_rows=max_rows, out=out,
                              prefix_out_lse=lse_hT, return_lse=False)
        _check_rows(out, ref_full, inside, tol)
        assert torch.all(out[qs[-1]:] == 5.0)
    elif mode == "prefix":
        qe = torch.tensor(qs[1:], dtype=torch.int32)
        qe[0] = qs[0] + rows[0] // 2  # half of request 0
        qe[1] = qs[1]  # none of request 1
        qe = qe.to(dev)
        out = torch.full_like(args["q"], 3.0)
        _, lse = tree_attention_triton(**args, max_rows=max_rows, query_end=qe, out=out)
        ref, ref_lse = tree_attention_torch(**args, query_end=qe)
        sel = torch.zeros(T, dtype=torch.bool, device=dev)
        for a, b in zip(qs[:-1], qe.tolist()):
            sel[a:b] = True
        _check_rows(out, ref, sel, tol)
        _check_rows(lse, ref_lse, sel, 1e-4)
        assert torch.all(out[~sel] == 3.0)
    else:
        out, lse = tree_attention_triton(**args, include_prefix=False, max_rows=max_rows)
        ref, ref_lse = tree_attention_torch(**args, include_prefix=False)
        _check_rows(out, ref, inside, tol)
        _check_rows(lse, ref_lse, inside, 1e-4)


@pytest.mark.triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hd,Hq,Hkv,shape,block_m,block_n,heads", [
    (128, 8, 2, "b15", None, None, None),  # Qwen3-8B's group (4) and head size
    (256, 16, 2, "b15", None, None, None),  # group 8 at head size 256: two row blocks
    (64, 4, 1, "b63", None, None, None),
    (32, 6, 2, "b15", 5, 16, None),  # 5 rows a program (a 15-row tile), 16-key tiles
    (32, 8, 2, "b63", None, 16, None),  # four row blocks, four key tiles
    (128, 8, 2, "b15", None, None, 1),  # one head a program
    (64, 12, 2, "b63", 8, None, 2),  # two of a group of 6: three programs a KV head
])
@pytest.mark.parametrize("include_prefix", [True, False])
def test_triton_tilings(dtype, tol, hd, Hq, Hkv, shape, block_m, block_n, heads,
                        include_prefix):
    """Production head sizes and explicit tilings (rows per program not a power of two,
    several key tiles over the tree, part of a KV head's query heads a program) in both
    key ranges, bf16 and fp32."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    budget, rows, prefix = _SHAPES[shape]
    args = _ragged_case(5, rows, prefix, budget, Hq, Hkv, hd, dtype)
    args = {k: v.to(dev) for k, v in args.items()}
    inside = torch.zeros(args["q"].shape[0], dtype=torch.bool, device=dev)
    inside[: int(args["query_start"][-1])] = True
    out, lse = tree_attention_triton(**args, include_prefix=include_prefix,
                                     max_rows=budget + 1, block_m=block_m, block_n=block_n,
                                     heads=heads)
    ref, ref_lse = tree_attention_torch(**args, include_prefix=include_prefix)
    _check_rows(out, ref, inside, tol)
    _check_rows(lse, ref_lse, inside, 1e-4)


@pytest.mark.parametrize("max_rows", [1, 5, 16, 64, 100])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("hd", [16, 64, 128, 256])
@pytest.mark.parametrize("include_prefix", [True, False])
@pytest.mark.parametrize("num_reqs", [None, 1, 8, 64])
def test_tiling_choice(max_rows, group, hd, include_prefix, num_reqs):
    """The default tiling's invariants; ``heads`` must divide the group; tree keys of a
    small batch (<= 128 verify rows) get 16-row tiles."""
    from vllm_ddtree.kernels.tree_attention import tree_attn_tiling

    block_m, heads, tile_m, block_n, num_warps = tree_attn_tiling(
        max_rows, group, hd, include_prefix, num_reqs=num_reqs)
    assert heads == group
    small = not include_prefix and num_reqs is not None and num_reqs * max_rows <= 128
    if small:
        assert block_m == max(1, min(max_rows, 16 // group))
    elif num_reqs is not None:  # a larger batch: the tiling that ignores the batch
        assert (block_m, heads, tile_m, block_n, num_warps) == tree_attn_tiling(
            max_rows, group, hd, include_prefix)
    assert 1 <= block_m <= max_rows and tile_m >= max(16, block_m * group)
    assert tile_m & (tile_m - 1) == 0 and block_n & (block_n - 1) == 0
    assert tile_m * hd <= 128 * 128 or block_m == 1  # the fp32 accumulator's size
    assert 16 <= block_n <= 64 and num_warps in (4, 8)
    if not include_prefix:  # a tree of <= 16 rows: one program, one key tile per KV head
        assert block_n >= min(max_rows, 64, 8192 // hd)
        if max_rows <= 16 and group * max_rows <= min(128, 16384 // hd) and not small:
            assert block_m == max_rows
    with pytest.raises(ValueError, match="must divide the query group"):
        tree_attn_tiling(max_rows, group, hd, include_prefix, heads=group + 1)


def test_next_pow2():
    """The launch shapes' power-of-two rounding: the smallest power of two >= n (1 for
    n <= 1), as Triton's own helper gives for n >= 1."""
    from vllm_ddtree.kernels.triton_utils import HAS_TRITON, next_pow2, triton

    got = [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 15, 16, 17, 63, 64, 65, 4096, 4097)]
    assert got == [1, 1, 2, 4, 4, 8, 16, 16, 32, 64, 64, 128, 4096, 8192]
    if HAS_TRITON:
        assert all(next_pow2(n) == triton.next_power_of_2(n) for n in range(1, 5000))
