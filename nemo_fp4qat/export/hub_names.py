"""The in-memory module of a unified HF checkpoint's module name.

transformers 5 saves a model in its hub checkpoint's layout: ``save_pretrained`` (which modelopt's exporter calls)
reverses the conversion mapping ``from_pretrained`` applies, so an exported name can differ from the module that
trained it (Mixtral's ``block_sparse_moe.experts.<i>.w1`` / ``w3`` / ``w2`` for ``mlp.experts.gate_up_proj`` and
``down_proj``; Laguna's ``shared_expert`` for ``shared_experts``). transformers' own mapping is read here, forwards,
so the validation finds the trained weight of every exported layer without a table of its own to keep in step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

__all__ = ["model_name_resolver", "model_tensor_resolver"]

# the leaf of an expert's first fused projection by its place among the converter's sources (gate, then up)
_GATED_LEAVES = ("gate_proj", "up_proj")


def _conversions(model: nn.Module, prefixes: bool = False) -> tuple[list[Any], list[Any]]:
    """transformers' (renamings, converters) for ``model``, its prefix changes among the renamings with
    ``prefixes``; none where transformers has no mapping (4.x)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter
    except ImportError:
        return [], []
    try:
        mapping = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # a model transformers does not know (megatron-core, plain torch)
        return [], []
    mapping = [m for m in mapping if prefixes or not isinstance(m, PrefixChange)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    return [m for m in mapping if not isinstance(m, WeightConverter)], converters


def model_name_resolver(model: nn.Module) -> Callable[[str], str]:
    """A function from an exported module name to the name of the module that holds it in ``model``: the name
    renamed as ``from_pretrained`` would load it, an expert linear merged into a fused projection named
    ``<container>.experts.<i>.gate_proj`` / ``up_proj`` / ``down_proj`` (what
    :func:`~nemo_fp4qat.qat.experts.fused.fused_expert_reference` reads). Identity where transformers has no
    mapping."""
    # a prefix change (Qwen3.5's ``model.language_model.`` on the hub) is applied on save or not, depending on how the
    # model was made: the name is read both ways, and the one the model holds wins
    ways = [_conversions(model, prefixes=True), _conversions(model)]
    if not any(renamings or converters for renamings, converters in ways):
        return lambda name: name
    from transformers.core_model_loading import rename_source_key

    held = {n for n, _ in model.named_modules()}

    def resolve(name: str) -> str:
        found = [one(name, renamings, converters) for renamings, converters in ways]
        return next((f for f in found if f in held or f.rpartition(".")[0].rpartition(".")[0] in held), found[0])

    def one(name: str, renamings: list[Any], converters: list[Any]) -> str:
        key, _ = rename_source_key(f"{name}.weight", renamings, [])
        for converter in converters:
            _, pattern = rename_source_key(key, [], [converter])
            if pattern is None:
                continue
            target = converter.target_patterns[0].rstrip(".").rpartition(".")[2]
            place = converter.source_patterns.index(pattern)
            prefix = key.rpartition(".")[0].rpartition(".")[0]  # "<container>.experts.<i>"
            proj = _GATED_LEAVES[place] if target == "gate_up_proj" and place < 2 else target
            return f"{prefix}.{proj}"
        return key.rpartition(".")[0]

    return resolve


def model_tensor_resolver(model: nn.Module) -> Callable[[str], str]:
    """A function from an exported tensor's name to the name ``model`` holds it by, for renamings that reach the
    tensor's own name (MiMo-V2's ``attention_sink_bias`` for ``sinks``, Ernie 4.5's ``moe_statics`` moved under the
    router); the name itself where no renaming gives one ``model`` holds."""
    ways = [_conversions(model, prefixes=True)[0], _conversions(model)[0]]
    if not any(ways):
        return lambda name: name
    from transformers.core_model_loading import rename_source_key

    held = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}

    def resolve(name: str) -> str:
        found = [rename_source_key(name, renamings, [])[0] for renamings in ways]
        return next((f for f in found if f in held), name)

    return resolve
