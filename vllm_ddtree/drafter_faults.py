"""What both runner paths do when the drafter returns NaN/inf logits: the request's tree
is emptied (the step commits the target's bonus token only) and the count is logged at
each new power of two, so a failing drafter is visible without flooding the log."""

from __future__ import annotations

from vllm_ddtree.logger import init_logger

logger = init_logger(__name__)


class NonfiniteDraftLog:
    """Counts request-steps whose draft logits held NaN/inf; one per proposer."""

    def __init__(self) -> None:
        self.logged = 0  # the count at the last warning

    def report(self, seen: int) -> None:
        """``seen``: the total so far.  Warns when it reaches a new power of two."""
        if seen.bit_length() > self.logged.bit_length():
            logger.warning(
                "vllm-ddtree: the drafter returned NaN/inf logits for %d request-step(s) "
                "so far; those steps commit the target's bonus token only (output "
                "unaffected).", seen)
            self.logged = seen
