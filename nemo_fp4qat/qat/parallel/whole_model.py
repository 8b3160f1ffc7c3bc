"""The whole model of a tensor-, pipeline- or expert-parallel megatron-core run, assembled on one rank for the export.

Under tensor parallelism each rank holds a shard of every linear layer (and of the vocabulary); under pipeline
parallelism a stage of layers; under expert parallelism some of each MoE layer's experts, under local indices. The
end-of-training export and its validation need the model as one piece, so every rank sends what it trained
(weights, quantizer buffers and schedule state, under the whole model's layer and expert names) to global rank 0,
which builds the same model at tensor, pipeline and expert size 1 from the run's own model config and loads the
merged tensors into it. Megatron-core can reshard through a distributed checkpoint, but that is a collective load
on every rank; here only rank 0 holds the result, so the shards are merged by hand, with megatron-core's own
partition attributes (``tensor_model_parallel``, ``partition_dim``) saying how.

While rank 0 builds and exports that model, megatron-core's parallel state and modelopt's distributed helpers
must describe a run of one process (:func:`alone_on_rank_0`); otherwise layers would be built as shards and
modelopt's exporter would wait for the other ranks to merge them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from nemo_fp4qat.qat.parallel.groups import first_local_expert, global_expert_name
from nemo_fp4qat.qat.parallel.stage_names import stage_layer_offset, to_global_name

__all__ = ["alone_on_rank_0", "at_size_one", "gather_whole_model", "merge_tensor_parallel_shards", "sharded_over_ranks"]

_QUANTIZER_SUFFIXES = ("weight_quantizer", "input_quantizer", "output_quantizer")
_ALONE: Any = None  # a process group of global rank 0 alone (gloo), created collectively by gather_whole_model


def sharded_over_ranks() -> bool:
    """Whether the run splits the model over ranks (tensor, pipeline or expert parallelism); False without
    megatron's parallel state."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return False
    return ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() > 1 or (
        ps.get_expert_model_parallel_world_size() > 1
    )


def at_size_one(config: Any) -> Any:
    """``config`` (a megatron-core model config: Bridge's provider, NeMo's GPTConfig; edited in place, pass a copy)
    for the whole model on one rank: tensor and pipeline size 1, no sequence parallelism, and the vocabulary padded
    as the run padded it (its divisor times the run's tensor-parallel size)."""
    tp = config.tensor_model_parallel_size or 1
    config.make_vocab_size_divisible_by = config.make_vocab_size_divisible_by * tp
    config.tensor_model_parallel_size = config.pipeline_model_parallel_size = 1
    if getattr(config, "expert_model_parallel_size", 1) not in (None, 1):
        config.expert_model_parallel_size = 1
    if getattr(config, "expert_tensor_parallel_size", None) not in (None, 1):
        config.expert_tensor_parallel_size = 1
    config.sequence_parallel = False
    return config


def _global_controller_state(state: dict[str, Any], offset: int, expert_offset: int = 0) -> dict[str, Any]:
    out = dict(state)
    out["current"] = {global_expert_name(to_global_name(m, offset), expert_offset): f
                      for m, f in state["current"].items()}  # fmt: skip
    out["ramps"] = {global_expert_name(to_global_name(q, offset), expert_offset): r
                    for q, r in state["ramps"].items()}  # fmt: skip
    return out


@contextlib.contextmanager
def _world_of_one() -> Iterator[None]:
    """The default (world) group as a group of this rank alone: modelopt's megatron exporter barriers and gathers on
    it unconditionally, which would wait for ranks that are not exporting. Calls naming another group pass through."""
    import torch.distributed as dist

    saved = {n: getattr(dist, n) for n in ("barrier", "all_gather_object", "get_world_size", "get_rank")}

    def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
        if group is None:
            out[0] = obj
            return
        saved["all_gather_object"](out, obj, group=group)

    dist.barrier = lambda group=None, *a, **k: None if group is None else saved["barrier"](group, *a, **k)
    dist.all_gather_object = all_gather_object
    dist.get_world_size = lambda group=None: 1 if group is None else saved["get_world_size"](group)
    dist.get_rank = lambda group=None: 0 if group is None else saved["get_rank"](group)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def alone_on_rank_0() -> Iterator[None]:
    """Inside the block, on global rank 0, modelopt's distributed helpers report one process and megatron-core's
    parallel state holds groups of rank 0 alone (every size 1, every rank 0), so a model built or exported there is
    whole and talks to no other rank, and the default (world) group is one of this rank alone. Restored on exit.
    megatron-core keeps its parallel state in module globals with no public way to describe another layout for a
    while, hence the swap."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from modelopt.torch.utils import distributed as mdist

    saved: dict[str, Any] = {}
    if _ALONE is not None and ps.model_parallel_is_initialized():
        for name, value in vars(ps).items():
            if not name.startswith("_"):
                continue
            if isinstance(value, dist.ProcessGroup):
                saved[name] = value
            elif name.endswith("_GLOBAL_RANKS") and isinstance(value, list):
                saved[name] = value
            elif name.startswith("_MPU_") and value is not None:
                saved[name] = value
        for name, value in saved.items():
            if isinstance(value, dist.ProcessGroup):
                setattr(ps, name, _ALONE)
            elif isinstance(value, list):
                setattr(ps, name, [0])
            else:
                setattr(ps, name, 1 if name.endswith("_WORLD_SIZE") else 0)
    original = mdist.is_initialized
    mdist.is_initialized = lambda: False
    try:
        with _world_of_one() if dist.is_initialized() and dist.get_world_size() > 1 else contextlib.nullcontext():
            yield
    finally:
        mdist.is_initialized = original
        for name, value in saved.items():
            setattr(ps, name, value)


def _owner_weight(key: str) -> str | None:
    """``a.linear_fc1.weight`` for a buffer of that layer's quantizers (``a.linear_fc1.weight_quantizer._amax``)."""
    for suffix in _QUANTIZER_SUFFIXES:
        head, sep, _ = key.partition(f".{suffix}.")
        if sep:
            return f"{head}.weight"
    return None


def _partition_rules(
    module: nn.Module, offset: int, gated: bool, expert_offset: int = 0
) -> dict[str, tuple[int, bool]]:
    """Whole-model name -> (the dimension its tensor-parallel shards concatenate along, whether it is a gated
    ``linear_fc1``, whose shards each hold a slice of the gate then a slice of the up projection). Routed experts'
    shards are those of the expert tensor-parallel group."""
    rules = {}
    for name, p in module.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            is_fc1 = name.rpartition(".")[0].endswith("linear_fc1")
            rules[global_expert_name(to_global_name(name, offset), expert_offset)] = (int(p.partition_dim),
                                                                                       gated and is_fc1)  # fmt: skip
    return rules


def _concat(shards: list[torch.Tensor], dim: int, gated: bool) -> torch.Tensor:
    if not gated:
        return torch.cat(shards, dim)
    halves = [s.chunk(2, dim) for s in shards]  # each shard: [gate slice; up slice]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)


def merge_tensor_parallel_shards(
    shards: list[dict[str, torch.Tensor]], rules: dict[str, tuple[int, bool]]
) -> dict[str, torch.Tensor]:
    """One stage's tensors at tensor-parallel size 1 from its shards (in tensor-parallel rank order).

    Partitioned parameters concatenate along their partition dimension (a gated ``linear_fc1`` gate slices first,
    then up slices). Other tensors (norms, per-tensor amax synced over the group) must be equal on every rank
    (a module's serialized ``_extra_state`` is taken from the first). A
    quantizer buffer that differs across ranks follows its layer's weight: per output channel of a column-parallel
    weight, per input channel of a row-parallel one.

    Raises:
        ValueError: a tensor differs across ranks and follows no partitioned weight, or its merged shape does not
            match that weight's.
    """
    if len(shards) == 1:
        return dict(shards[0])
    merged: dict[str, torch.Tensor] = {}
    for key in shards[0]:
        if key in rules:
            merged[key] = _concat([s[key] for s in shards], *rules[key])
    for key in shards[0]:
        if key in rules:
            continue
        parts = [s[key] for s in shards]
        if key.endswith("._extra_state") or all(torch.equal(parts[0], p) for p in parts[1:]):
            merged[key] = parts[0]
            continue
        owner = _owner_weight(key)
        if owner not in rules or parts[0].dim() == 0:
            raise ValueError(
                f"{key}: its tensor-parallel shards differ, and it is neither partitioned nor a quantizer buffer of a "
                "partitioned layer; the whole model cannot be assembled from them."
            )
        dim, gated = rules[owner]
        along = 0 if dim == 0 else parts[0].dim() - 1  # output channels / input channels
        out = _concat(parts, along, gated and dim == 0)
        if out.shape[along] != merged[owner].shape[dim]:
            raise ValueError(
                f"{key}: its tensor-parallel shards differ and, concatenated ({tuple(out.shape)}), do not follow "
                f"{owner} ({tuple(merged[owner].shape)}); the whole model cannot be assembled from them."
            )
        merged[key] = out
    return merged


def gather_whole_model(build_whole: Callable[[], nn.Module], module: nn.Module, controller: Any) -> nn.Module | None:
    """The whole model of a tensor-, pipeline- and/or expert-parallel run, assembled on global rank 0 (``None``
    elsewhere).

    A collective: every rank calls it. Data-parallel rank 0 of each (tensor, pipeline) position sends its dense
    tensors, and expert-data-parallel rank 0 of each (expert tensor, expert, pipeline) position its routed experts
    (weights and quantizer buffers, under the whole model's layer and expert names), with how its parameters are
    partitioned and its schedule state, to global rank 0, which merges each stage's tensor-parallel shards and each
    expert rank's expert-tensor-parallel shards (:func:`merge_tensor_parallel_shards`), builds the model at tensor,
    pipeline and expert size 1 with ``build_whole`` (called inside :func:`alone_on_rank_0`: the run's own model
    config at size 1, with the vocabulary padded as the run padded it), inserts the quantizers from the run's
    policy, puts every stage's quantizers in their trained formats and loads every tensor. The result holds exactly
    what the ranks trained, so the export and its validation see every layer. Rank 0 needs the host memory of the
    whole model; export it inside :func:`alone_on_rank_0` too.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    global _ALONE
    ep = ps.get_expert_model_parallel_world_size()
    if _ALONE is None:
        _ALONE = dist.new_group([0], backend="gloo")  # every rank creates it, only rank 0 is in it
    offset, expert_offset = stage_layer_offset(module), first_local_expert(module)
    # one copy of each shard: the dense layers from data-parallel rank 0 of each (tensor, pipeline) position; under
    # expert parallelism the routed experts (under their global index) from expert-data-parallel rank 0 of each
    # (expert tensor, expert, pipeline) position
    send_dense = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    send_experts = ps.get_expert_data_parallel_rank() == 0 if ep > 1 else send_dense
    payload = None
    if send_dense or send_experts:
        gated = bool(getattr(module.config, "gated_linear_unit", False))
        payload = {"dense": {}, "experts": {}}
        for k, v in module.state_dict().items():
            if isinstance(v, torch.Tensor) and (send_experts if ".local_experts." in k else send_dense):
                part = "experts" if ".local_experts." in k else "dense"
                payload[part][global_expert_name(to_global_name(k, offset), expert_offset)] = v.detach().cpu()
        payload.update(
            rules=_partition_rules(module, offset, gated, expert_offset),
            controller=_global_controller_state(controller.state_dict(), offset, expert_offset),
            stage=ps.get_pipeline_model_parallel_rank(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank() if ep > 1 else 0,
            etp_rank=ps.get_expert_tensor_parallel_rank() if ep > 1 else ps.get_tensor_model_parallel_rank(),
        )
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    sent = [p for p in gathered if p is not None]
    tensors: dict[str, torch.Tensor] = {}
    # each stage's dense layers merged over tensor parallelism; each (stage, expert rank)'s experts over expert
    # tensor parallelism
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for p in sent:
        if p["dense"]:
            groups.setdefault(("dense", p["stage"], 0), []).append(p)
        if p["experts"]:
            groups.setdefault(("experts", p["stage"], p["ep_rank"]), []).append(p)
    for (part, _stage, _ep_rank), shards in groups.items():
        shards.sort(key=lambda p: p["tp_rank"] if part == "dense" else p["etp_rank"])
        tensors.update(merge_tensor_parallel_shards([s[part] for s in shards], shards[0]["rules"]))
    # a (stage, expert rank)'s payloads share its schedule state; their union names every module once
    state = dict(sent[0]["controller"])
    state["current"] = {m: f for p in sent for m, f in p["controller"]["current"].items()}
    state["ramps"] = {q: r for p in sent for q, r in p["controller"]["ramps"].items()}

    with alone_on_rank_0(), torch.random.fork_rng(devices=[]):  # building initializes weights: keep the run's RNG
        whole = build_whole()
        whole = whole.to(next(module.parameters()).dtype)
        rebuilt = type(controller)(
            policy=controller.policy,
            schedule=controller.schedule,
            calibration=controller.calibration,
            share_fused_amax=controller.share_fused_amax,
        )
        rebuilt.total_steps = controller.total_steps
        rebuilt.prepare(whole)
        rebuilt.sync_to_checkpoint(whole, state, tensors)
    whole.load_state_dict(tensors, strict=True)
    return whole.eval()
