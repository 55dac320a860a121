"""DDTree configuration: extra fields, validation and accessors.

Pure Python (json + dataclasses). The vLLM side -- turning ``method="ddtree"``
into DFlash plumbing -- lives in :mod:`vllm_ddtree._patch.speculative_config`,
which calls the validators below *before* vLLM builds the draft model config,
so bad configurations fail before any weights load.

User-facing knobs, all inside ``--speculative-config``:

* ``method: "ddtree"`` selects DDTree.
* ``model``: a DFlash drafter checkpoint (``config.json`` with ``dflash_config``
  and ``block_size``).
* ``num_speculative_tokens``: the tree budget B (verified nodes per step).
* ``ddtree_max_depth`` (optional): caps the tree depth D.
* ``ddtree_adaptive_budget`` (optional, default false): B becomes the largest budget and
  vLLM's per-batch-size draft count (``num_speculative_tokens_per_batch_size``) is set
  from :mod:`vllm_ddtree.adaptive.schedule`'s cost model (big trees at small batches).  ``"online"``:
  the same, then re-tuned while serving from the trees' own expected acceptance
  (:class:`vllm_ddtree.adaptive.online.OnlineSchedule`).

The depth is ``D = min(block_size - 1, B, ddtree_max_depth)``. After
validation vLLM sees ``method="dflash"`` with ``num_speculative_tokens=B``;
the fields ``ddtree_enabled=True`` and ``ddtree_depth=D`` mark the config as
DDTree and travel with it (pickle, deepcopy, ``vllm.config.utils.replace``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

METHOD = "ddtree"
#: vLLM method the DDTree config is mapped to.
BASE_METHOD = "dflash"

MARKER_FIELD = "ddtree_enabled"
DEPTH_FIELD = "ddtree_depth"
MAX_DEPTH_FIELD = "ddtree_max_depth"
ADAPTIVE_FIELD = "ddtree_adaptive_budget"
ONLINE = "online"  # ddtree_adaptive_budget value of the run-time re-tuned schedule


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
        "DDTree only: upper bound on the tree depth D (default: block_size - 1).",
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
    ExtraField(
        MARKER_FIELD,
        bool,
        False,
        "Set by vllm-ddtree: this config was requested as method='ddtree' "
        "(vLLM sees method='dflash').",
    ),
    ExtraField(
        DEPTH_FIELD,
        int | None,
        None,
        "Set by vllm-ddtree: the resolved tree depth D.",
    ),
)

_DFLASH_EXTRA_ARCHITECTURES = frozenset({"MuseGlimmerAssistantModel"})


class DDTreeConfigError(ValueError):
    """A DDTree speculative config is invalid; the message names field, value and fix."""


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
    """The budget B must be an int >= 1; returns it."""
    if value is None:
        raise DDTreeConfigError(
            "speculative_config.num_speculative_tokens is missing: method='ddtree' "
            "needs the tree budget B (number of tree nodes verified per step). "
            'Add e.g. "num_speculative_tokens": 16 to --speculative-config.'
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DDTreeConfigError(
            f"speculative_config.num_speculative_tokens={value!r} is invalid for "
            "method='ddtree': the tree budget B must be an integer >= 1. "
            'Set e.g. "num_speculative_tokens": 16.'
        )
    return value


def check_max_depth(value: Any) -> int | None:
    """``ddtree_max_depth`` is None or an int >= 1; returns it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
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


def load_drafter_config(model: str | None) -> dict[str, Any] | None:
    """The drafter's ``config.json`` as a dict for a local folder, else None.

    ``None`` means "not a local path" (a Hub id): the caller validates the
    config vLLM downloads instead. No network access happens here.
    """
    if model is None:
        raise DDTreeConfigError(
            "speculative_config.model is missing: method='ddtree' needs a DFlash "
            'drafter. Add "model": "<path or id of a DFlash checkpoint>".'
        )
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        return None
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise DDTreeConfigError(
            f"speculative_config.model={model!r} has no config.json: "
            "method='ddtree' needs a DFlash drafter checkpoint folder."
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise DDTreeConfigError(
            f"speculative_config.model={model!r}: cannot read {config_path}: {e}"
        ) from e
    if not isinstance(data, dict):
        raise DDTreeConfigError(
            f"speculative_config.model={model!r}: {config_path} is not a JSON object."
        )
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            check_safetensors(os.path.join(path, name), model)
    return data


def check_safetensors(file: str, model: str) -> None:
    """A safetensors file whose header is unreadable, or that is shorter than its header
    says (an interrupted copy), fails here with its name rather than deep in the loader."""
    where = f"speculative_config.model={model!r}: drafter weights {file}"
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                raise ValueError(f"header length {n} does not fit in {size} bytes")
            header = json.loads(f.read(n))
        end = max((int(t["data_offsets"][1]) for k, t in header.items()
                   if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise DDTreeConfigError(f"{where} is not a readable safetensors file ({e}).") from None
    if size < 8 + n + end:
        raise DDTreeConfigError(
            f"{where} is truncated: {size} bytes, its header describes {8 + n + end}. "
            "Copy or download the drafter again.")


def _get(cfg: dict[str, Any], key: str) -> Any:
    """``cfg[key]``, falling back to ``dflash_config[key]`` and ``text_config[key]``."""
    if cfg.get(key) is not None:
        return cfg[key]
    for section in ("dflash_config", "text_config"):
        sub = cfg.get(section)
        if isinstance(sub, dict) and sub.get(key) is not None:
            return sub[key]
    return None


def check_drafter(drafter: dict[str, Any], target: TargetInfo, model: str) -> int:
    """Validate a DFlash drafter config against the target; returns its block_size."""
    where = f"speculative_config.model={model!r}"
    archs = drafter.get("architectures") or []
    if not any(
        str(a).startswith("DFlash") or a in _DFLASH_EXTRA_ARCHITECTURES for a in archs
    ):
        raise DDTreeConfigError(
            f"{where} is not a DFlash drafter: config.json has architectures={archs!r} "
            "(expected DFlash*, e.g. DFlashDraftModel). method='ddtree' drafts with "
            "a DFlash block-diffusion checkpoint such as z-lab/Qwen3-4B-DFlash-b16."
        )
    if not isinstance(drafter.get("dflash_config"), dict):
        raise DDTreeConfigError(
            f"{where} is not a DFlash drafter: config.json has no 'dflash_config' "
            "(with mask_token_id and target_layer_ids). Use a DFlash checkpoint "
            "for this target."
        )
    block_size = _get(drafter, "block_size")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise DDTreeConfigError(
            f"{where}: config.json has block_size={block_size!r}; a DFlash drafter "
            "needs an integer block_size >= 2 (top-level or in dflash_config), "
            "which bounds the DDTree depth (block_size - 1)."
        )
    vocab = _get(drafter, "vocab_size")
    if target.vocab_size is not None and vocab is not None and vocab != target.vocab_size:
        raise DDTreeConfigError(
            f"{where}: drafter vocab_size={vocab} differs from the target "
            f"{target.architecture} vocab_size={target.vocab_size}. DDTree drafts "
            "target token ids, so use the DFlash drafter trained for this target."
        )
    draft_vocab = _get(drafter, "draft_vocab_size")
    if target.vocab_size is not None and draft_vocab not in (None, target.vocab_size):
        raise DDTreeConfigError(
            f"{where}: drafter draft_vocab_size={draft_vocab} differs from the "
            f"target vocab_size={target.vocab_size}; reduced draft vocabularies "
            "(d2t) are not supported by method='ddtree'. Use method='dflash'."
        )
    # vLLM sizes the context projection from target_hidden_size, else hidden_size.
    hidden_key = "target_hidden_size" if _get(drafter, "target_hidden_size") else "hidden_size"
    hidden = _get(drafter, hidden_key)
    if target.hidden_size is not None and hidden is not None and hidden != target.hidden_size:
        raise DDTreeConfigError(
            f"{where}: drafter {hidden_key}={hidden} differs from the target "
            f"{target.architecture} hidden_size={target.hidden_size}. A DFlash "
            "drafter reads the target's hidden states, so use the drafter trained "
            "for this target."
        )
    return block_size


def resolve_depth(budget: int, block_size: int, max_depth: int | None) -> int:
    """``D = min(block_size - 1, B, ddtree_max_depth)``."""
    cap = math.inf if max_depth is None else max_depth
    return int(min(block_size - 1, budget, cap))


# ------------------------------------------------------------------ accessors


def is_ddtree(speculative_config: Any) -> bool:
    """True if this (vLLM) speculative config was requested as ``method="ddtree"``."""
    if speculative_config is None:
        return False
    if getattr(speculative_config, MARKER_FIELD, False) is True:
        return True
    return getattr(speculative_config, "method", None) == METHOD


def is_online(speculative_config: Any) -> bool:
    """True for ``ddtree_adaptive_budget: "online"`` on a DDTree config."""
    return is_ddtree(speculative_config) and \
        getattr(speculative_config, ADAPTIVE_FIELD, False) == ONLINE


def ddtree_params(speculative_config: Any) -> tuple[int, int]:
    """``(budget B, depth D)`` of a DDTree speculative config."""
    if not is_ddtree(speculative_config):
        raise ValueError(
            f"not a DDTree speculative config (method="
            f"{getattr(speculative_config, 'method', None)!r}); "
            "check vllm_ddtree.config.is_ddtree() first."
        )
    budget = check_num_speculative_tokens(speculative_config.num_speculative_tokens)
    depth = getattr(speculative_config, DEPTH_FIELD, None)
    if depth is None:
        max_depth = getattr(speculative_config, MAX_DEPTH_FIELD, None)
        depth = budget if max_depth is None else min(budget, max_depth)
    return budget, int(depth)
