"""DDTree configuration: extra fields, validation and accessors.

Standard library (numpy lazily, in ``check_finite``). The vLLM side -- turning
``method="ddtree"`` into DFlash plumbing -- lives in
:mod:`vllm_ddtree._patch.speculative_config`, which calls the validators below *before*
vLLM builds the draft model config, so bad configurations fail before any weights load.

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

The depth is ``D = min(block_size - 1, B, ddtree_max_depth)`` (``block_size`` in
place of ``block_size - 1`` for DSpark drafters, whose anchor slot drafts too). After
validation vLLM sees ``method="dflash"`` (``"dspark"``) with ``num_speculative_tokens=B``;
the fields ``ddtree_enabled=True`` and ``ddtree_depth=D`` mark the config as
DDTree and travel with it (pickle, deepcopy, ``vllm.config.utils.replace``).

Bounds (refused with a :class:`DDTreeConfigError` naming the field and the limit):

* ``1 <= B <= MAX_BUDGET`` (2047) on both paths.  One request verifies ``1 + B`` rows.
  GPU: the verify-row kernel (:func:`vllm_ddtree.gpu.verify_rows.fill_tree_rows`) holds
  one request's ancestor bits, ``(1 + B) x (1 + B) / 32`` words rounded up to powers of
  two, in one Triton program: at ``1 + B = 2048`` its first compilation took about 24 s
  on an H200, at 4096 it had not finished after 7 minutes.  The tree build has no limit
  of its own (the one-launch Triton build takes the widths whose sorts fit one program,
  :data:`vllm_ddtree.kernels.tree_build.MAX_SORT`, the torch build any other; its packed
  tie codes need ``width * min(width, vocab) < 2**32``), nor has tree attention (it tiles
  the rows).  CPU: no kernel limit; the same bound keeps a configuration portable
  between the paths (and the CPU path's dense per-request masks grow as ``(1 + B)**2``).
* ``B <= vocab_size`` of the target: each depth offers at most ``vocab_size``
  candidates, so a wider tree only adds ever-deeper paths of vanishing probability
  (never binding for real vocabularies, far above :data:`MAX_BUDGET`).
* ``ddtree_max_depth <= block_size - 1`` (``block_size`` for DSpark): the drafter drafts
  at most that many positions per pass; a larger cap is refused rather than clamped, so a
  configuration never asks for a depth it cannot get.  (``ddtree_max_depth`` above ``B`` is a cap
  that does not bind: ``D = B``.)
* At engine start (vLLM builds its scheduler config after this one), one request's
  verify rows must fit the scheduler's per-step token budget:
  :func:`check_verify_fits`.

Start-up faults of a local drafter folder fail here too, naming the file: a
``config.json`` that is no JSON object or holds fields of the wrong type
(:func:`check_drafter_types`), safetensors files that are unreadable or truncated, or
that hold NaN/inf values (:func:`check_safetensors`; the scan reads every drafter
weight once at start-up, see :func:`check_finite`).  Hub ids are validated from the
config vLLM fetched; their weights are not scanned (vLLM downloads them later), and at
run time trees drafted from NaN/inf logits are dropped (:mod:`vllm_ddtree.drafter_faults`).
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

METHOD = "ddtree"
#: vLLM method the DDTree config is mapped to, by drafter family.
BASE_METHOD = "dflash"
DSPARK_METHOD = "dspark"
BASE_METHODS = (BASE_METHOD, DSPARK_METHOD)
#: DSpark checkpoints DDTree drafts with (vLLM 0.26+ loads them as
#: ``Qwen3DSparkForCausalLM``).
DSPARK_ARCHITECTURES = frozenset({"Qwen3DSparkModel"})

MARKER_FIELD = "ddtree_enabled"
DEPTH_FIELD = "ddtree_depth"
MAX_DEPTH_FIELD = "ddtree_max_depth"
ADAPTIVE_FIELD = "ddtree_adaptive_budget"
ONLINE = "online"  # ddtree_adaptive_budget value of the run-time re-tuned schedule
CHANNEL_FIELD = "ddtree_online_channel"

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
    ExtraField(
        CHANNEL_FIELD,
        str | None,
        None,
        "Set by vllm-ddtree for ddtree_adaptive_budget='online': the random name of the "
        "worker -> scheduler statistics channel (vllm_ddtree.adaptive.channel), drawn "
        "once when the config is built so every process's copy names the same channel.",
    ),
)

_DFLASH_EXTRA_ARCHITECTURES = frozenset({"MuseGlimmerAssistantModel"})


class DDTreeConfigError(ValueError):
    """A DDTree speculative config is invalid; the message names field, value and fix."""


def check_option_names(given: Iterable[str], known: Iterable[str]) -> None:
    """Refuse a ``ddtree_*`` key of ``--speculative-config`` that is no field of the
    config (``known``), naming the closest user option (vLLM's own message is a bare
    "unexpected keyword argument").  Other unknown keys are left to vLLM."""
    known = set(known)
    options = (MAX_DEPTH_FIELD, ADAPTIVE_FIELD)  # the others are set by vllm-ddtree
    for name in given:
        if name.startswith("ddtree") and name not in known:
            close = difflib.get_close_matches(name, options, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise DDTreeConfigError(
                f"speculative_config.{name} is not a DDTree option: {hint}"
                f"the options are {', '.join(options)}.")


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
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
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
            f"num_speculative_tokens <= {MAX_BUDGET}; budgets of 15 to 255 are the "
            "measured range."
        )
    return value


def check_budget_fits_vocab(budget: int, target: TargetInfo) -> None:
    """B at most the target's vocabulary size (module docstring, "Bounds")."""
    vocab = target.vocab_size
    if _is_int(vocab) and budget > vocab:
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


_CHANNEL_NAME = re.compile(r"[0-9A-Za-z]{1,64}")


def check_channel_name(value: Any) -> str | None:
    """``ddtree_online_channel`` is None or 1-64 letters and digits (it names a
    directory, so no separators or dots); returns it."""
    if value is None:
        return None
    if not isinstance(value, str) or not _CHANNEL_NAME.fullmatch(value):
        raise DDTreeConfigError(
            f"speculative_config.{CHANNEL_FIELD}={value!r} is invalid: it must be 1 to 64 "
            "letters and digits. Omit it: vllm-ddtree draws a random one."
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
    check_drafter_types(data, f"speculative_config.model={model!r}: {config_path}")
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            check_safetensors(os.path.join(path, name), model)
    return data


def check_safetensors(file: str, model: str) -> None:
    """A safetensors file whose header is unreadable, that is shorter than its header
    says (an interrupted copy), or whose floating-point tensors hold NaN/inf
    (:func:`check_finite`) fails here with its name rather than deep in the loader or
    as a drafter that never gets a token accepted."""
    where = f"speculative_config.model={model!r}: drafter weights {file}"
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                raise ValueError(f"header length {n} does not fit in {size} bytes")
            header = json.loads(f.read(n))
        tensors = {k: (str(t["dtype"]), int(t["data_offsets"][0]), int(t["data_offsets"][1]))
                   for k, t in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise DDTreeConfigError(f"{where} is not a readable safetensors file ({e}).") from None
    end = max((stop for _, _, stop in tensors.values()), default=0)
    if size < 8 + n + end:
        raise DDTreeConfigError(
            f"{where} is truncated: {size} bytes, its header describes {8 + n + end}. "
            "Copy or download the drafter again.")
    info = os.stat(file)
    bad = check_finite(os.path.realpath(file), info.st_size, info.st_mtime_ns, 8 + n,
                       tuple(sorted(tensors.items())))
    if bad is not None:
        raise DDTreeConfigError(
            f"{where} holds NaN/inf values in tensor {bad!r}: the drafter checkpoint is "
            "corrupt (or its training diverged). Export or download it again.")


#: Non-finite test per safetensors float dtype: ``(bits view, mask)``; a value is
#: NaN/inf iff ``bits & mask == mask`` (exponent all ones; float8 e4m3 has NaN only,
#: exponent and mantissa all ones).
_NONFINITE_BITS = {
    "F64": ("<u8", 0x7FF0000000000000),
    "F32": ("<u4", 0x7F800000),
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
    "F8_E5M2": ("u1", 0x7C),
    "F8_E4M3": ("u1", 0x7F),
}
_SCAN_CHUNK = 1 << 24  # elements per step: bounded temporaries whatever the tensor


@functools.lru_cache(maxsize=64)
def check_finite(file: str, size: int, mtime_ns: int, data_start: int,
                 tensors: tuple[tuple[str, tuple[str, int, int]], ...]) -> str | None:
    """The first tensor (by name) of a safetensors file holding NaN/inf, else None.

    ``tensors``: ``(name, (dtype, begin, end))`` with offsets from ``data_start``;
    integer tensors are skipped.  Reads the bits through a read-only memory map, in
    chunks of :data:`_SCAN_CHUNK` elements, once per file and process (cached by path,
    size and modification time, so a config validated again does not scan again).
    Cost: 0.13 to 0.3 s for 512 MB of bf16 from the page cache on one CPU core, i.e.
    well under a second for a 1 GB drafter, plus reading the file once from disk; the
    pages stay cached for vLLM's loader right after, which reads the same file.  Worth
    it at start-up: a drafter with NaN/inf weights otherwise serves with every affected
    tree dropped (:mod:`vllm_ddtree.drafter_faults`), correct but never faster, and a
    broken checkpoint is best named before the target's weights load."""
    import numpy as np

    del size, mtime_ns  # cache key only
    for name, (dtype, begin, end) in tensors:
        kind = _NONFINITE_BITS.get(dtype)
        if kind is None or end <= begin:
            continue
        view, mask = kind
        count = (end - begin) // np.dtype(view).itemsize
        bits = np.memmap(file, dtype=view, mode="r", offset=data_start + begin,
                         shape=(count,))
        ones = bits.dtype.type(mask)
        for start in range(0, count, _SCAN_CHUNK):
            if np.any(np.bitwise_and(bits[start:start + _SCAN_CHUNK], ones) == ones):
                return name
        del bits
    return None


def _get(cfg: dict[str, Any], key: str) -> Any:
    """``cfg[key]``, falling back to ``dflash_config[key]`` and ``text_config[key]``."""
    if cfg.get(key) is not None:
        return cfg[key]
    for section in ("dflash_config", "text_config"):
        sub = cfg.get(section)
        if isinstance(sub, dict) and sub.get(key) is not None:
            return sub[key]
    return None


#: Drafter ``config.json`` fields vLLM builds the drafter from, by expected type.
_POSITIVE_INT_FIELDS = (
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
    "num_target_layers", "target_hidden_size", "draft_vocab_size", "markov_rank",
    "dspark_block_size",
)
_NUMBER_FIELDS = ("rms_norm_eps", "rope_theta")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_drafter_types(drafter: dict[str, Any], where: str) -> None:
    """Fields of the wrong type (``"num_hidden_layers": "five"``, a string hidden size)
    fail here with the field's name, before transformers' or vLLM's parsers see them.
    Checked at the top level and in ``dflash_config`` / ``text_config``; absent or
    null fields are left to the checks that need them (``block_size``) and to vLLM's
    defaults."""
    sections = [("", drafter)] + [
        (f"{name}.", drafter[name]) for name in ("dflash_config", "text_config")
        if isinstance(drafter.get(name), dict)]
    for prefix, section in sections:
        for key in _POSITIVE_INT_FIELDS:
            value = section.get(key)
            if value is not None and (not _is_int(value) or value < 1):
                raise DDTreeConfigError(
                    f"{where} has {prefix}{key}={value!r}: it must be an integer >= 1.")
        for key in _NUMBER_FIELDS:
            value = section.get(key)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))):
                raise DDTreeConfigError(
                    f"{where} has {prefix}{key}={value!r}: it must be a number.")
    dflash = drafter.get("dflash_config")
    if isinstance(dflash, dict):
        mask = dflash.get("mask_token_id")
        if mask is not None and (not _is_int(mask) or mask < 0):
            raise DDTreeConfigError(
                f"{where} has dflash_config.mask_token_id={mask!r}: it must be an "
                "integer >= 0.")
        layers = dflash.get("target_layer_ids")
        if layers is not None and (not isinstance(layers, list) or not all(
                _is_int(i) and i >= 0 for i in layers)):
            raise DDTreeConfigError(
                f"{where} has dflash_config.target_layer_ids={layers!r}: it must be a "
                "list of integers >= 0.")


@dataclass(frozen=True)
class DrafterInfo:
    """What DDTree reads from a drafter's ``config.json``."""

    method: str  # vLLM's method for the drafter family: BASE_METHOD or DSPARK_METHOD
    block_size: int
    max_depth: int  # positions one drafter pass drafts
    min_depth: int = 1  # fewer positions than a DSpark checkpoint's block garble its drafts


def is_dspark_drafter(drafter: dict[str, Any]) -> bool:
    """vLLM's own test for a DSpark checkpoint, from its config: a DSpark architecture
    (the Markov head's ``markov_rank`` marks one too)."""
    archs = drafter.get("architectures") or []
    return any("DSpark" in str(a) for a in archs) or "markov_rank" in drafter


def _check_dspark_fields(drafter: dict[str, Any], where: str) -> int | None:
    """DSpark-only checks; returns the checkpoint's ``dspark_block_size`` (or None)."""
    archs = drafter.get("architectures") or []
    if not any(a in DSPARK_ARCHITECTURES for a in archs):
        raise DDTreeConfigError(
            f"{where} is a DSpark drafter with architectures={archs!r}: method='ddtree' "
            f"drafts with {sorted(DSPARK_ARCHITECTURES)} checkpoints. Serve this one with "
            "method='dspark' (vLLM's chain).")
    rank = drafter.get("markov_rank")  # its type and bound: check_drafter_types
    if rank is None:
        raise DDTreeConfigError(
            f"{where}: a DSpark drafter needs an integer markov_rank >= 1 in config.json, "
            f"got {rank!r}.")
    # vLLM 0.26 reads the 1 + N fill-in block from dspark_bonus_anchor, 0.32+ from
    # sample_from_anchor=false
    fill_in = {"dspark_bonus_anchor": True, "sample_from_anchor": False}
    for key, value in fill_in.items():
        if drafter.get(key) is value:
            raise DDTreeConfigError(
                f"{where} has {key}={str(value).lower()} (the 1 + N fill-in block): "
                "method='ddtree' drafts with DSpark's anchor-as-first layout only. "
                "Serve this checkpoint with method='dspark'.")
    return drafter.get("dspark_block_size")  # its type and bound: check_drafter_types


def check_no_draft_topk(value: Any) -> None:
    """vLLM 0.33's ``speculative_config.dspark_draft_topk`` (the DSpark chain adds the
    Markov bias to the top-k base candidates only) has no meaning for a tree, whose
    every node ranks its children over the whole draft vocabulary: refused when the
    user sets it.  A checkpoint's own ``dspark_draft_topk`` is not read."""
    if value is not None:
        raise DDTreeConfigError(
            f"speculative_config.dspark_draft_topk={value!r} does not apply to "
            "method='ddtree': the tree ranks each node's children over the whole draft "
            "vocabulary. Remove it, or serve with method='dspark' (vLLM's chain).")


def check_drafter(drafter: dict[str, Any], target: TargetInfo, model: str) -> DrafterInfo:
    """Validate a DFlash or DSpark drafter config against the target."""
    where = f"speculative_config.model={model!r}"
    check_drafter_types(drafter, f"{where}: config.json")
    archs = drafter.get("architectures") or []
    dspark = is_dspark_drafter(drafter)
    dspark_block = _check_dspark_fields(drafter, where) if dspark else None
    if not dspark and not any(
        str(a).startswith("DFlash") or a in _DFLASH_EXTRA_ARCHITECTURES for a in archs
    ):
        raise DDTreeConfigError(
            f"{where} is not a DFlash or DSpark drafter: config.json has "
            f"architectures={archs!r} (expected DFlash*, e.g. DFlashDraftModel, or "
            "Qwen3DSparkModel). method='ddtree' drafts with a block drafter checkpoint "
            "such as z-lab/Qwen3-4B-DFlash-b16."
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
            f"{where}: config.json has block_size={block_size!r}; a block drafter "
            "needs an integer block_size >= 2 (top-level or in dflash_config), "
            "which bounds the DDTree depth."
        )
    vocab = _get(drafter, "vocab_size")
    if target.vocab_size is not None and vocab is not None and vocab != target.vocab_size:
        raise DDTreeConfigError(
            f"{where}: drafter vocab_size={vocab} differs from the target "
            f"{target.architecture} vocab_size={target.vocab_size}. DDTree drafts "
            "target token ids, so use the DFlash drafter trained for this target."
        )
    draft_vocab = _get(drafter, "draft_vocab_size")
    if not dspark and target.vocab_size is not None and \
            draft_vocab not in (None, target.vocab_size):
        raise DDTreeConfigError(
            f"{where}: drafter draft_vocab_size={draft_vocab} differs from the "
            f"target vocab_size={target.vocab_size}; reduced draft vocabularies "
            "(d2t) are supported for DSpark drafters only. Use method='dflash'."
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
    if dspark:
        # DSpark's anchor-as-first layout: every one of the block's slots predicts
        return DrafterInfo(DSPARK_METHOD, block_size, block_size, dspark_block or 1)
    return DrafterInfo(BASE_METHOD, block_size, block_size - 1)


def resolve_depth(budget: int, drafter: DrafterInfo, max_depth: int | None) -> int:
    """``D = min(drafter.max_depth, B, ddtree_max_depth)``: ``block_size - 1`` for DFlash
    (its anchor slot holds the bonus token), ``block_size`` for DSpark (the anchor slot
    predicts too).  A ``ddtree_max_depth`` above the drafter's depth is refused (module
    docstring, "Bounds"), and so is a depth below a DSpark checkpoint's
    ``dspark_block_size``."""
    bound = "block_size" if drafter.method == DSPARK_METHOD else "block_size - 1"
    if max_depth is not None and max_depth > drafter.max_depth:
        raise DDTreeConfigError(
            f"speculative_config.{MAX_DEPTH_FIELD}={max_depth} exceeds what the drafter "
            f"can draft: {bound} = {drafter.max_depth} (its block_size is "
            f"{drafter.block_size}). Set {MAX_DEPTH_FIELD} <= {drafter.max_depth}, or "
            "omit it for that depth."
        )
    cap = math.inf if max_depth is None else max_depth
    depth = int(min(drafter.max_depth, budget, cap))
    if depth < drafter.min_depth:
        raise DDTreeConfigError(
            f"the tree depth would be {depth}, below the DSpark drafter's "
            f"dspark_block_size={drafter.min_depth} (shorter blocks give it a layout it "
            f"was not trained for). Use num_speculative_tokens >= {drafter.min_depth} "
            f"and {MAX_DEPTH_FIELD} >= {drafter.min_depth} (or omit it).")
    return depth


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
