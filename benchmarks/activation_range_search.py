"""Searched activation ranges: #17's "learned activation ranges" lever, measured as its static optimum.

An NVFP4 input quantizer scales every 16-element block at run time; its one calibrated number, the
per-tensor amax, only sets the global scale under those block scales (where the E4M3 block scales saturate
at 448 and where small blocks fall into E4M3's subnormals). A learned range (LSQ-style) moves that one
number per layer by gradient. This module moves it by search instead: for every quantized linear whose
input quantizer has a per-tensor amax, each multiplier of ``GRID`` is tried on the calibration batches and
the one with the least error of the layer's output, ``||(Q_c(x) - x) W^T||^2`` summed in float64, is kept
(one multiplier per group of fused siblings, q/k/v and gate/up, whose errors are summed: they deploy as one
GEMM with one input scale).
The best of a grid on the layer's own error bounds what a learned range can buy at PTQ; the exported
checkpoint carries the chosen amax as its static input scale (no runtime cost).

Written by hand for the benchmark (modelopt's ``mse`` calibration searches weight amaxes only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from nemo_fp4qat.qat.policy.fused_siblings import find_fused_siblings

GRID = (0.25, 0.5, 0.71, 1.0, 1.41, 2.0, 4.0)


def _targets(model: nn.Module) -> dict[str, nn.Module]:
    out = {}
    for name, m in model.named_modules():
        q = getattr(m, "input_quantizer", None)
        if q is None or not isinstance(m, nn.Linear) or not q.is_enabled:
            continue
        amax = q.amax
        if amax is not None and amax.numel() == 1:
            out[name] = m
    return out


@torch.no_grad()
def search_activation_ranges(
    model: nn.Module,
    batches: Iterable[Any],
    forward_fn: Callable[[nn.Module, Any], Any],
    grid: tuple[float, ...] = GRID,
) -> dict[str, float]:
    """Set each eligible input quantizer's amax to ``c * amax`` for its best ``c`` in ``grid``; returns the
    chosen multipliers by module name. Each layer is judged on the inputs of the max-calibrated model."""
    targets = _targets(model)
    err = {n: torch.zeros(len(grid), dtype=torch.float64) for n in targets}

    def hook(name: str):
        def pre(mod: nn.Module, args: tuple) -> None:
            x, q = args[0].detach(), mod.input_quantizer
            w = mod._parameters["weight"]
            a0 = q.amax.clone()
            for i, c in enumerate(grid):
                q.amax = a0 * c
                err[name][i] += F.linear(q(x) - x, w).double().pow(2).sum()
            q.amax = a0

        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in targets.items()]
    try:
        for b in batches:
            forward_fn(model, b)
    finally:
        for h in handles:
            h.remove()
    groups = [[n for n in g if n in targets] for g in find_fused_siblings(model)]
    grouped = {n for g in groups for n in g}
    groups += [[n] for n in targets if n not in grouped]
    chosen = {}
    for group in filter(None, groups):
        c = grid[int(torch.argmin(sum(err[n] for n in group)))]
        for n in group:
            targets[n].input_quantizer.amax = targets[n].input_quantizer.amax * c
            chosen[n] = c
    return chosen
