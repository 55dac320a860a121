"""What an engine's DDTree speculator hands to its target side (model state, verifier)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vllm_ddtree.gpu.step_rows import StepRows
from vllm_ddtree.gpu.tree_state import TreeStates
from vllm_ddtree.gpu.walk import Accepted


@dataclass(frozen=True)
class TargetBinding:
    trees: TreeStates  # the speculator's trees, by request state
    rows: StepRows  # the step's verify rows (the tree attention reads them too)
    on_accepted: Callable[[Accepted], None]  # the walk's result, back to the speculator
