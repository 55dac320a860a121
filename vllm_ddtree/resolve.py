"""From a user's ``method="ddtree"`` request on vLLM's ``SpeculativeConfig`` to the
validated :class:`~vllm_ddtree.config.DDTreeParams` it carries.

Both vLLM series call the same two steps around vLLM's own set-up of the drafter
config (vLLM 0.34 from :class:`vllm_ddtree.gpu.speculator_config.DDTreeSpeculatorConfig`,
the registered speculative method; vLLM 0.32 from the ``speculative_config`` patch):

1. :func:`check_request`, before vLLM builds the drafter's model config: the options,
   the target and parallel layout, and a local drafter folder, so a bad configuration
   fails before any weights load; returns the drafter family vLLM is to set up.
2. :func:`resolve`, after it: a Hub drafter's config as vLLM fetched it, the depth,
   the adaptive schedule, and the :class:`DDTreeParams` attached to the config.

vLLM objects are read through attributes only; nothing here imports vLLM at module
level.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import vllm_ddtree.config as ddcfg
import vllm_ddtree.drafter as drafter


@dataclass(frozen=True)
class Request:
    """What :func:`check_request` found, handed to :func:`resolve`."""

    budget: int
    max_depth: int | None
    adaptive: bool | str
    dspark: bool  # set vLLM up for a DSpark drafter (else DFlash)
    drafter: drafter.DrafterInfo | None  # a local folder's, else read in :func:`resolve`
    target: ddcfg.TargetInfo


def target_info(model_config: Any, parallel_config: Any) -> ddcfg.TargetInfo:
    """Read what DDTree validation needs from vLLM's target Model/ParallelConfig."""

    def safe(obj: Any, name: str, default: Any) -> Any:
        try:
            value = getattr(obj, name)
            return value() if callable(value) else value
        except Exception:  # a property that cannot be computed for this model
            return default

    if model_config is None:
        raise ddcfg.DDTreeConfigError(
            "speculative_config.target_model_config is missing: build DDTree "
            "configs through EngineArgs / LLM(...) / vllm serve, which set it."
        )
    archs = safe(model_config, "architectures", None) or ["?"]
    return ddcfg.TargetInfo(
        architecture=str(archs[0]),
        vocab_size=safe(model_config, "get_vocab_size", None),
        hidden_size=safe(model_config, "get_hidden_size", None),
        is_hybrid=bool(safe(model_config, "is_hybrid", False)),
        is_attention_free=bool(safe(model_config, "is_attention_free", False)),
        use_mla=bool(safe(model_config, "use_mla", False)),
        pipeline_parallel_size=int(safe(parallel_config, "pipeline_parallel_size", 1)),
        decode_context_parallel_size=int(
            safe(parallel_config, "decode_context_parallel_size", 1)
        ),
        prefill_context_parallel_size=int(
            safe(parallel_config, "prefill_context_parallel_size", 1)
        ),
    )


def check_request(
    spec: Any,  # vLLM's SpeculativeConfig, before its drafter config is built
    max_depth: Any,
    adaptive: Any,
) -> Request:
    """Step 1 (module docstring): the user's options (``max_depth``, ``adaptive``: the
    ``ddtree_*`` values as given), the target, and a local drafter folder."""
    adaptive = ddcfg.check_adaptive(adaptive)
    if adaptive and getattr(spec, "num_speculative_tokens_per_batch_size", None):
        raise ddcfg.DDTreeConfigError(
            f"speculative_config.{ddcfg.ADAPTIVE_FIELD}=true and "
            "num_speculative_tokens_per_batch_size are both set: give one schedule "
            "(the adaptive one is computed from num_speculative_tokens).")
    ddcfg.check_runner_features(spec, spec.target_parallel_config)
    budget = ddcfg.check_num_speculative_tokens(spec.num_speculative_tokens)
    max_depth = ddcfg.check_max_depth(max_depth)
    folder = drafter.load_drafter_config(spec.model)
    target = target_info(spec.target_model_config, spec.target_parallel_config)
    ddcfg.check_target(target)
    ddcfg.check_budget_fits_vocab(budget, target)
    info = None
    if folder is not None:  # local folder: validate before vLLM loads anything
        info = drafter.check_drafter(folder, target, spec.model)
        dspark = info.method == ddcfg.DSPARK_METHOD
    else:  # a Hub id: vLLM's own test for DSpark checkpoints, by name
        dspark = "dspark" in str(spec.model).lower()
    return Request(budget, max_depth, adaptive, dspark, info, target)


def _draft_hf_dict(spec: Any) -> dict[str, Any]:
    """The drafter's HF config as vLLM loaded it (unwrapping ``EAGLEConfig``)."""
    hf_config = spec.draft_model_config.hf_config
    inner = getattr(hf_config, "model", None)
    source = inner if inner is not None and hasattr(inner, "to_dict") else hf_config
    return source.to_dict()


def resolve(spec: Any, request: Request) -> ddcfg.DDTreeParams:
    """Step 2 (module docstring): validate a Hub drafter as vLLM fetched it, resolve
    the depth and the adaptive schedule, and attach the :class:`DDTreeParams`."""
    info = request.drafter
    if info is None:
        info = drafter.check_drafter(_draft_hf_dict(spec), request.target, spec.model)
        if (info.method == ddcfg.DSPARK_METHOD) != request.dspark:
            raise ddcfg.DDTreeConfigError(
                f"speculative_config.model={spec.model!r} is a {info.method} drafter "
                f"but was set up as {'dspark' if request.dspark else 'dflash'}: vLLM tells "
                "DSpark Hub checkpoints by a name holding 'dspark'. Download it and give "
                "the local folder.")
    budget = request.budget
    depth = drafter.resolve_depth(budget, info, request.max_depth)
    adaptive = request.adaptive
    if adaptive:
        from vllm_ddtree.adaptive.schedule import budget_schedule, capture_schedule

        make = capture_schedule if adaptive == ddcfg.ONLINE else budget_schedule
        spec.num_speculative_tokens_per_batch_size = make(budget, depth)
    # Unguessable, and drawn here (not per process): the scheduler and its worker find
    # each other through the copies of this config they receive.
    channel = secrets.token_hex(16) if adaptive == ddcfg.ONLINE else None
    params = ddcfg.DDTreeParams(budget, depth, adaptive, request.dspark, channel)
    ddcfg.attach_params(spec, params)
    _log_enabled(spec, params)
    return params


def _log_enabled(spec: Any, params: ddcfg.DDTreeParams) -> None:
    """One start-up line saying that DDTree is on (vLLM's own config line names the
    drafter plumbing, ``method='dflash'`` or ``'dspark'``)."""
    from vllm_ddtree.logger import init_logger

    schedule = {False: "fixed", True: "adaptive", ddcfg.ONLINE: "adaptive, online"}
    init_logger(__name__).info_once(
        "vllm-ddtree: DDTree speculative decoding on: budget %d (%s), depth %d, "
        "%s drafter %s.", params.budget, schedule[params.adaptive], params.depth,
        "DSpark" if params.dspark else "DFlash", spec.model)
