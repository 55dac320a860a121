"""DDTree configuration: the options, their validation, and the settings a validated
config carries.

Standard library only, no vLLM: both vLLM series' adapters call these checks
(:mod:`vllm_ddtree.resolve` orders them around vLLM's own set-up of the drafter), and a
bad configuration fails before any weights load.  What a drafter checkpoint says about
itself (its ``config.json`` and weights) is read by :mod:`vllm_ddtree.drafter`.

User-facing knobs, all inside ``--speculative-config``:

* ``method: "ddtree"`` selects DDTree.
* ``model``: a DFlash drafter checkpoint (``config.json`` with ``dflash_config``
  and ``block_size``), or on a GPU a DSpark one.
* ``num_speculative_tokens``: the tree budget B (verified nodes per step).
* ``ddtree_max_depth`` (optional): caps the tree depth D.
* ``ddtree_adaptive_budget`` (optional, default false): B becomes the largest budget and
  vLLM's per-batch-size draft count (``num_speculative_tokens_per_batch_size``) is set
  from :mod:`vllm_ddtree.adaptive.schedule`'s cost model (big trees at small batches).
  ``"online"``: the same, then re-tuned while serving from the trees' own expected acceptance
  (:class:`vllm_ddtree.adaptive.online.OnlineSchedule`).

Each option is checked as the user wrote it (:func:`check_raw_options`), before
pydantic's lax coercion could turn ``"4"`` or ``true`` into a depth or ``1`` into a
boolean.  A ``ddtree_*`` key that is no option is refused for every method, and so is an
option given with a method other than ``"ddtree"``.

The depth is ``D = min(block_size - 1, B, ddtree_max_depth)`` (``block_size`` in
place of ``block_size - 1`` for DSpark drafters, whose anchor slot drafts too). After
validation vLLM sees ``method="dflash"`` (``"dspark"``) with ``num_speculative_tokens=B``;
the config carries :class:`DDTreeParams` (``budget``, ``depth``, ...) as an attribute
that users cannot set (:func:`ddtree_params`).

Bounds (refused with a :class:`DDTreeConfigError` naming the field and the limit):

* ``1 <= B <= MAX_BUDGET`` (2047) on both paths.  One request verifies ``1 + B`` rows.
  GPU: the verify-row kernel (``fill_tree_rows``) holds one request's ancestor bits,
  ``(1 + B) x (1 + B) / 32`` words rounded up to powers of two, in one Triton program,
  whose first compilation grows steeply with that size (docs/benchmarks.md,
  "Measurements behind the configuration checks").  The tree build has no limit of its
  own (the one-launch Triton build takes the widths whose sorts fit one program,
  :data:`vllm_ddtree.kernels.tree_build.MAX_SORT`, the torch build any other; its packed
  tie codes need ``width * min(width, vocab) < 2**32``), nor has tree attention (it
  tiles the rows).  CPU: no kernel limit; the same bound keeps a configuration portable
  between the paths (and the CPU path's dense per-request masks grow as
  ``(1 + B)**2``).
* ``B <= vocab_size`` of the target: each depth offers at most ``vocab_size``
  candidates, so a wider tree only adds ever-deeper paths of vanishing probability
  (never binding for real vocabularies, far above :data:`MAX_BUDGET`).
* ``ddtree_max_depth <= block_size - 1`` (``block_size`` for DSpark): the drafter drafts
  at most that many positions per pass; a larger cap is refused rather than clamped, so a
  configuration never asks for a depth it cannot get
  (:func:`vllm_ddtree.drafter.resolve_depth`).  (``ddtree_max_depth`` above ``B`` is a
  cap that does not bind: ``D = B``.)
* At engine start (vLLM builds its scheduler config after this one), one request's
  verify rows must fit the scheduler's per-step token budget:
  :func:`check_verify_fits`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

METHOD = "ddtree"
#: vLLM method the DDTree config is mapped to, by drafter family.
BASE_METHOD = "dflash"
DSPARK_METHOD = "dspark"
BASE_METHODS = (BASE_METHOD, DSPARK_METHOD)

MAX_DEPTH_FIELD = "ddtree_max_depth"
ADAPTIVE_FIELD = "ddtree_adaptive_budget"
ONLINE = "online"  # ddtree_adaptive_budget value of the run-time re-tuned schedule
#: The options a user sets, by their ``--speculative-config`` key.
USER_OPTIONS = (MAX_DEPTH_FIELD, ADAPTIVE_FIELD)

#: Largest tree budget B on every path (module docstring, "Bounds").
MAX_BUDGET = 2047


@dataclass(frozen=True)
class ExtraField:
    """A field vllm-ddtree adds to vLLM's ``SpeculativeConfig``."""

    name: str
    type: Any
    default: Any
    doc: str


#: Fields added to ``SpeculativeConfig`` (defaults keep every other method unchanged).
EXTRA_FIELDS: tuple[ExtraField, ...] = (
    ExtraField(
        MAX_DEPTH_FIELD,
        int | None,
        None,
        "DDTree only: upper bound on the tree depth D (default: block_size - 1), "
        "between 1 and the drafter's block_size - 1 (refused above).",
    ),
    ExtraField(
        ADAPTIVE_FIELD,
        bool | str,
        False,
        "DDTree only: num_speculative_tokens is the largest tree budget and the budget "
        "per batch size comes from vllm_ddtree.adaptive.schedule (vLLM's dynamic speculative "
        "decoding schedule); 'online': re-tuned at run time from the trees' own "
        "expected acceptance.",
    ),
)


class DDTreeConfigError(ValueError):
    """A DDTree speculative config is invalid; the message names field, value and fix."""


def is_int(value: Any) -> bool:
    """An integer as JSON writes one: ``int``, not ``bool`` (a subclass of it)."""
    return isinstance(value, int) and not isinstance(value, bool)


#: ``ddtree_*`` keys that name settings vllm-ddtree derives itself, with what the user
#: sets instead (a dump of a config from an earlier release shows them as fields).
_DERIVED_KEYS = {
    "ddtree_enabled": "method='ddtree' selects DDTree",
    "ddtree_depth": f"the depth follows from the drafter and the budget, {MAX_DEPTH_FIELD} "
                    "caps it",
    "ddtree_online_channel": "vllm-ddtree names the online budget's statistics channel "
                             "itself",
}


def check_option_names(given: Iterable[Any]) -> None:
    """Refuse a ``ddtree*`` key of ``--speculative-config`` (any case) that is no user
    option, naming the options and the closest one (or, for a setting vllm-ddtree
    derives itself, what sets it); vLLM's own message would be a bare "unexpected
    keyword argument", or nothing at all for a key vLLM knows.  Other unknown keys are
    left to vLLM."""
    for name in given:
        if not isinstance(name, str) or not name.lower().startswith("ddtree") \
                or name in USER_OPTIONS:
            continue
        if name in _DERIVED_KEYS:
            hint = f"{_DERIVED_KEYS[name]}; "
        else:
            close = difflib.get_close_matches(name.lower(), USER_OPTIONS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
        raise DDTreeConfigError(
            f"speculative_config.{name} is not a DDTree option: {hint}"
            f"the options are {', '.join(USER_OPTIONS)}.")


def check_options_apply(method: Any, values: Mapping[str, Any]) -> None:
    """With a ``method`` other than ``"ddtree"``, an option (``values``: key -> value;
    absent keys are unset) given anything but its default is refused: it would be
    ignored, and the user meant DDTree or left it over from a DDTree config."""
    if method == METHOD:
        return
    for extra in EXTRA_FIELDS:
        if values.get(extra.name, extra.default) is not extra.default:
            raise DDTreeConfigError(
                f"speculative_config.{extra.name} is set but method={method!r}: it "
                "only applies to method='ddtree'. Remove it or set method to 'ddtree'.")


def check_raw_options(kwargs: Mapping[str, Any]) -> None:
    """Check ``--speculative-config`` as the user wrote it (``kwargs``: the keyword
    arguments of vLLM's ``SpeculativeConfig``, ``method`` among them), before pydantic's
    lax mode coerces the values: it would read ``"4"``, ``4.0`` and ``true`` as a depth
    and ``1`` or ``0`` as a boolean, and run a configuration the user did not write.

    For every method: each ``ddtree*`` key is an option (:func:`check_option_names`)
    and options come with ``method="ddtree"`` only (:func:`check_options_apply`).  For
    DDTree: ``num_speculative_tokens`` and ``ddtree_max_depth`` are integers,
    ``ddtree_adaptive_budget`` is ``true``, ``false`` or ``"online"``.  Independent of
    vLLM: every adapter calls it on what it receives."""
    check_option_names(kwargs)
    method = kwargs.get("method")
    if method != METHOD:
        check_options_apply(method, kwargs)
        return
    check_num_speculative_tokens(kwargs.get("num_speculative_tokens"))
    check_max_depth(kwargs.get(MAX_DEPTH_FIELD))
    check_adaptive(kwargs.get(ADAPTIVE_FIELD, False))


#: vLLM 0.34's spelling of each option inside ``speculator_options`` (the registry's
#: mechanism for a custom method's own options).
SPECULATOR_OPTIONS = {MAX_DEPTH_FIELD: "max_depth", ADAPTIVE_FIELD: "adaptive_budget"}


def check_speculator_options(options: Any) -> dict[str, Any]:
    """``speculator_options`` of a DDTree config (vLLM 0.34): None or a mapping of
    :data:`SPECULATOR_OPTIONS` names to values of the option's type (checked as given,
    like :func:`check_raw_options`); returns it as a dict."""
    if options is None:
        return {}
    names = sorted(SPECULATOR_OPTIONS.values())
    if not isinstance(options, Mapping):
        raise DDTreeConfigError(
            f"speculative_config.speculator_options={options!r} is invalid: it must be a "
            f"JSON object with the DDTree options {names}.")
    unknown = sorted(set(options) - set(names), key=str)
    if unknown:
        raise DDTreeConfigError(
            f"speculative_config.speculator_options has {unknown}, which are no DDTree "
            f"options: the options are {names}.")
    if "max_depth" in options:
        _check_option_value(check_max_depth, "max_depth", options["max_depth"])
    if "adaptive_budget" in options:
        _check_option_value(check_adaptive, "adaptive_budget", options["adaptive_budget"])
    return dict(options)


def _check_option_value(check: Any, name: str, value: Any) -> None:
    """``check`` (a top-level option's validator) on a ``speculator_options`` value, its
    message naming the key as the user wrote it."""
    try:
        check(value)
    except DDTreeConfigError as e:
        top = next(k for k, v in SPECULATOR_OPTIONS.items() if v == name)
        where = f"speculative_config.speculator_options.{name}="
        raise DDTreeConfigError(str(e).replace(f"speculative_config.{top}=", where)) from None


def to_speculator_options(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``SpeculativeConfig`` keyword arguments with a DDTree config's ``ddtree_*`` keys
    moved into ``speculator_options`` (vLLM 0.34, where a registered method takes its
    options there); other configs as given.  An option given both ways is refused."""
    out = dict(kwargs)
    if out.get("method") != METHOD:
        return out
    given = {key: out.pop(key) for key in SPECULATOR_OPTIONS if key in out}
    if not given:
        return out
    options = out.get("speculator_options")
    options = dict(options) if isinstance(options, Mapping) else options
    if options is not None and not isinstance(options, dict):
        check_speculator_options(options)  # refuses it by name
    options = options or {}
    for key, value in given.items():
        name = SPECULATOR_OPTIONS[key]
        if name in options:
            raise DDTreeConfigError(
                f"speculative_config.{key} and speculative_config.speculator_options."
                f"{name} are both set: give the option one way.")
        options[name] = value
    out["speculator_options"] = options
    return out


@dataclass(frozen=True)
class TargetInfo:
    """What DDTree validation needs to know about the target model and parallelism."""

    architecture: str = "?"
    vocab_size: int | None = None
    hidden_size: int | None = None
    is_hybrid: bool = False
    is_attention_free: bool = False
    use_mla: bool = False
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1


# --------------------------------------------------------------------- checks


def check_num_speculative_tokens(value: Any) -> int:
    """The budget B must be an int in ``[1, MAX_BUDGET]``; returns it."""
    if value is None:
        raise DDTreeConfigError(
            "speculative_config.num_speculative_tokens is missing: method='ddtree' "
            "needs the tree budget B (number of tree nodes verified per step). "
            'Add e.g. "num_speculative_tokens": 15 to --speculative-config.'
        )
    if not is_int(value) or value < 1:
        raise DDTreeConfigError(
            f"speculative_config.num_speculative_tokens={value!r} is invalid for "
            "method='ddtree': the tree budget B must be an integer >= 1. "
            'Set e.g. "num_speculative_tokens": 15.'
        )
    if value > MAX_BUDGET:
        raise DDTreeConfigError(
            f"speculative_config.num_speculative_tokens={value} exceeds the largest tree "
            f"budget method='ddtree' supports, {MAX_BUDGET} (one request verifies 1 + B "
            "rows, which the GPU verify-row kernel holds in one Triton program). Set "
            f"num_speculative_tokens <= {MAX_BUDGET}; the project's benchmarks cover "
            "budgets 15 to 512 (docs/benchmarks.md), and 15 is the usual choice "
            "(docs/configuration.md, 'The budget rule')."
        )
    return value


def check_budget_fits_vocab(budget: int, target: TargetInfo) -> None:
    """B at most the target's vocabulary size (module docstring, "Bounds")."""
    vocab = target.vocab_size
    if is_int(vocab) and budget > vocab:
        raise DDTreeConfigError(
            f"speculative_config.num_speculative_tokens={budget} exceeds the target "
            f"{target.architecture} vocab_size={vocab}: each tree depth offers at most "
            f"{vocab} candidates. Set num_speculative_tokens <= {vocab}."
        )


def check_verify_fits(budget: int, drafting_slots: int, max_num_batched_tokens: int,
                      max_num_scheduled_tokens: int | None) -> None:
    """One request's ``1 + B`` verify rows must fit a scheduler step: vLLM schedules a
    decode within ``max_num_scheduled_tokens`` and, where it reserves them,
    ``max_num_batched_tokens`` less the drafter's slots (``drafting_slots``: vLLM's
    ``max_num_new_slots_for_drafting``).  A tree that does not fit is cut to the step's
    leftover tokens every step, and a second request waits for the next step.  Checked
    when the scheduler is built (its config comes after the speculative config)."""
    room = max_num_batched_tokens - drafting_slots
    if max_num_scheduled_tokens is not None:
        room = min(room, max_num_scheduled_tokens)
    if 1 + budget > room:
        raise DDTreeConfigError(
            f"speculative_config.num_speculative_tokens={budget} needs {1 + budget} "
            f"verify tokens per request and step, but the scheduler fits {room} "
            f"(max_num_batched_tokens={max_num_batched_tokens}"
            + (f", max_num_scheduled_tokens={max_num_scheduled_tokens}"
               if max_num_scheduled_tokens is not None else "")
            + f", {drafting_slots} reserved for the drafter). Set num_speculative_tokens "
            f"<= {max(room - 1, 0)} or raise max_num_batched_tokens."
        )


def check_adaptive(value: Any) -> bool | str:
    """``ddtree_adaptive_budget`` is ``false``, ``true`` or ``"online"``; returns it."""
    if value is not False and value is not True and value != ONLINE:
        raise DDTreeConfigError(
            f"speculative_config.{ADAPTIVE_FIELD}={value!r} is invalid: use true, "
            f"false or {ONLINE!r}.")
    return value


def check_max_depth(value: Any) -> int | None:
    """``ddtree_max_depth`` is None or an int >= 1; returns it."""
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise DDTreeConfigError(
            f"speculative_config.{MAX_DEPTH_FIELD}={value!r} is invalid: it must be "
            f"an integer >= 1 (or omitted for depth = block_size - 1)."
        )
    return value


def check_runner_features(speculative_config: Any, parallel_config: Any) -> None:
    """Reject vLLM 0.32+ GPU-runner features that DDTree's tree state does not follow:
    adaptive verification (trims drafts as a chain), dual-batch overlap (micro-batches
    restart row numbering) and batch-sharded sampling (each TP rank samples a share of the
    requests).  Absent on older vLLM."""
    if getattr(speculative_config, "enable_adaptive_verification", False):
        raise DDTreeConfigError(
            "speculative_config.enable_adaptive_verification=true is not supported with "
            "method='ddtree': it trims each request's drafts by the chain's per-token "
            "confidences, and a tree's nodes are not a chain. Remove it (DDTree's own "
            f"per-batch budget is {ADAPTIVE_FIELD}).")
    if parallel_config is None:
        return
    if getattr(parallel_config, "enable_dbo", False) or \
            (getattr(parallel_config, "ubatch_size", 1) or 1) > 1:
        raise DDTreeConfigError(
            "dual-batch overlap (enable_dbo / ubatch_size > 1) is unsupported with "
            "method='ddtree': tree rows and KV compaction are laid out per step, not per "
            "micro-batch. Turn it off, or use method='dflash'.")
    if getattr(parallel_config, "enable_batch_sharded_sampling", False):
        raise DDTreeConfigError(
            "enable_batch_sharded_sampling is unsupported with method='ddtree': every TP "
            "rank must walk every request's tree to compact its own KV shard. Turn it off.")


def check_target(target: TargetInfo) -> None:
    """Reject targets and parallel layouts DDTree cannot serve."""
    arch = target.architecture
    if target.is_hybrid or target.is_attention_free:
        raise DDTreeConfigError(
            f"target model {arch} is a hybrid/Mamba (recurrent-state) model: "
            "method='ddtree' is unsupported because tree verification needs "
            "per-node KV rollback, which recurrent state does not allow. Use a "
            "pure-attention target, or method='dflash' (chain drafting)."
        )
    if target.use_mla:
        raise DDTreeConfigError(
            f"target model {arch} uses MLA (multi-head latent attention): "
            "method='ddtree' is unsupported because the tree-attention and "
            "KV-compaction kernels only handle standard K/V caches. Use "
            "method='dflash' for this target."
        )
    if target.pipeline_parallel_size > 1:
        raise DDTreeConfigError(
            f"pipeline_parallel_size={target.pipeline_parallel_size} is unsupported "
            "with method='ddtree' (KV compaction of the accepted path is per-rank "
            "only). Use pipeline_parallel_size=1 (tensor parallelism is fine)."
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(target, name)
        if size > 1:
            raise DDTreeConfigError(
                f"{name}={size} is unsupported with method='ddtree' (context "
                f"parallelism splits the KV cache the tree verifier compacts). "
                f"Set {name}=1."
            )


# ------------------------------------------------------------------ accessors


@dataclass(frozen=True)
class DDTreeParams:
    """DDTree's settings once validated, carried by vLLM's ``SpeculativeConfig`` as the
    attribute :data:`PARAMS_ATTR`.  An attribute, not a config field: users cannot set
    it, it travels with the config to every process (pickle and deepcopy keep instance
    attributes) and it stays out of vLLM's compilation hash."""

    budget: int  # B: tree nodes verified per request and step
    depth: int  # D: drafter positions per pass, the deepest node
    adaptive: bool | str = False  # ddtree_adaptive_budget: False, True or ONLINE
    dspark: bool = False  # the drafter is a DSpark checkpoint (vLLM method "dspark")
    #: the statistics channel of ddtree_adaptive_budget="online": random, drawn once
    #: when the config is built, so the scheduler and its worker name the same one
    online_channel: str | None = None


PARAMS_ATTR = "_ddtree"


def attach_params(speculative_config: Any, params: DDTreeParams) -> None:
    """Mark ``speculative_config`` (vLLM's) as DDTree with ``params``."""
    object.__setattr__(speculative_config, PARAMS_ATTR, params)


def is_ddtree(speculative_config: Any) -> bool:
    """True if this (vLLM) speculative config was validated as ``method="ddtree"``."""
    return getattr(speculative_config, PARAMS_ATTR, None) is not None


def is_online(speculative_config: Any) -> bool:
    """True for ``ddtree_adaptive_budget: "online"`` on a DDTree config."""
    return is_ddtree(speculative_config) and ddtree_params(speculative_config).adaptive == ONLINE


def ddtree_params(speculative_config: Any) -> DDTreeParams:
    """The :class:`DDTreeParams` of a DDTree speculative config."""
    params = getattr(speculative_config, PARAMS_ATTR, None)
    if params is None:
        raise ValueError(
            f"not a DDTree speculative config (method="
            f"{getattr(speculative_config, 'method', None)!r}); "
            "check vllm_ddtree.config.is_ddtree() first."
        )
    return params
