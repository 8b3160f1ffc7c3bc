"""Fused expert containers: all of a MoE layer's experts in one 3-D weight per projection.

transformers 5 holds every mixture-of-experts model's experts this way (``Qwen3MoeExperts.gate_up_proj [E, 2F, H]``
and ``down_proj [E, H, F]``; NemotronH's non-gated ``up_proj [E, F, H]``). modelopt (>= 0.47) quantizes them with
its fused-expert wrappers: one weight quantizer per expert (``gate_up_proj_weight_quantizers.<i>``) and one input
quantizer per projection shared by every expert (``gate_up_proj_input_quantizer``, the one input scale the
engines' fused MoE kernels take), and its unified HF export writes them as per-expert linears
(``experts.<i>.gate_proj`` / ``up_proj`` / ``down_proj``).

This plugin files each fused projection as one policy row named ``<container>.<projection>``
(``model.layers.0.mlp.experts.gate_up_proj``): rules match it like a linear layer's name, and this module maps it to
modelopt's quantizer names and back, and an exported expert linear to the trained weight it came from.

gpt-oss holds its experts transposed (``GptOssExperts.gate_up_proj [E, H, 2F]``, gate and up interleaved, with
biases): modelopt's ``_QuantGptOssExperts`` gives each projection one weight quantizer for every expert
(``gate_up_proj_weight_quantizer``, quantizing the weight transposed, per block along the contraction) and one input
quantizer; the export writes gpt-oss's own MXFP4 layout (:mod:`nemo_fp4qat.export.gpt_oss_mxfp4`). Llama-4's
transposed experts, DBRX's and GraniteMoe's are not handled here and are refused by name where a policy would
quantize them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from nemo_fp4qat.architectures import expert_classes, refused_classes

__all__ = [
    "TRANSPOSED_EXPERTS",
    "FusedExperts",
    "expert_weight_quantizers",
    "fused_expert_containers",
    "fused_expert_reference",
    "fused_expert_slot",
    "is_fused_projection",
    "is_transposed_experts",
    "quantizer_glob",
    "quantizer_owner",
    "run_experts_eagerly",
    "unsupported_fused_experts",
]

# "<container>.experts.<projection>": a fused projection's policy name (per-expert linears carry an index between)
_FUSED_NAME = re.compile(r"^(?P<container>.+\.experts)\.(?P<proj>gate_up_proj|up_proj|down_proj)$")
# modelopt's fused-expert quantizers: "<container>.<projection>_weight_quantizers.<i>" / "..._input_quantizer"
_FUSED_QUANTIZER = re.compile(
    r"^(?P<container>.+\.experts)\.(?P<proj>gate_up_proj|up_proj|down_proj)_(?P<kind>weight|input)_quantizers?(\.\d+)?$"
)
# "<container>.experts.<i>.<projection>": an exported expert linear
_EXPORTED_EXPERT = re.compile(r"^(?P<container>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")
# transposed containers ([E, in, out]) with one weight quantizer per projection for every expert (modelopt's
# ``_QuantGptOssExperts``), which this plugin formats; those with wrappers of modelopt's own that it does not
# (architectures.py)
TRANSPOSED_EXPERTS = expert_classes("transposed", refused=False)
_REFUSED = refused_classes()


@dataclass(frozen=True)
class FusedExperts:
    """One fused expert container: its module name, expert count and fused projections (in forward order)."""

    name: str
    num_experts: int
    projections: tuple[str, ...]

    @property
    def gated(self) -> bool:
        return self.projections[0] == "gate_up_proj"

    def projection_names(self) -> list[str]:
        return [f"{self.name}.{p}" for p in self.projections]


def is_transposed_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transposed expert container (gpt-oss's), before or after modelopt wraps it (its
    wrapper subclasses the model's class)."""
    return any(c.__name__ in TRANSPOSED_EXPERTS for c in type(module).__mro__)


def _refused_as(module: nn.Module) -> tuple[str, str] | None:
    """(family, reason) where ``module``'s class (or one it subclasses, as modelopt's wrappers do) is a refused
    family's, else None."""
    return next((_REFUSED[c.__name__] for c in type(module).__mro__ if c.__name__ in _REFUSED), None)


def _is_3d(module: nn.Module, attr: str) -> bool:
    p = getattr(module, attr, None)
    return isinstance(p, torch.Tensor) and p.dim() == 3


def _standard_layout(module: nn.Module) -> tuple[str, ...] | None:
    """The fused projections of a container in the layout modelopt's generic fused-expert wrappers take (the
    structure they recognise: ``num_experts``, a 3-D ``down_proj`` and a 3-D ``gate_up_proj``, or a 3-D ``up_proj``
    without a gate) or gpt-oss's transposed one, else None."""
    if is_transposed_experts(module):
        return ("gate_up_proj", "down_proj")
    if _refused_as(module) is not None or not hasattr(module, "num_experts") or not _is_3d(module, "down_proj"):
        return None
    if _is_3d(module, "gate_up_proj"):
        return ("gate_up_proj", "down_proj")
    if _is_3d(module, "up_proj") and getattr(module, "gate_proj", None) is None:
        return ("up_proj", "down_proj")
    return None


_SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "speech_config")


def run_experts_eagerly(model: nn.Module) -> None:
    """Point every fused expert container of ``model`` at transformers' eager experts forward (``F.linear`` per
    expert), the only one modelopt's fused-expert quantizers see.

    transformers 5 dispatches a fused container's forward by ``config._experts_implementation`` (``grouped_mm`` or
    ``batched_mm`` by default where torch has them), and those kernels bypass the quantizers: calibration collects
    nothing and training runs the experts in 16 bits. modelopt's own switch
    (``force_eager_experts_impl_on_the_fly``) reaches only the root's config, and only when the root is the Hugging
    Face model, and leaves gpt-oss's transposed containers (dispatched the same way) out; this reaches every config
    inside a wrapper (a LightningModule, a distillation model) too.
    """
    if not any(_standard_layout(m) is not None or is_transposed_experts(m) for m in model.modules()):
        return
    seen: set[int] = set()

    def force(cfg: object) -> None:
        if cfg is None or id(cfg) in seen:
            return
        seen.add(id(cfg))
        if getattr(cfg, "_experts_implementation", "eager") != "eager":
            cfg._experts_implementation = "eager"  # type: ignore[attr-defined]
        for sub in _SUB_CONFIGS:
            force(getattr(cfg, sub, None))

    for m in model.modules():
        force(getattr(m, "config", None))


def fused_expert_containers(model: nn.Module) -> dict[str, FusedExperts]:
    """Every fused expert container of ``model`` in the standard layout, by module name."""
    found = {}
    for name, module in model.named_modules():
        projections = _standard_layout(module)
        if projections is not None and name.endswith("experts"):
            found[name] = FusedExperts(name, int(module.num_experts), projections)
    return found


def unsupported_fused_experts(model: nn.Module) -> dict[str, str]:
    """Modules holding experts this plugin does not quantize: a refused family's (its reason from the family table)
    and any other expert module with 3-D fused weights in a layout :func:`fused_expert_containers` does not take:
    module name -> what it is and why (for the refusal)."""
    supported = fused_expert_containers(model)
    out = {}
    for name, module in model.named_modules():
        if name in supported or any(name.startswith(f"{s}.") for s in supported):
            continue
        refused = _refused_as(module)
        if refused is not None:
            out[name] = f"{type(module).__name__}: {refused[0]} is not supported: {refused[1]}"
            continue
        if "Expert" not in type(module).__name__:
            continue
        fused = [(n, list(p.shape)) for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
        if fused:
            out[name] = (f"{type(module).__name__}: " + ", ".join(f"{n} {shape}" for n, shape in fused) + ": "
                         "experts fused outside transformers 5's standard layout ([experts, out, in] gate_up_proj / "
                         "up_proj and down_proj), which modelopt's fused-expert wrappers take")  # fmt: skip
    return out


def is_fused_projection(name: str) -> bool:
    """Whether a policy row's name is a fused projection (``<container>.experts.gate_up_proj`` ...)."""
    return _FUSED_NAME.match(name) is not None


def quantizer_glob(module: str, kind: str) -> str:
    """The modelopt quantizer name(s) of ``module``'s ``kind`` ("weight" or "input") quantizer: a linear layer's
    one, a fused projection's weight quantizers (a glob: one per expert, or gpt-oss's one for every expert) or its
    shared input quantizer."""
    if is_fused_projection(module):
        return f"{module}_weight_quantizer*" if kind == "weight" else f"{module}_input_quantizer"
    return f"{module}.{kind}_quantizer"


def quantizer_owner(qname: str) -> tuple[str, str] | None:
    """``(policy row name, kind)`` of a modelopt quantizer's name, for a linear layer's and a fused projection's
    quantizers alike; None for other quantizers (the KV cache's ...)."""
    m = _FUSED_QUANTIZER.match(qname)
    if m is not None:
        return f"{m['container']}.{m['proj']}", m["kind"]
    head, _, leaf = qname.rpartition(".")
    if leaf in ("weight_quantizer", "input_quantizer"):
        return head, leaf.split("_")[0]
    return None


def _exported_expert(modules: dict[str, nn.Module], name: str) -> tuple[str, nn.Module, str, int, str] | None:
    """``(container name, container, fused projection, expert index, half)`` the exported expert linear ``name``
    comes from (half: "gate" / "up" of a gated ``gate_up_proj`` [gate; up], else "")."""
    m = _EXPORTED_EXPERT.match(name)
    container = modules.get(m["container"]) if m is not None else None
    layout = _standard_layout(container) if container is not None else None
    if layout is None:
        return None
    proj = m["proj"]
    fused = "down_proj" if proj == "down_proj" else layout[0]
    if fused == "up_proj" and proj == "gate_proj":
        return None
    half = proj.removesuffix("_proj") if fused == "gate_up_proj" else ""
    return m["container"], container, fused, int(m["index"]), half


def _half(weight: torch.Tensor, half: str) -> torch.Tensor:
    rows = weight.shape[0] // 2
    return weight[:rows] if half == "gate" else weight[rows:] if half == "up" else weight


def fused_expert_reference(modules: dict[str, nn.Module], name: str, quantized: bool = True) -> torch.Tensor | None:
    """The trained weight of the exported expert linear ``name`` (``<container>.experts.<i>.gate_proj`` ...) that a
    fused container holds: expert ``i``'s slice of the fused projection through its weight quantizer (or, with
    ``quantized=False``, before it), the gate / up half of a gated ``gate_up_proj`` [gate; up]; None where ``name``
    is not one."""
    found = _exported_expert(modules, name)
    if found is None:
        return None
    _, container, fused, index, half = found
    weight = getattr(container, fused)[index].detach()
    quantizers = getattr(container, f"{fused}_weight_quantizers", None)
    if quantizers is None:
        return None
    with torch.no_grad():
        return _half(quantizers[index](weight) if quantized else weight, half)


def fused_expert_slot(modules: dict[str, nn.Module], name: str) -> tuple[str, str, torch.Tensor] | None:
    """``(container name, fused projection, writable view)``: where the exported expert linear ``name`` goes in an
    unquantized fused container (loading an export into the model class that trained it); None where ``name`` is
    not one."""
    found = _exported_expert(modules, name)
    if found is None:
        return None
    container_name, container, fused, index, half = found
    return container_name, fused, _half(getattr(container, fused).data[index], half)


def expert_weight_quantizers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, nn.Module, nn.Module | None]]:
    """Every enabled per-expert weight quantizer of ``model``'s fused expert containers as ``(name, expert's weight,
    weight quantizer, the projection's input quantizer)``, named like the exported expert linear
    (``<container>.<i>.gate_up_proj``), so a finding about it names the expert."""
    for name, module in model.named_modules():
        transposed = is_transposed_experts(module)
        for proj in ("gate_up_proj", "up_proj", "down_proj"):
            quantizers = getattr(module, f"{proj}_weight_quantizers", None)
            shared = getattr(module, f"{proj}_weight_quantizer", None)
            weight = getattr(module, proj, None)  # gpt-oss's wrapper hands out the stored weight outside its forward
            if not isinstance(weight, torch.Tensor):
                continue
            if isinstance(quantizers, nn.ModuleList):
                per_expert = list(enumerate(quantizers))
            elif transposed and shared is not None:
                per_expert = [(i, shared) for i in range(weight.shape[0])]  # one quantizer, each expert's [out, in]
            else:
                continue
            for i, q in per_expert:
                if getattr(q, "is_enabled", False):
                    w = weight[i].transpose(0, 1) if transposed else weight[i]
                    yield f"{name}.{i}.{proj}", w, q, getattr(module, f"{proj}_input_quantizer", None)
