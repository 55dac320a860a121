"""Runner-independent DDTree core: tree building, walking and verify metadata.

Imports nothing from vLLM.
"""

from .build import DraftTree, build_tree, drop_nonfinite
from .layout import CompactionPlan, TreeLayout, compaction_plan, tree_layout
from .walk import walk_tree

__all__ = [
    # drafting: the best-first trees of a batch
    "DraftTree",
    "build_tree",
    "drop_nonfinite",
    # verifying: the walk along the target's tokens
    "walk_tree",
    # verify-pass metadata and the KV compaction it implies
    "TreeLayout",
    "tree_layout",
    "CompactionPlan",
    "compaction_plan",
]
