"""Tensor parallelism, simulated on CPU: every rank must build the same tree and walk the
same path.

Under TP each rank holds a vocabulary shard of the drafter's and the target's logits;
vLLM all-gathers them before sampling, and every rank then runs the tree build, the walk
and its own KV compaction.  Nothing but the gathered logits feeds the tree, so the trees
agree exactly when the build is deterministic: no atomics, ties broken by index.  This
test runs 2 and 8 real processes with a gloo process group, each with its own shard and
a different intra-op thread count, all-gathers the shards as vLLM does and compares every
rank's tree, walk and compaction plan bit for bit with each other and with a
single-process build.  Exact ties are planted across shard boundaries.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_ddtree.tree import compaction_plan, walk_tree
from vllm_ddtree.tree.build import build_tree_torch

R, D, V, B = 3, 6, 96, 20


def _draft_logits() -> torch.Tensor:
    x = torch.randn(R, D, V, generator=torch.Generator().manual_seed(0)) * 2
    # exact ties across shard boundaries: copy each depth's best column elsewhere
    top = x.argmax(-1, keepdim=True)
    x.scatter_(-1, (top + V // 2) % V, x.gather(-1, top))
    return x


def _target_logits() -> torch.Tensor:
    """``[R, D + 1, V]``: the target's logits at a node of depth d (0 = root) depend on the
    depth only; close to the drafter's, so the walk accepts nodes, not always top-1."""
    noise = torch.randn(R, D + 1, V, generator=torch.Generator().manual_seed(1))
    return torch.cat([_draft_logits(), torch.zeros(R, 1, V)], 1) + 1.5 * noise


def _step(draft: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    tree = build_tree_torch(draft, B)
    depth = torch.cat([torch.zeros(R, 1, dtype=torch.int64), tree.depths], 1)  # [R, 1 + B]
    picks = target.gather(1, depth[..., None].expand(-1, -1, V)).argmax(-1)
    acc, num, bonus = walk_tree(tree, picks)
    plan = compaction_plan(acc, num)
    return {"tokens": tree.token_ids, "parents": tree.parents, "scores": tree.scores,
            "accepted": acc, "num": num, "bonus": bonus, "src": plan.src_rows,
            "moves": plan.moves}


def _gathered(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    shard = full.chunk(world, dim=-1)[rank].contiguous()
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard)
    return torch.cat(parts, dim=-1)


def _rank(rank: int, world: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1 + rank % 2)
    draft = _gathered(_draft_logits(), rank, world)
    target = _gathered(_target_logits(), rank, world)
    torch.save(_step(draft, target), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _differences(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("world", [2, 8])
def test_every_rank_builds_the_same_tree(world: int, tmp_path: Path) -> None:
    mp.spawn(_rank, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world)
    ref = _step(_draft_logits(), _target_logits())
    assert int(ref["num"].sum()) > 2 * R  # the walk accepts nodes: the comparison covers it
    for r in range(world):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert not _differences(got, ref), f"rank {r} differs in {_differences(got, ref)}"


def test_the_comparison_detects_a_diverged_rank() -> None:
    """A rank whose gathered logits differ in one tied entry by one ulp builds another
    tree: the check above would report it."""
    draft = _draft_logits()
    bumped = draft.clone()
    top = draft[0, 0].argmax()
    bumped[0, 0, top] = torch.nextafter(bumped[0, 0, top], torch.tensor(-1e9))
    a, b = _step(draft, _target_logits()), _step(bumped, _target_logits())
    assert "tokens" in _differences(a, b)
