"""Runner-independent DDTree core: tree building, walking and verify metadata.

Imports nothing from vLLM.
"""

from .build import DraftTree, build_tree, drop_nonfinite, nonfinite_requests
from .conditioned import build_conditioned_tree
from .layout import CompactionPlan, TreeLayout, compaction_plan, tree_layout
from .walk import walk_tree

__all__ = [
    # drafting: the best-first trees of a batch
    "DraftTree",
    "build_tree",
    "drop_nonfinite",
    "nonfinite_requests",
    # drafters whose children depend on their parent (a DSpark Markov head)
    "build_conditioned_tree",
    # verifying: the walk along the target's tokens
    "walk_tree",
    # verify-pass metadata and the KV compaction it implies
    "TreeLayout",
    "tree_layout",
    "CompactionPlan",
    "compaction_plan",
]
