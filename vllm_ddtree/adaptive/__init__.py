"""Tree budget per batch size (``ddtree_adaptive_budget``): the cost model and static
schedules (``schedule``), the online policy on the scheduler (``online``), the drafter's
expectations on the worker (``publisher``) and the channel between them (``channel``)."""
