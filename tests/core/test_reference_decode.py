"""The plain-PyTorch oracles: DFlash drafter forward and batch-1 DFlash / DDTree loops."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.testing.fixtures import TOKEN_A, make_tiny_pair
from vllm_ddtree.testing.reference_decode import DFlashDrafterRef, ddtree_generate, dflash_generate

N_NEW = 40


pytestmark = pytest.mark.usefixtures("one_thread")


def _load(root, variant):
    from transformers import AutoModelForCausalLM

    t, d = make_tiny_pair(root, variant)
    target = AutoModelForCausalLM.from_pretrained(t, attn_implementation="eager").eval()
    return target, DFlashDrafterRef.from_pretrained(d)


@pytest.fixture(scope="module")
def random_pair(root):
    return _load(root, "random")


def _prompt(seed, n=12):
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _greedy(target, ids, n):
    """Plain HF greedy with a KV cache (a different code path from the oracles)."""
    out = target(torch.tensor([ids]), use_cache=True)
    toks = [int(out.logits[0, -1].argmax())]
    for _ in range(n - 1):
        out = target(torch.tensor([[toks[-1]]]), past_key_values=out.past_key_values,
                     use_cache=True)
        toks.append(int(out.logits[0, -1].argmax()))
    return toks


@torch.no_grad()
def test_drafter_matches_hf_modules(random_pair):
    """The drafter forward, rebuilt from transformers' own Qwen3 modules."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3DecoderLayer,
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
    )

    target, drafter = random_pair
    cfg = Qwen3Config(**{k: v for k, v in drafter.cfg.items()
                         if k not in ("architectures", "auto_map")})
    cfg._attn_implementation = "eager"
    w = drafter.w
    layers = []
    for i in range(cfg.num_hidden_layers):
        layer = Qwen3DecoderLayer(cfg, i).eval()
        layer.load_state_dict({k[len(f"layers.{i}."):]: v for k, v in w.items()
                               if k.startswith(f"layers.{i}.")})
        layers.append(layer)
    hidden_norm, norm = Qwen3RMSNorm(128, cfg.rms_norm_eps), Qwen3RMSNorm(128, cfg.rms_norm_eps)
    hidden_norm.weight.copy_(w["hidden_norm.weight"])
    norm.weight.copy_(w["norm.weight"])

    ids = _prompt(5, 23)
    out = target(torch.tensor([ids]), output_hidden_states=True)
    feats = drafter.context_features(out.hidden_states)
    assert feats.shape == (23, 3 * 128)
    assert torch.equal(feats[:, 128:256], out.hidden_states[3][0])  # target layer id 2
    n, bs = feats.shape[0], drafter.block_size
    block = torch.tensor([7] + [drafter.mask_token_id] * (bs - 1))
    emb = target.get_input_embeddings()(block)

    ctx = hidden_norm(feats @ w["fc.weight"].T)
    cos_sin = Qwen3RotaryEmbedding(cfg)(emb[None], torch.arange(n + bs)[None])
    x = emb
    for layer in layers:  # K/V over [ctx ; normed block], Q from the block, no mask
        h = layer.input_layernorm(x)
        a = layer.self_attn(torch.cat([ctx, h])[None], cos_sin, None)[0][0, n:]
        x = x + a
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    want = target.lm_head(norm(x)[1:])

    got = drafter.draft_logits(target, feats, 7)
    assert got.shape == (bs - 1, 512)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # context matters (and is not ignored): a shorter context changes the logits
    assert (drafter.draft_logits(target, feats[:-3], 7) - got).abs().max() > 1e-3


@pytest.mark.parametrize("budget", [1, 15, 60])
def test_ddtree_greedy_equals_target_greedy(random_pair, budget):
    target, drafter = random_pair
    for seed in (0, 1):
        ids = _prompt(seed)
        want = _greedy(target, ids, N_NEW)
        assert len(set(want)) >= 8  # the random target's text does not collapse
        toks, acc = ddtree_generate(target, drafter, ids, N_NEW, budget)
        assert toks == want
        assert 1 + sum(acc) >= N_NEW and all(1 <= a <= min(15, budget) + 1 for a in acc)
    chain, _ = dflash_generate(target, drafter, ids, N_NEW)
    assert chain == want


RANKS = (0, 0, 1, 0, 2, 0, 1)  # rank of the true token at position p: RANKS[p % 7]


class _NoisyOracle(DFlashDrafterRef):
    """Drafts three tokens per depth (logits 0, -0.7, -1.4, the rest ~-30): the target's
    true greedy token at rank ``RANKS[position % 7]`` and two decoys from the real drafter,
    so accepted paths run deep and through non-top-1 branches.
    Also checks that every context it receives equals plain causal target features."""

    def __init__(self, base, target, ids, greedy):
        self.__dict__.update(base.__dict__)
        self.target, self.full = target, list(ids) + list(greedy)
        self.max_ctx_err = 0.0

    @torch.no_grad()
    def draft_logits(self, target, context, root_token):
        n = context.shape[0]  # = position of the root
        assert self.full[n] == root_token
        ref = self.context_features(self.target(torch.tensor([self.full[:n]]),
                                                output_hidden_states=True).hidden_states)
        self.max_ctx_err = max(self.max_ctx_err, (ref - context).abs().max().item())
        real = super().draft_logits(target, context, root_token)
        logits = -30.0 + 0.01 * real  # the real drafter only orders the far tail
        for k in range(logits.shape[0]):
            p = n + 1 + k
            true = self.full[p] if p < len(self.full) else -1
            decoys = [int(t) for t in real[k].argsort(descending=True)[:3] if t != true][:2]
            ranked = decoys[:]
            if true >= 0:
                ranked.insert(RANKS[p % len(RANKS)], true)
            for v, t in zip((0.0, -0.7, -1.4), ranked):
                logits[k, t] = v
        return logits


def test_ddtree_deep_branching_paths(random_pair):
    target, drafter = random_pair
    ids = _prompt(3)
    want = _greedy(target, ids, N_NEW + 16)
    oracle = _NoisyOracle(drafter, target, ids, want)
    toks, acc = ddtree_generate(target, oracle, ids, N_NEW, 60)
    assert toks == want[:N_NEW]
    assert max(acc) >= 4 and sum(acc) / len(acc) >= 2.5, acc
    assert oracle.max_ctx_err < 1e-4
    # the chain only follows top-1 drafts, so it cannot get past a rank-1/2 depth
    chain, chain_acc = dflash_generate(target, oracle, ids, N_NEW)
    assert chain == want[:N_NEW] and max(chain_acc) == 3


@pytest.mark.parametrize("budget", [1, 4, 15, 60])
def test_accept_all_accepts_every_draft(root, budget):
    target, drafter = _load(root, "accept_all")
    depth = min(15, budget)
    toks, acc = ddtree_generate(target, drafter, _prompt(4), N_NEW, budget)
    assert toks == [TOKEN_A] * N_NEW
    assert acc == [depth + 1] * len(acc) and 1 + sum(acc) >= N_NEW
    toks, acc = dflash_generate(target, drafter, _prompt(4), N_NEW)
    assert toks == [TOKEN_A] * N_NEW and acc == [16] * len(acc)
    # sampling at T=1 follows the (extremely confident) target as well
    g = torch.Generator().manual_seed(0)
    toks, acc = ddtree_generate(target, drafter, _prompt(4), 20, budget, temperature=1.0,
                                generator=g)
    assert toks == [TOKEN_A] * 20 and acc[0] == depth + 1


def test_tree_beats_chain(root):
    target, drafter = _load(root, "tree_beats_chain")
    ids = _prompt(6)
    toks, acc = dflash_generate(target, drafter, ids, 20)
    assert toks == [TOKEN_A] * 20 and acc == [1] * 19  # no drafted token accepted
    toks, acc = ddtree_generate(target, drafter, ids, 20, 15)  # 15 nodes = the B-chain only
    assert toks == [TOKEN_A] * 20 and acc == [1] * 19
    for budget in (16, 60):
        toks, acc = ddtree_generate(target, drafter, ids, 20, budget)
        assert toks == [TOKEN_A] * 20 and acc and all(a >= 2 for a in acc), (budget, acc)
