"""What a drafter checkpoint says about itself, read before vLLM loads it.

For a local folder (:func:`load_drafter_config`): its ``config.json``, of bounded size
and nesting, as a JSON object whose fields have the types vLLM builds the drafter from
(:func:`check_drafter_types`), and every ``*.safetensors`` file readable, complete and
free of NaN/inf (:func:`check_safetensors`, :func:`check_finite`).  Anything but a
regular file in these places (a directory, a FIFO, a device) is refused by name without
reading it, so a start-up never blocks on it.  For a Hub id vLLM fetches the config and
:mod:`vllm_ddtree.resolve` checks that instead; its weights are not scanned (vLLM
downloads them later), and at run time trees drafted from NaN/inf logits are dropped
(:mod:`vllm_ddtree.drafter_faults`).

Then, for either: the drafter family and its geometry against the target
(:func:`check_drafter` -> :class:`DrafterInfo`) and the tree depth it allows
(:func:`resolve_depth`).  Every fault is a :class:`~vllm_ddtree.config.DDTreeConfigError`
naming the file or the field.  Standard library (numpy lazily, in :func:`check_finite`),
no vLLM.
"""

from __future__ import annotations

import functools
import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Any, BinaryIO

from vllm_ddtree.config import (
    BASE_METHOD,
    DSPARK_METHOD,
    MAX_DEPTH_FIELD,
    DDTreeConfigError,
    TargetInfo,
    is_int,
)

#: DSpark checkpoints DDTree drafts with (vLLM loads them as ``Qwen3DSparkForCausalLM``).
DSPARK_ARCHITECTURES = frozenset({"Qwen3DSparkModel"})
_DFLASH_EXTRA_ARCHITECTURES = frozenset({"MuseGlimmerAssistantModel"})

#: Largest drafter ``config.json`` read: real ones are a few kB, and a bigger file is
#: refused by its size before any of it is read.
MAX_CONFIG_BYTES = 16 << 20
#: Largest safetensors header, the format's own limit (its reference reader refuses more).
MAX_SAFETENSORS_HEADER = 100_000_000


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


def _open_regular(path: str, what: str) -> tuple[BinaryIO, os.stat_result]:
    """``path`` opened for binary reading, with its ``fstat``, if it is a regular file
    (a symbolic link to one, as in the Hub cache, counts); else a
    :class:`DDTreeConfigError` saying ``what`` it is.  Opened non-blocking and checked
    on the open descriptor: a FIFO would block a plain ``open`` until a writer came,
    and a check by path before opening could be raced.  ``OSError`` from the open
    itself (missing file, no permission) propagates."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise DDTreeConfigError(
                f"{what} is {_file_kind(info.st_mode)}, not a regular file: replace it "
                "with the checkpoint's file.")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), info
    except BaseException:
        os.close(fd)
        raise


def missing_drafter() -> DDTreeConfigError:
    """The error of a DDTree config without ``model``."""
    return DDTreeConfigError(
        "speculative_config.model is missing: method='ddtree' needs a DFlash or DSpark "
        'drafter. Add "model": "<path or id of a DFlash checkpoint>".')


def load_drafter_config(model: str | None) -> dict[str, Any] | None:
    """The drafter's ``config.json`` as a dict for a local folder, else None, with the
    folder's safetensors files checked (:func:`check_safetensors`).

    ``None`` means "not a local path" (a Hub id): the caller validates the
    config vLLM downloads instead. No network access happens here.
    """
    if model is None:
        raise missing_drafter()
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        return None
    config_path = os.path.join(path, "config.json")
    where = f"speculative_config.model={model!r}: {config_path}"
    try:
        f, info = _open_regular(config_path, where)
        with f:
            if info.st_size > MAX_CONFIG_BYTES:
                raise DDTreeConfigError(
                    f"{where} is {info.st_size} bytes, more than a drafter config.json "
                    f"can be ({MAX_CONFIG_BYTES} bytes); it was not read. Replace it with "
                    "the checkpoint's config.json.")
            raw = f.read(MAX_CONFIG_BYTES + 1)  # st_size 0: a file of the proc kind
        if len(raw) > MAX_CONFIG_BYTES:
            raise DDTreeConfigError(
                f"{where} holds more than {MAX_CONFIG_BYTES} bytes, more than a drafter "
                "config.json can be. Replace it with the checkpoint's config.json.")
        data = json.loads(raw.decode("utf-8"))
    except DDTreeConfigError:
        raise
    except FileNotFoundError:
        raise DDTreeConfigError(
            f"speculative_config.model={model!r} has no config.json: "
            "method='ddtree' needs a DFlash drafter checkpoint folder."
        ) from None
    except RecursionError:
        raise DDTreeConfigError(
            f"{where} nests JSON arrays or objects deeper than the parser allows: it is "
            "no model config. Replace it with the checkpoint's config.json.") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError included
        raise DDTreeConfigError(f"speculative_config.model={model!r}: cannot read "
                                f"{config_path}: {e}") from e
    if not isinstance(data, dict):
        raise DDTreeConfigError(f"{where} is not a JSON object.")
    check_drafter_types(data, where)
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
    try:
        f, info = _open_regular(file, where)
        size = info.st_size
        with f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                raise ValueError(f"header length {n} does not fit in {size} bytes")
            if n > MAX_SAFETENSORS_HEADER:
                raise ValueError(f"header length {n} exceeds the format's limit of "
                                 f"{MAX_SAFETENSORS_HEADER} bytes")
            header = json.loads(f.read(n))
        tensors = {k: (str(t["dtype"]), int(t["data_offsets"][0]), int(t["data_offsets"][1]))
                   for k, t in header.items() if k != "__metadata__"}
        for key, (_, begin, stop) in tensors.items():
            if not 0 <= begin <= stop:
                raise ValueError(f"tensor {key!r} has data_offsets [{begin}, {stop}]")
    except DDTreeConfigError:
        raise
    except RecursionError:
        raise DDTreeConfigError(f"{where} is not a readable safetensors file (its header "
                                "nests JSON deeper than the parser allows).") from None
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise DDTreeConfigError(f"{where} is not a readable safetensors file ({e}).") from None
    end = max((stop for _, _, stop in tensors.values()), default=0)
    if size < 8 + n + end:
        raise DDTreeConfigError(
            f"{where} is truncated: {size} bytes, its header describes {8 + n + end}. "
            "Copy or download the drafter again.")
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
    Worth its start-up time (docs/benchmarks.md, "Measurements behind the configuration
    checks"; the pages it reads stay cached for vLLM's loader, which reads the same file
    right after): a drafter with NaN/inf weights otherwise serves with every affected
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
            if value is not None and (not is_int(value) or value < 1):
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
        if mask is not None and (not is_int(mask) or mask < 0):
            raise DDTreeConfigError(
                f"{where} has dflash_config.mask_token_id={mask!r}: it must be an "
                "integer >= 0.")
        layers = dflash.get("target_layer_ids")
        if layers is not None and (not isinstance(layers, list) or not all(
                is_int(i) and i >= 0 for i in layers)):
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
    # checkpoints mark the 1 + N fill-in block with sample_from_anchor=false (what vLLM
    # reads) or dspark_bonus_anchor=true (older exports)
    fill_in = {"dspark_bonus_anchor": True, "sample_from_anchor": False}
    for key, value in fill_in.items():
        if drafter.get(key) is value:
            raise DDTreeConfigError(
                f"{where} has {key}={str(value).lower()} (the 1 + N fill-in block): "
                "method='ddtree' drafts with DSpark's anchor-as-first layout only. "
                "Serve this checkpoint with method='dspark'.")
    return drafter.get("dspark_block_size")  # its type and bound: check_drafter_types


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
    if not is_int(block_size) or block_size < 2:
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
    predicts too).  A ``ddtree_max_depth`` above the drafter's depth is refused
    (:mod:`vllm_ddtree.config`, "Bounds"), and so is a depth below a DSpark checkpoint's
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
