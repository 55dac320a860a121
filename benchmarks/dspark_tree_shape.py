"""How deep the shipped SmolLM2 DSpark drafter's trees go, and how many parents the
Triton conditioned build computes children for (CPU, plain PyTorch).

    python3 -m benchmarks.dspark_tree_shape [--prompts 8] [--budget 15]

The target (SmolLM2-135M-Instruct, converted by ``vllm_ddtree.demo.smollm``) continues
each of the drafter's first ``--prompts`` held-out prompts greedily; drafter blocks are
then anchored at random positions of the continuation (the trainer's own batches,
``scripts/train_drafter.py``), and each block's base logits and the root token give one
tree.  For every depth this replays the Triton build's rule
(:mod:`vllm_ddtree.tree.conditioned`): from the third depth on a parent gets children
only if its score reaches the ``(B - 1)``-th best score so far, the others' children
score -inf.  Prints, per depth, the mean number of such live parents, the share of
requests with any (the rest do only their chain's row), and the trees' depths.
"""

from __future__ import annotations

import argparse
import json

import torch


def tree_shape(base: torch.Tensor,  # [D, V] float32 one request's base logits
               root: int, head, budget: int) -> tuple[list[int], int]:
    """Live parents per depth (depths 2..D) under the build's rule; the tree's depth."""
    from vllm_ddtree.tree.conditioned import conditioned_candidates_torch, parent_needs

    D = base.shape[0]

    def children(d: int, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [P, budget] each parent's best children: log-probabilities, ids
        lp, tok, _ = conditioned_candidates_torch(base[d:d + 1], parents.view(1, -1),
                                                  head, budget)
        return lp[0], tok[0]

    lp, tok = children(0, torch.tensor([root]))
    scores, tokens = lp[0], tok[0]
    seen = scores.clone()  # every node's score so far
    depth = [torch.ones_like(scores, dtype=torch.long)]
    live_per_depth = []
    for d in range(1, D):
        theta = (seen.topk(budget - 1).values[-1] if d >= 2 and budget > 1
                 else torch.tensor(float("-inf")))
        live = scores >= theta
        live_per_depth.append(int(live.sum()))
        lp, tok = children(d, tokens)
        lp = lp.masked_fill(~live.unsqueeze(1), float("-inf"))
        need = parent_needs(budget, budget, len(tokens))[:-1]
        cand = torch.cat([scores[i] + lp[i, :n] for i, n in enumerate(need)])
        ctok = torch.cat([tok[i, :n] for i, n in enumerate(need)])
        top = cand.topk(min(budget, cand.numel()))
        scores, tokens = top.values, ctok[top.indices]
        seen = torch.cat([seen, scores])
        depth.append(torch.full_like(scores, d + 1, dtype=torch.long))
    best = seen.topk(budget).indices
    return live_per_depth, int(torch.cat(depth)[best].max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--blocks", type=int, default=6, help="drafter blocks per prompt")
    args = ap.parse_args(argv)

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from scripts.train_drafter import BLOCK_SIZE, DSparkDrafter, make_batch
    from vllm_ddtree.demo.smollm import drafter_dir, ensure_smollm
    from vllm_ddtree.tree.conditioned import MarkovHead

    torch.manual_seed(0)
    ddir = drafter_dir("dspark")
    cfg = json.loads((ddir / "config.json").read_text())
    target = AutoModelForCausalLM.from_pretrained(str(ensure_smollm()),
                                                  dtype=torch.float32).eval()
    drafter = DSparkDrafter(cfg)
    drafter.load_state_dict(load_file(str(ddir / "model.safetensors")), strict=False)
    drafter = drafter.float().eval()
    head = MarkovHead(drafter.markov_head.markov_w1.weight.detach(),
                      drafter.markov_head.markov_w2.weight.detach())
    prompts = json.loads((drafter_dir("dflash") / "training_log.json").read_text())
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    mask_id, V = cfg["dflash_config"]["mask_token_id"], cfg["vocab_size"]
    live, depths = [], []
    with torch.no_grad():
        for p in prompts["heldout_eval_prompts"][: args.prompts]:
            seq = target.generate(torch.tensor([p]), max_new_tokens=args.new_tokens,
                                  do_sample=False)[0]
            b = make_batch([seq], [len(p)], args.blocks, mask_id, 0,
                           torch.Generator().manual_seed(1), "cpu", True, 1)
            out = target.model(input_ids=b["ids"], output_hidden_states=True)
            feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)
            h = drafter(feats, target.get_input_embeddings()(b["block_ids"]), b["ctx_pos"],
                        b["blk_pos"], b["mask"])
            base = torch.nn.functional.linear(h, target.get_output_embeddings().weight)
            base = base.view(-1, BLOCK_SIZE, V)
            roots = b["block_ids"].view(-1, BLOCK_SIZE)[:, 0]
            keep = b["valid"].view(-1, BLOCK_SIZE).any(1)
            for blk, root in zip(base[keep], roots[keep]):
                n, depth = tree_shape(blk, int(root), head, args.budget)
                live.append(n)
                depths.append(depth)
    n = torch.tensor(live, dtype=torch.float32)  # [trees, D - 1]
    print(f"{len(live)} trees of budget {args.budget}, drafter {ddir.name}")
    print("| depth | live parents (mean) | trees with a live parent |\n|---|---|---|")
    for d in range(n.shape[1]):
        print(f"| {d + 2} | {n[:, d].mean():.2f} | {(n[:, d] > 0).float().mean():.2f} |")
    print(f"parents with children per tree: {n.sum(1).mean():.1f} of "
          f"{args.budget * n.shape[1]}; depths with any: {(n > 0).sum(1).float().mean():.1f} "
          f"of {n.shape[1]}; tree depth: mean {sum(depths) / len(depths):.1f}, "
          f"max {max(depths)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
