"""Fused siblings: layers that deploy with one shared scale train with one shared amax.

TensorRT-LLM fuses q/k/v and gate/up projections into single GEMMs that take one input scale and
one per-tensor weight scale (modelopt's export gives the fused weights the max of their amaxes).
A model trained with separate amaxes would be served with a different quantization than it was
trained with, so siblings are given the max of their amaxes after every calibration.
Megatron-core already fuses them (``linear_qkv``, ``linear_fc1``); this matters for HF layouts.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from nemo_fp4qat.architectures import fused_sibling_sets

__all__ = ["ENGINE_FUSED_NAMES", "FUSED_SIBLING_SETS", "find_fused_siblings", "share_fused_amax"]

# the module the serving engines (vLLM, SGLang, TensorRT-LLM's PyTorch backend) fuse each sibling set into
ENGINE_FUSED_NAMES: dict[tuple[str, ...], str] = {
    ("q_proj", "k_proj", "v_proj"): "qkv_proj",
    ("gate_proj", "up_proj"): "gate_up_proj",
}
# every family's layers that read one input and deploy fused (architectures.py): q/k/v and gate/up, Mixtral's experts'
# w1/w3, multi-head latent attention's down projections (vLLM's fused_qkv_a_proj), RecurrentGemma's linear_x / linear_y
# (modelopt's exporter fuses them)
FUSED_SIBLING_SETS: tuple[tuple[str, ...], ...] = fused_sibling_sets()


def find_fused_siblings(model: nn.Module) -> list[list[str]]:
    """Groups of module names (all present under one parent) that deploy fused."""
    names = {n for n, _ in model.named_modules()}
    groups: list[list[str]] = []
    for parent, _ in model.named_modules():
        prefix = f"{parent}." if parent else ""
        for sibs in FUSED_SIBLING_SETS:
            full = [prefix + s for s in sibs]
            if all(f in names for f in full):
                groups.append(full)
    return groups


def share_fused_amax(model: nn.Module, groups: list[list[str]]) -> int:
    """Set each sibling group's weight and input amax (a static NVFP4 weight quantizer's per-tensor
    ``_global_amax``) to the group max. Returns groups changed."""
    modules = dict(model.named_modules())
    changed = 0
    for group in groups:
        for qname in ("weight_quantizer", "input_quantizer"):
            qs = [getattr(modules[m], qname, None) for m in group]
            if any(q is None or not q.is_enabled for q in qs):
                continue
            # static NVFP4 weight quantizers (calibrated or learned block scales): their per-tensor amax
            globals_ = [getattr(q, "_global_amax", None) for q in qs]
            static = all(isinstance(a, torch.Tensor) for a in globals_)
            amaxes = globals_ if static else [getattr(q, "_amax", None) for q in qs]
            if any(a is None or a.numel() != 1 for a in amaxes):
                continue  # per-channel / dynamic formats carry no shared per-tensor scale
            shared = torch.stack([a.detach().reshape(()) for a in amaxes]).amax()
            for a in amaxes:
                a.data.fill_(shared.item())
            changed += 1
    return changed
