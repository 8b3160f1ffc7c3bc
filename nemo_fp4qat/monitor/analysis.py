"""Per-layer quantization quality of a model as it stands: what the monitor measures.

No Lightning here: :func:`analyze_model` works alone after PTQ, in a notebook or in the demo.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..numerics.metrics import quantization_error, weight_statistics
from ..qat.experts.fused import expert_weight_quantizers

__all__ = ["amax_of", "analyze_model", "quantized_layers"]


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    out = {}
    for name, m in model.named_modules():
        wq = getattr(m, "weight_quantizer", None)
        iq = getattr(m, "input_quantizer", None)
        if (wq is not None and wq.is_enabled) or (iq is not None and iq.is_enabled):
            out[name] = m
    return out


def amax_of(q: Any) -> float | None:
    a = getattr(q, "_amax", None)
    if isinstance(a, torch.Tensor) and a.numel() == 1:
        return float(a)
    return None


def _block(q: Any) -> int | None:
    bs = getattr(q, "block_sizes", None) or {}
    return bs.get(-1)


def analyze_model(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Weight metrics for every enabled weight quantizer of ``model`` (usable alone after PTQ); a fused expert
    container's experts each under its exported name (``<container>.<i>.gate_up_proj``)."""
    out: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for name, m in quantized_layers(model).items():
            wq = getattr(m, "weight_quantizer", None)
            if wq is None or not wq.is_enabled or not isinstance(getattr(m, "weight", None), torch.Tensor):
                continue
            rec = _weight_record(m.weight, wq)
            rec["input_amax"] = amax_of(getattr(m, "input_quantizer", None))
            out[name] = rec
        for name, w, wq, iq in expert_weight_quantizers(model):  # fused experts: one record per expert
            rec = _weight_record(w, wq)
            rec["input_amax"] = amax_of(iq)
            out[name] = rec
    return out


def _weight_record(w: torch.Tensor, wq: Any) -> dict[str, Any]:
    qw = wq(w)
    rec = {f"weight_{k}": v for k, v in quantization_error(w, qw).items()}
    # saturation only where a static per-tensor amax enters the numerics (not MX formats)
    static_amax = None if getattr(wq, "is_mx_format", False) else amax_of(wq)
    rec.update({f"weight_{k}": v for k, v in weight_statistics(w, qw, static_amax, _block(wq)).items()})
    rec["weight_amax"] = amax_of(wq)
    return rec
