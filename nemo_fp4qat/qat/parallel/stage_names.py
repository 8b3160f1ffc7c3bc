"""Layer names across pipeline stages: each megatron-core pipeline stage numbers its transformer layers from 0
(``decoder.layers.0`` on every stage); the whole model's names shift them by the stage's first layer."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["stage_layer_offset", "to_global_name"]


def stage_layer_offset(model: nn.Module) -> int:
    """The global index of this stage's first transformer layer (megatron's ``layer_number`` counts from 1); 0 for
    a model without ``decoder.layers``."""
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    return int(layers[0].layer_number) - 1 if layers is not None and len(layers) else 0


def to_global_name(name: str, offset: int) -> str:
    """A stage's local parameter / module name -> the whole model's (``decoder.layers.<i>`` shifted by ``offset``)."""
    head, sep, rest = name.partition("decoder.layers.")
    if not sep or not offset:
        return name
    idx, dot, tail = rest.partition(".")
    return f"{head}decoder.layers.{int(idx) + offset}{dot}{tail}"
