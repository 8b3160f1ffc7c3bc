"""What differs between transformers 4 and 5 where this package builds a model config itself.

transformers 5 reads a rotary embedding's base from ``rope_parameters`` (``{"rope_type": "default", "rope_theta":
...}``) and ignores a ``rope_theta`` keyword, falling back to the architecture's default base: a config built the
4.x way computes other logits without an error.
"""

from __future__ import annotations

from typing import Any

__all__ = ["rope_fields"]


def rope_fields(theta: float, source: Any = None) -> dict[str, Any]:
    """Config keywords for a default rotary embedding with base ``theta`` in the installed transformers, or
    ``source``'s own (a config of the same transformers) where it has them."""
    given = getattr(source, "rope_parameters", None)
    if isinstance(given, dict):
        return {"rope_parameters": dict(given)}
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": float(theta)}}
    return {"rope_theta": float(theta)}
