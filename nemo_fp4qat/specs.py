"""Configuration specs: the one error every configuration object raises, and the one way a dict becomes one.

Every configuration of the plugin (``QATConfig``, policies and their rules, schedules, calibration, smoothing,
distillation, export, engine plan, monitor thresholds) is built from a dict (YAML, NeMo-Run, the command line)
through :func:`from_fields`, so an unknown field is named with the closest valid one and the list of valid
names, never Python's "unexpected keyword argument"; and each raises :class:`ConfigError` (a ``ValueError``)
naming the field, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = ["ConfigError", "did_you_mean", "from_fields"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value the plugin cannot use; the message names the field, the value and the fix."""


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``valid`` (a name it abbreviates, else a close spelling), or
    nothing."""
    valid = [str(v) for v in valid]
    name = str(name)
    near = [v for v in valid if name and v.startswith(name)] or difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def from_fields(cls: type[T], spec: Any, what: str) -> T:
    """``cls(**spec)`` for a dataclass ``cls`` and a mapping ``spec`` (its ``_target_`` key, from YAML, dropped).

    Raises:
        ConfigError: ``spec`` is not a mapping, or has a field ``cls`` does not.

    Example:
        >>> from_fields(CalibrationConfig, {"num_sample": 64}, "calibration")  # doctest: +SKIP
        ConfigError: Unknown calibration field(s) 'num_sample' (did you mean 'num_samples'?); CalibrationConfig has: ...
    """
    if not (isinstance(spec, dict) or hasattr(spec, "items")):
        raise ConfigError(f"{what} must be a mapping of {cls.__name__} fields, got {type(spec).__name__} {spec!r}.")
    given = {k: v for k, v in dict(spec).items() if k != "_target_"}
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    unknown = [k for k in given if k not in names]
    if unknown:
        listed = ", ".join(f"{k!r}{did_you_mean(k, names)}" for k in unknown)
        raise ConfigError(f"Unknown {what} field(s) {listed}; {cls.__name__} has: {', '.join(names)}.")
    return cls(**given)


def optional_spec(cls: type[T], spec: Any, what: str, hint: str) -> T | None:
    """The optional config ``spec`` names: ``None`` / ``False`` is off, ``True`` the defaults, a ``cls`` itself, or a
    mapping of its fields (:func:`from_fields`). Each config's own shorthands (an alpha, a mode name) are resolved
    by its ``resolve_spec`` before it calls this.

    Raises:
        ConfigError: anything else, as ``"{what}={spec!r} is not understood; {hint}"``.
    """
    if spec is None or spec is False:
        return None
    if spec is True:
        return cls()
    if isinstance(spec, cls):
        return spec
    if not (isinstance(spec, dict) or hasattr(spec, "items")):
        raise ConfigError(f"{what}={spec!r} is not understood; {hint}")
    return from_fields(cls, spec, what)
