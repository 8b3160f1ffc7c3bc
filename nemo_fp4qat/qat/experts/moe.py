"""Mixture-of-experts layers: routers, experts and shared experts by name, and the scales experts share.

One table of names covers Hugging Face sequential MoE blocks (Qwen2/3-MoE, DeepSeek: ``mlp.gate``,
``mlp.experts.N.*``, ``mlp.shared_expert(s).*``; Mixtral: ``block_sparse_moe.gate`` /
``block_sparse_moe.experts.N.w1|w2|w3``) and megatron-core's MoE layer (``mlp.router``,
``mlp.experts.local_experts.N.linear_fc1|linear_fc2``, ``mlp.shared_experts.*``).

The serving engines run a layer's experts as one fused MoE GEMM (TensorRT-LLM, vLLM and SGLang alike): one
quantization format for all experts of a layer, and one input scale per projection for all of them (vLLM takes the
max of the experts' ``input_scale``). So experts train with their input amax tied to the layer's max (what modelopt
0.47's ``sync_moe_expert_amax`` does for Hugging Face blocks; modelopt 0.37 and megatron-core's experts under expert
parallelism leave them apart), every expert holds an amax even if no calibration token reached it, and a policy that
puts one layer's experts in different formats, or quantizes a router, is refused before anything runs.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from nemo_fp4qat.architectures import expert_classes, module_patterns
from nemo_fp4qat.qat.experts.fused import unsupported_fused_experts
from nemo_fp4qat.qat.parallel.groups import expert_parallel_group
from nemo_fp4qat.specs import ConfigError

__all__ = [
    "EXPERT_PATTERNS",
    "ROUTER_PATTERNS",
    "SHARED_EXPERT_PATTERNS",
    "check_moe_formats",
    "expert_projections",
    "is_router",
    "module_standing_for",
    "refuse_fused_experts",
    "refuse_grouped_experts",
    "split_expert_name",
    "tie_expert_amax",
]

# Routers (and Qwen2-MoE's shared-expert gate): the token-to-expert decision, kept in 16 bits by every policy; routed
# experts, one module per expert (HF ``experts.N.*``, megatron-core ``experts.local_experts.N.*``) or a fused
# container's projections; shared experts (every token goes through them: a dense MLP beside the routed experts).
# Each family's names: architectures.py.
ROUTER_PATTERNS: tuple[str, ...] = module_patterns("router")
EXPERT_PATTERNS: tuple[str, ...] = module_patterns("experts")
SHARED_EXPERT_PATTERNS: tuple[str, ...] = module_patterns("shared_experts")

# "<layer>.experts[.local_experts].<index>.<projection>"
_EXPERT_NAME = re.compile(r"^(?P<layer>.+\.experts)\.(?:local_experts\.)?(?P<index>\d+)\.(?P<proj>[^.]+)$")


def is_router(name: str) -> bool:
    """A MoE router (or shared-expert gate) by module name."""
    return any(fnmatch.fnmatchcase(name, p) for p in ROUTER_PATTERNS)


def split_expert_name(name: str) -> tuple[str, int, str] | None:
    """``(experts container, local expert index, projection)`` of a routed expert's linear, else None."""
    m = _EXPERT_NAME.match(name)
    return (m["layer"], int(m["index"]), m["proj"]) if m else None


def expert_projections(names: Iterable[str]) -> dict[tuple[str, str], list[str]]:
    """``(experts container, projection)`` -> the module names of that projection in every expert, in expert order.

    Example:
        >>> expert_projections(["m.experts.1.w1", "m.experts.0.w1", "m.experts.0.w2"])
        {('m.experts', 'w1'): ['m.experts.0.w1', 'm.experts.1.w1'], ('m.experts', 'w2'): ['m.experts.0.w2']}
    """
    found: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for name in names:
        parts = split_expert_name(name)
        if parts is not None:
            found.setdefault((parts[0], parts[2]), []).append((parts[1], name))
    return {key: [n for _, n in sorted(v)] for key, v in sorted(found.items())}


def module_standing_for(name: str, modules: Iterable[str]) -> str | None:
    """The module of ``modules`` that a finding about ``name`` stands for: ``name`` itself, else the first module
    inside it (an expert's finding, ``<layer>.experts.<i>``, names the expert, not its linears), else, for an expert
    named by its global index, the first module inside its layer's experts (megatron-core names them
    ``experts.local_experts.<local index>``, and under expert parallelism another rank may hold expert ``i``: every
    expert of a layer falls under one policy group); a fused container's expert (``<layer>.experts.<i>.down_proj``)
    stands for its projection's row (``<layer>.experts.down_proj``)."""
    names = set(modules)
    if name in names:
        return name
    parts = split_expert_name(name)  # a fused container's expert: its projection's policy row
    if parts is not None and f"{parts[0]}.{parts[2]}" in names:
        return f"{parts[0]}.{parts[2]}"
    inside = sorted(n for n in names if n.startswith(f"{name}."))
    if not inside:
        head, _, index = name.rpartition(".")
        if index.isdigit() and head.endswith(".experts"):
            inside = sorted(n for n in names if n.startswith(f"{head}."))
    return inside[0] if inside else None


def refuse_fused_experts(model: nn.Module, full_precision: Any) -> None:
    """Refuse a model holding experts this plugin does not quantize (a refused family's, by the family table, or
    fused in a layout of their own: :func:`~nemo_fp4qat.qat.experts.fused.unsupported_fused_experts`) unless
    ``full_precision(name)`` says the policy keeps that module in 16 bits on purpose. transformers 5's standard fused
    experts (``gate_up_proj`` / ``up_proj`` and ``down_proj``) are policy rows of their own.

    Raises:
        ConfigError: naming the module, what it holds, why, and the ways forward.
    """
    for name, what in unsupported_fused_experts(model).items():
        if not full_precision(name):
            raise ConfigError(
                f"{name} ({what}): the policy would quantize these experts but this plugin cannot, so they would "
                "silently train in 16 bits. Keep them in 16 bits on purpose with a policy rule that matches the "
                f"module and gives it no format, e.g. {{patterns: ['*.{name.rsplit('.', 1)[-1]}'], weight: null, "
                "group: experts}, or use modelopt's own mtq.quantize for this model."
            )


# megatron-core's grouped expert containers (``moe_grouped_gemm=True``): all of a layer's experts in grouped GEMMs
# (``TEGroupedMLP`` and its ``InferenceGroupedMLP``: Transformer Engine's grouped linears, ``weight0`` ...
# ``weight{E-1}``; megatron-core <= 0.15's ``GroupedMLP``: ``weight1`` / ``weight2`` of every expert side by side),
# not one linear layer per expert
GROUPED_EXPERT_CONTAINERS = expert_classes("grouped")


def grouped_experts_error(what: str) -> ConfigError:
    """The refusal of grouped experts, ``what`` naming where they were found."""
    return ConfigError(
        f"{what}: megatron-core's grouped experts (moe_grouped_gemm=True: GroupedMLP, or TEGroupedMLP under "
        "Transformer Engine) hold a layer's experts in grouped GEMMs, not one linear layer per expert, which is what "
        "this plugin's policies quantize, calibrate (one input scale per projection across experts), export and "
        "validate (modelopt 0.47 puts per-expert weight quantizers into Transformer Engine's grouped linears, but "
        "this plugin does not tie, export or validate them yet); they would train in 16 bits while the policy says "
        "FP4. Set moe_grouped_gemm=False (the model "
        "config or recipe: cfg.model.moe_grouped_gemm = False builds SequentialMLP, one linear per expert, the same "
        "parameters), or keep the experts in 16 bits on purpose with a policy rule that matches them and gives no "
        "format, e.g. {patterns: ['*.mlp.experts*'], weight: null, group: experts}."
    )


def refuse_grouped_experts(model: nn.Module, full_precision: Any) -> None:
    """Refuse a megatron-core model whose experts are grouped (:data:`GROUPED_EXPERT_CONTAINERS`) unless
    ``full_precision(name)`` says the policy keeps them in 16 bits on purpose.

    Raises:
        ConfigError: naming the container and the ways forward.
    """
    for name, module in model.named_modules():
        if type(module).__name__ in GROUPED_EXPERT_CONTAINERS and not full_precision(name):
            raise grouped_experts_error(f"{name} ({type(module).__name__})")


def check_moe_formats(rows: Iterable[Any]) -> None:
    """Refuse what the engines' fused MoE kernels cannot run: a quantized router, or one layer's experts (or one
    projection of them) in different formats. ``rows``: a policy table's :class:`~.policy.PolicyRow` s.

    Raises:
        ConfigError: naming the modules and the fix.
    """
    rows = [r for r in rows if r.quantizable]
    routers = [r for r in rows if is_router(r.module) and r.quantized]
    if routers:
        r = routers[0]
        raise ConfigError(
            f"The policy quantizes the MoE router {r.module!r} ({r.weight} weights, {r.input} inputs; "
            f"{len(routers)} router(s) in all, matched by {r.rule}). Routers stay in 16 bits: the engines run them "
            "unquantized and a quantized router changes which experts a token reaches. Give that rule weight: null, "
            "or narrow its patterns so they leave the routers out."
        )
    by_layer: dict[str, dict[str, set[tuple[str, str]]]] = {}
    for r in rows:
        parts = split_expert_name(r.module)
        if parts is not None:
            by_layer.setdefault(parts[0], {}).setdefault(parts[2], set()).add((r.weight, r.input))
    for layer, projections in sorted(by_layer.items()):
        formats = set().union(*projections.values())
        if len(formats) > 1:
            per = {p: sorted(f"{w}/{i}" for w, i in fs) for p, fs in sorted(projections.items())}
            raise ConfigError(
                f"The experts of {layer!r} would train in different formats ({per}, weight/input). The engines run "
                "a layer's experts as one fused MoE GEMM in one format (gate and up fused, one input scale for all "
                "experts): give every expert and projection of a layer the same format (one rule for '*.experts.*')."
            )


def tie_expert_amax(model: nn.Module) -> int:
    """Give each projection's input quantizers, across all experts of a layer, one amax: their max (over the
    expert-parallel group too), and an expert weight quantizer that calibration left without an amax (no token
    reached the expert) the amax of its weight, as modelopt's ``sync_moe_expert_amax`` does. Returns the number of
    projections tied.

    Raises:
        RuntimeError: a projection none of whose experts holds an input amax (calibration reached no expert of that
            layer), naming it: it would deploy with no input scale.
    """
    import torch.distributed as dist

    modules = dict(model.named_modules())
    ep_group = expert_parallel_group()
    tied: list[tuple[str, list[Any]]] = []
    linears = [n for n, m in modules.items() if hasattr(m, "weight_quantizer") or hasattr(m, "input_quantizer")]
    for (layer, proj), names in expert_projections(linears).items():
        for name in names:
            _fill_weight_amax(modules[name], name)
        quantizers = [getattr(modules[n], "input_quantizer", None) for n in names]
        quantizers = [q for q in quantizers if q is not None and q.is_enabled]
        if not quantizers:
            continue
        amaxes = [getattr(q, "_amax", None) for q in quantizers]
        have = [a for a in amaxes if isinstance(a, torch.Tensor)]
        if any(a.numel() != 1 for a in have):
            continue  # per-channel input scales (not one per tensor) are not what the fused kernels share
        if not have and ep_group is None:
            raise RuntimeError(
                f"No expert of {layer!r} got an input amax for {proj!r}: calibration reached none of them. Calibrate "
                "on more (or more varied) samples, or keep this layer's experts in 16 bits."
            )
        tied.append((f"{layer}.*.{proj}", quantizers))
    if not tied:
        return 0
    local = torch.stack([_max_or_zero(qs) for _, qs in tied])
    if ep_group is not None:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=ep_group)
    for (where, quantizers), value in zip(tied, local, strict=True):
        if float(value) <= 0.0:
            raise RuntimeError(
                f"No expert of {where!r} on any expert-parallel rank got an input amax: calibration reached none of "
                "them. Calibrate on more (or more varied) samples, or keep this layer's experts in 16 bits."
            )
        for q in quantizers:
            amax = getattr(q, "_amax", None)
            if isinstance(amax, torch.Tensor):
                amax.data.copy_(value.to(amax.dtype).reshape(amax.shape))
            else:
                q.amax = value.detach().clone()
    return len(tied)


def _max_or_zero(quantizers: list[Any]) -> torch.Tensor:
    values = [q._amax.detach().float().reshape(()) for q in quantizers if isinstance(getattr(q, "_amax", None),
                                                                                     torch.Tensor)]  # fmt: skip
    return torch.stack(values).amax() if values else torch.zeros(())


def _fill_weight_amax(module: nn.Module, name: str) -> None:
    """An enabled per-tensor weight quantizer without an amax gets its weight's absolute max (max calibration)."""
    q = getattr(module, "weight_quantizer", None)
    if q is None or not q.is_enabled or isinstance(getattr(q, "_amax", None), torch.Tensor):
        return
    if getattr(q, "axis", None) is not None:
        raise RuntimeError(
            f"Expert linear {name!r} has no weight amax after calibration (no token reached it) and a per-channel "
            "weight format; calibrate on more samples so every expert is reached."
        )
    q.amax = module.weight.detach().abs().amax().float()
