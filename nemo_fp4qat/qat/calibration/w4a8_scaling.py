"""Train NVFP4-weight / FP8-input layers (W4A8) in the numerics TensorRT-LLM's W4A8 kernel runs.

NVFP4 has two weight scales: an E4M3 scale per 16 elements and one FP32 scale per tensor. For W4A4
(``NVFP4``), modelopt fake-quantizes and exports with the per-tensor scale ``amax / (6 * 448)``, so
block scales use the whole E4M3 range. TensorRT-LLM's ``W4A8_NVFP4_FP8`` kernel dequantizes weights to
FP8 first, so modelopt *exports* those layers with the per-tensor scale ``amax / 448`` (block scales
<= 448 / 6, ``modelopt.torch.export.quant_utils.get_weight_scaling_factor``) while its fake quantizer
still uses ``amax / (6 * 448)``. The block scales then round differently: measured on a tiny Llama,
60% of the FP4 codes of the export differ from the trained weights (8.5% relative difference), i.e.
the deployed model is not the one QAT trained.

No library reconciles the two, so this module does: a W4A8 weight quantizer holds ``6 * amax`` while
training (its fake quantizer then uses ``amax / 448``, exactly the export's per-tensor scale, hence
the export's block scales and codes), and the true ``amax`` only while an export runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn as nn

from nemo_fp4qat.numerics.formats import format_name_of

__all__ = [
    "W4A8_AMAX_FACTOR",
    "calibrated_w4a8_layers",
    "is_w4a8",
    "scale_w4a8_weight_amax",
    "training_amax",
    "w4a8_export_amax",
]

W4A8_AMAX_FACTOR = 6.0  # E2M1's largest value: (6 * amax) / (6 * 448) == amax / 448


def is_w4a8(module: nn.Module) -> bool:
    """An NVFP4 weight quantizer with an enabled FP8 per-tensor input quantizer (``W4A8_NVFP4_FP8``)."""
    wq, iq = getattr(module, "weight_quantizer", None), getattr(module, "input_quantizer", None)
    if wq is None or iq is None or not getattr(wq, "is_enabled", False) or not getattr(iq, "is_enabled", False):
        return False
    return format_name_of(wq) == "nvfp4" and format_name_of(iq) == "fp8"


def calibrated_w4a8_layers(model: nn.Module, modules: Iterable[str] | None = None) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of the W4A8 layers (all, or those in ``modules``) whose weight amax is set."""
    keep = None if modules is None else set(modules)
    for name, mod in model.named_modules():
        if (keep is None or name in keep) and is_w4a8(mod):
            if isinstance(getattr(mod.weight_quantizer, "_amax", None), torch.Tensor):
                yield name, mod


@torch.no_grad()
def scale_w4a8_weight_amax(model: nn.Module, modules: Iterable[str] | None = None) -> list[str]:
    """Multiply the freshly calibrated weight amax of W4A8 layers (all, or ``modules``) by 6.

    Call once per calibration of those quantizers (the controller does, after ``max`` calibration
    and before the amax is synchronised across ranks). Returns the layers scaled.
    """
    done = []
    for name, mod in calibrated_w4a8_layers(model, modules):
        amax = mod.weight_quantizer._amax
        amax.copy_(training_amax(amax.float() * W4A8_AMAX_FACTOR).to(amax.dtype))
        done.append(name)
    return done


def training_amax(scaled: torch.Tensor) -> torch.Tensor:
    """``6 * amax`` nudged up by at most a few float32 ulps so that the two per-tensor scales agree bit for bit.

    The fake quantizer computes ``A / (6 * 448)`` from the amax ``A`` it holds; the exporter computes
    ``(A / 6) / 448`` (``w4a8_export_amax``, then modelopt's ``amax / 448``). In float32 the two differ by
    an ulp for about a quarter of all values (measured on random amax), and an ulp in the per-tensor
    scale flips the E4M3 rounding of the odd block scale that sits on a tie, so a trained block would
    deploy with other codes (seen on SmolLM2 after QAD: 21 codes in 7 blocks). Two ulps always sufficed.
    """
    a = scaled.float().clone()
    up = torch.full_like(a, float("inf"))
    for _ in range(8):
        differ = (a / (6.0 * 448.0)) != ((a / W4A8_AMAX_FACTOR) / 448.0)
        if not bool(differ.any()):
            break
        a = torch.where(differ, torch.nextafter(a, up), a)
    return a


@contextlib.contextmanager
def w4a8_export_amax(model: nn.Module) -> Iterator[list[str]]:
    """The true weight amax of W4A8 layers while an exporter runs; the training value afterwards."""
    scaled = list(calibrated_w4a8_layers(model))
    saved = [mod.weight_quantizer._amax.detach().clone() for _, mod in scaled]
    with torch.no_grad():
        for _, mod in scaled:
            mod.weight_quantizer._amax.div_(W4A8_AMAX_FACTOR)
    try:
        yield [n for n, _ in scaled]
    finally:
        with torch.no_grad():  # the held values exactly (a float32 * 6 after / 6 may move an ulp)
            for (_, mod), amax in zip(scaled, saved):
                mod.weight_quantizer._amax.copy_(amax)
