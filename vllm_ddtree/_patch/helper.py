"""Record-and-undo helper for the few changes vllm-ddtree makes to vLLM.

Every change goes through a :class:`PatchSet`, which remembers the original
value (or its absence) and restores everything, newest first, on
:meth:`PatchSet.undo`. A second change of the same attribute in one set is
refused, and :func:`check_signature` refuses to wrap a callable whose
signature drifted from the one the wrapper was written for.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

_ABSENT = object()


@dataclass
class _Step:
    describe: str
    undo: Callable[[], None]
    key: tuple[int, str] | None = None


class PatchSet:
    """Changes to vLLM objects that can be undone (LIFO)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._steps: list[_Step] = []

    @property
    def active(self) -> bool:
        return bool(self._steps)

    def changes(self) -> list[str]:
        """Descriptions of the recorded changes, oldest first."""
        return [s.describe for s in self._steps]

    def _claim(self, key: tuple[int, str], describe: str) -> None:
        if any(s.key == key for s in self._steps):
            raise RuntimeError(f"[{self.name}] refusing to patch {describe} twice")

    def setattr(self, owner: Any, name: str, value: Any) -> Any:
        """``setattr(owner, name, value)``; returns the previous value (or None)."""
        describe = f"{getattr(owner, '__qualname__', type(owner).__name__)}.{name}"
        key = (id(owner), name)
        self._claim(key, describe)
        # Classes: look in the class's own __dict__ so inherited attributes are
        # deleted, not copied down, on undo.
        if isinstance(owner, type):
            original = owner.__dict__.get(name, _ABSENT)
        else:
            original = getattr(owner, name, _ABSENT)

        def undo() -> None:
            if original is _ABSENT:
                if name in getattr(owner, "__dict__", {}):
                    delattr(owner, name)
            else:
                setattr(owner, name, original)

        setattr(owner, name, value)
        self._steps.append(_Step(describe, undo, key))
        return None if original is _ABSENT else original

    def setitem(
        self, mapping: MutableMapping[str, Any], key: str, value: Any, describe: str
    ) -> None:
        """``mapping[key] = value``, restoring the old item (or deleting it) on undo."""
        claim = (id(mapping), key)
        self._claim(claim, describe)
        original = mapping.get(key, _ABSENT)

        def undo() -> None:
            if original is _ABSENT:
                mapping.pop(key, None)
            else:
                mapping[key] = original

        mapping[key] = value
        self._steps.append(_Step(describe, undo, claim))

    def on_undo(self, describe: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` at this point of the undo sequence (LIFO)."""
        self._steps.append(_Step(describe, fn))

    def undo(self) -> None:
        """Restore every recorded change, newest first. Idempotent."""
        errors: list[BaseException] = []
        while self._steps:
            step = self._steps.pop()
            try:
                step.undo()
            except Exception as e:  # keep restoring the rest
                errors.append(e)
        if errors:
            raise RuntimeError(f"[{self.name}] undo failed: {errors!r}") from errors[0]


def check_signature(
    fn: Callable[..., Any], expected: tuple[str, ...], target: str, versions: str
) -> None:
    """Refuse to wrap ``fn`` unless its parameter names are exactly ``expected``.

    ``"*args"``/``"**kwargs"`` spell variadic parameters.
    """
    params = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            params.append(f"*{p.name}")
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            params.append(f"**{p.name}")
        else:
            params.append(p.name)
    if tuple(params) != expected:
        raise RuntimeError(
            f"vllm-ddtree cannot patch {target}: its signature is "
            f"({', '.join(params)}), expected ({', '.join(expected)}). This vLLM "
            f"differs from the tested versions ({versions}); install one of those."
        )
