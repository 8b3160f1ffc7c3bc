"""The process groups a quantizer's statistics are reduced over, and the names of experts across expert-parallel
ranks: one place for what calibration, GPTQ, smoothing, the block scale search, the MoE amax tie and the whole-model
gather each need.

Every lookup reads megatron-core's parallel state only where megatron is already imported and set up
(``sys.modules``): a plain Lightning or Hugging Face run never imports megatron, and its ranks are DDP replicas
(the default, world group, ``None``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "all_reduce_flat",
    "data_parallel_group",
    "expert_data_parallel_group",
    "expert_parallel_group",
    "first_local_expert",
    "global_expert_name",
    "local_expert_name",
    "megatron_parallel_state",
    "same_layers_group",
]


def megatron_parallel_state() -> Any:
    """megatron-core's ``parallel_state`` module when megatron is imported and its model parallelism is set up,
    else None."""
    ps = sys.modules.get("megatron.core.parallel_state")
    return ps if ps is not None and ps.model_parallel_is_initialized() else None


def same_layers_group() -> Any:
    """The ranks that hold the same layers: all of them, except under megatron pipeline parallelism, where each
    stage numbers its own layers from 0 (same names, different layers)."""
    ps = megatron_parallel_state()
    if ps is not None and ps.get_pipeline_model_parallel_world_size() > 1:
        return ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return None  # the default (world) group


def data_parallel_group() -> Any:
    """The ranks that hold the same shard of the same layers: megatron's data-parallel group (with context
    parallelism) when its parallel state is set up, else every rank (DDP replicas)."""
    ps = megatron_parallel_state()
    return ps.get_data_parallel_group(with_context_parallel=True) if ps is not None else None


def expert_parallel_group() -> Any:
    """megatron-core's expert-parallel group when more than one rank shares out the experts (each then holds other
    experts under the same local names), else None."""
    ps = megatron_parallel_state()
    if ps is None or ps.get_expert_model_parallel_world_size() <= 1:
        return None
    return ps.get_expert_model_parallel_group()


def expert_data_parallel_group() -> Any:
    """The ranks that hold the same routed experts under megatron-core expert parallelism (EP > 1), else None."""
    ps = megatron_parallel_state()
    if ps is None or ps.get_expert_model_parallel_world_size() <= 1:
        return None
    getter = getattr(ps, "get_expert_data_parallel_group", None) or ps.get_data_modulo_expert_parallel_group
    return getter()


def first_local_expert(module: nn.Module) -> int:
    """The global index of this rank's first local expert in ``module`` (a megatron-core model with
    ``config.num_moe_experts``); 0 without expert parallelism."""
    ps = megatron_parallel_state()
    if ps is None:
        return 0
    ep = ps.get_expert_model_parallel_world_size()
    if ep <= 1:
        return 0
    return ps.get_expert_model_parallel_rank() * (int(module.config.num_moe_experts) // ep)


def _reindexed_expert(name: str, shift: int) -> tuple[str, int] | None:
    """``...local_experts.<i>...`` with ``i + shift`` as its index, and that index; None outside the experts."""
    if ".local_experts." not in name:
        return None
    head, tail = name.split(".local_experts.", 1)
    index, sep, rest = tail.partition(".")
    new = int(index) + shift
    return f"{head}.local_experts.{new}{sep}{rest}", new


def global_expert_name(name: str, offset: int) -> str:
    """``...local_experts.<i>...`` under its global expert index (``i + offset``)."""
    found = _reindexed_expert(name, offset) if offset else None
    return found[0] if found else name


def local_expert_name(name: str, offset: int, count: int) -> str | None:
    """The inverse of :func:`global_expert_name` on the rank whose ``count`` local experts start at global index
    ``offset``: ``...local_experts.<g>...`` as ``...local_experts.<g - offset>...``, None for another rank's expert;
    a name outside the experts as it is."""
    found = _reindexed_expert(name, -offset)
    if found is None:
        return name
    local_name, local = found
    return local_name if 0 <= local < count else None


def all_reduce_flat(tensors: list[torch.Tensor], op: Any, group: Any) -> list[torch.Tensor]:
    """One collective for many tensors (a per-tensor collective would be one round trip each): concatenated,
    reduced, split back into flat pieces in order."""
    import torch.distributed as dist

    flat = torch.cat([t.flatten() for t in tensors])
    dist.all_reduce(flat, op=op, group=group)
    return list(torch.split(flat, [t.numel() for t in tensors]))
