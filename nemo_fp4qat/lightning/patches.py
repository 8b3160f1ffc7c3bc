"""Replacing a library object's method for the length of a run, and putting it back.

Lightning offers no hook where the callback needs one (before a resumed checkpoint's weights load,
right after ``configure_model`` builds the layers, around the training step's loss, and, for NeMo,
before ``MegatronStrategy.load_checkpoint`` reads its tensors), so the callbacks wrap those methods
on the instance. Every wrap goes through :class:`MethodPatches`, which records what it replaced and
restores it in ``teardown``: a second ``fit`` wraps the originals again instead of wrapping wrappers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["MethodPatches"]

_MISSING = object()


class MethodPatches:
    """Instance-level method replacements that can all be undone."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []  # (object, attribute, instance value or _MISSING)

    def patch(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Set ``obj.name = make(original)``; a second patch of the same attribute is a no-op."""
        if self.is_patched(obj, name):
            return
        self._saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, make(getattr(obj, name)))

    def is_patched(self, obj: Any, name: str) -> bool:
        return any(o is obj and n == name for o, n, _ in self._saved)

    def restore(self) -> None:
        """Put every replaced method back (the instance attribute removed if there was none)."""
        for obj, name, before in reversed(self._saved):
            if before is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, before)
        self._saved = []
