"""Runner-independent DDTree core: tree building, walking and verify metadata.

Imports nothing from vLLM.
"""

from .build import DraftTree, build_tree, drop_nonfinite
from .walk import walk_tree
from .layout import TreeLayout, tree_layout, compaction_plan

__all__ = ["DraftTree", "build_tree", "drop_nonfinite", "walk_tree", "TreeLayout", "tree_layout", "compaction_plan"]
