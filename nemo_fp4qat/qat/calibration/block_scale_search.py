"""Minimum-error NVFP4 block scales, applied as a weight clip: a lever that deploys at no runtime cost.

NVFP4 scales each 16-element block by ``E4M3(block_max / 6 / s_t) * s_t`` (``s_t`` the per-tensor
scale ``amax / (6 * 448)``). The max rule never clips, but spends the block's 15 other values on a
grid stretched to reach one outlier; a smaller E4M3 scale often has a lower block error. This
module searches, per block, the E4M3 scale codes from the max rule's code down to ``min_ratio`` of
it and keeps the one with the least squared error of the block's quantize-dequantize.

The choice is applied by clipping the block's weights to ``6 * scale``: the max rule then *derives*
the chosen scale from the clipped weights (their block max is ``6 * scale`` exactly, and values above
it saturated to ``6 * scale`` anyway), so training, modelopt 0.37's and 0.47's exporters and every
runtime reproduce it with no stored state and no extra op. The blocks holding the tensor's max are
left alone, so a per-tensor amax recomputed from the weights (an exporter, a re-calibration) equals
the one searched with.

modelopt 0.47 has a related search (``mse_calibrate(..., fp8_scale_sweep=True)`` on static NVFP4
weight quantizers), but it keeps the scales as per-block state that only 0.47's exporter writes, its
static fake quant is Triton-only, and 0.37 (NeMo 2.7.3's) has none of it; hence this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from nemo_fp4qat.numerics.fake_quant import (
    blocked,
    nan_free_block_amax,
    nvfp4_global_scale,
    round_to_minifloat,
    unblocked,
)
from nemo_fp4qat.numerics.formats import format_name_of
from nemo_fp4qat.qat.calibration.batches import forward_batches
from nemo_fp4qat.qat.parallel.groups import all_reduce_flat, data_parallel_group

__all__ = ["DEFAULT_MIN_RATIO", "BlockClip", "clip_nvfp4_weights", "input_second_moments", "search_nvfp4_block_clip"]

_E2M1_MAX = 6.0
_E4M3_MAX = 448.0
_MIN_SCALE = 1e-5  # below this the fake quant (modelopt's kernels too) uses a block scale of 1
# Lowest scale tried, as a fraction of the max rule's. Measured on the demo's PTQ (SmolLM2, output-weighted
# error): 0.5 clips too hard (47.35), 0.9 barely moves (47.80), 0.75 is best (46.93; max rule 48.33).
DEFAULT_MIN_RATIO = 0.75


@dataclass
class BlockClip:
    """What the search did to one weight: blocks whose scale it lowered, and its quantization error (mean
    squared, per element, weighted per input channel when the search was) under the max rule and after."""

    blocks: int
    clipped: int
    error_max_rule: float
    error_searched: float


def search_nvfp4_block_clip(
    weight: torch.Tensor,
    amax: torch.Tensor | float | None,
    block_size: int = 16,
    min_ratio: float = DEFAULT_MIN_RATIO,
    channel_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, BlockClip]:
    """The weight clipped to each block's minimum-error NVFP4 scale (a new tensor), and a summary.

    ``amax`` is the weight quantizer's per-tensor amax (``None``: the weight's own), as the fake quant
    uses it. Candidates are consecutive E4M3 codes below the max rule's (adjacent codes differ by
    1/16 to 1/8), down to ``min_ratio`` times its scale. ``channel_weight`` (one value per input
    channel, e.g. the mean square of the layer's input) weights each element's squared error: the
    error of the layer's output ``x @ W.T`` rather than of the weight (a diagonal of GPTQ's Hessian).
    """
    with torch.no_grad():  # a block, not a decorator: mutmut skips decorated functions
        gs = nvfp4_global_scale(weight, amax, None)
        xb, n = blocked(weight, block_size)
        xabs = torch.nan_to_num(xb.abs(), nan=0.0)
        block_max = nan_free_block_amax(xabs)
        blocks = block_max.numel()
        if not (gs > 0 and math.isfinite(gs)):
            return weight.clone(), BlockClip(blocks=blocks, clipped=0, error_max_rule=0.0, error_searched=0.0)
        gs_t = torch.tensor(gs, dtype=torch.float32)
        cw = None
        if channel_weight is not None:
            cw, _ = blocked(channel_weight.reshape(1, -1).to(xb.dtype), block_size)  # [1, nblocks, block]

        def block_error(scale: torch.Tensor) -> torch.Tensor:
            q = round_to_minifloat(xabs / scale, (2, 1)) * scale  # saturates at 6 * scale, as the kernel does
            e = (q - xabs).square()
            return (e if cw is None else e * cw).sum(-1, keepdim=True)

        code0 = torch.clamp(block_max / (_E2M1_MAX * gs_t), max=_E4M3_MAX).to(torch.float8_e4m3fn)
        scale0 = code0.float() * gs_t
        usable = scale0 >= _MIN_SCALE
        base_err = block_error(torch.where(usable, scale0, torch.ones_like(scale0)))
        best_err, best_scale = base_err.clone(), scale0.clone()
        bits = code0.view(torch.uint8).to(torch.int16)
        k = 1
        while True:  # E4M3 codes of positive values are ordered as their bit patterns: code - k is the k-th below
            cand_bits = bits - k
            scale = cand_bits.clamp(min=1).to(torch.uint8).view(torch.float8_e4m3fn).float() * gs_t
            ok = usable & (cand_bits >= 1) & (scale >= min_ratio * scale0) & (scale >= _MIN_SCALE)
            if not bool(ok.any()):
                break
            err = block_error(torch.where(ok, scale, torch.ones_like(scale)))
            better = ok & (err < best_err)
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
            k += 1
        # the blocks that hold the tensor's max keep it (so a per-tensor amax recomputed from the weights is unchanged)
        keep = block_max >= block_max.max()
        lowered = (best_scale < scale0) & ~keep
        clip_at = torch.where(lowered, _E2M1_MAX * best_scale, torch.full_like(best_scale, float("inf")))
        clipped = torch.where(xb.abs() > clip_at, torch.sign(xb) * clip_at, xb)
        summary = BlockClip(
            blocks=blocks,
            clipped=int(lowered.sum()),
            error_max_rule=float(base_err.sum()) / weight.numel(),
            error_searched=float(torch.where(lowered, best_err, base_err).sum()) / weight.numel(),
        )
        return unblocked(clipped, weight, n), summary


def _is_nvfp4(quantizer: nn.Module | None) -> bool:
    enabled = quantizer is not None and bool(getattr(quantizer, "is_enabled", False))
    return enabled and format_name_of(quantizer) == "nvfp4"


def clip_nvfp4_weights(
    model: nn.Module,
    modules: set[str] | None = None,
    min_ratio: float = DEFAULT_MIN_RATIO,
    channel_weights: dict[str, torch.Tensor] | None = None,
) -> dict[str, BlockClip]:
    """Clip the weights of every calibrated NVFP4-weight layer (or those in ``modules``) in place.

    Runs after calibration: the search uses each weight quantizer's amax as training will (W4A8
    layers' included, ``nemo_fp4qat.qat.calibration.w4a8_scaling``). ``channel_weights``: layer -> per-input-channel
    weight of the error (:func:`input_second_moments`). Returns the summary per layer.
    """
    with torch.no_grad():  # a block, not a decorator: mutmut skips decorated functions
        out: dict[str, BlockClip] = {}
        for name, mod in model.named_modules():
            if modules is not None and name not in modules:
                continue
            wq, weight = getattr(mod, "weight_quantizer", None), getattr(mod, "weight", None)
            if not isinstance(weight, torch.Tensor) or not _is_nvfp4(wq):
                continue
            amax = getattr(wq, "_amax", None)
            if not isinstance(amax, torch.Tensor):
                continue
            block = int((getattr(wq, "block_sizes", None) or {}).get(-1, 16))
            cw = (channel_weights or {}).get(name)
            clipped, out[name] = search_nvfp4_block_clip(weight.data, amax, block, min_ratio, cw)
            weight.data.copy_(clipped)
        return out


def input_second_moments(
    model: nn.Module, batches: list, forward_fn: Callable[[nn.Module, Any], Any], modules: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """Mean square of each NVFP4-weight layer's input per channel, over ``batches`` (float64).

    Measured on the model as it stands (quantizers as configured), by forward pre-hooks.
    """
    with torch.no_grad():  # a block, not a decorator: mutmut skips decorated functions
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        hooks = []
        for name, mod in model.named_modules():
            if (modules is None or name in modules) and _is_nvfp4(getattr(mod, "weight_quantizer", None)):

                def hook(_m: nn.Module, args: tuple, _name: str = name) -> None:
                    x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
                    sums[_name] = sums.get(_name, 0) + x.square().sum(0)
                    counts[_name] = counts.get(_name, 0) + x.shape[0]

                hooks.append(mod.register_forward_pre_hook(hook))
        try:
            forward_batches(model, batches, forward_fn)
        finally:
            for h in hooks:
                h.remove()
        # Data-parallel ranks calibrate on different samples but hold the same weights: they must clip alike (or
        # their replicas drift apart), so the sums and counts are all-reduced over the ranks holding the same shard.
        import torch.distributed as dist

        names = sorted(sums)
        if names and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts = [sums[n] for n in names] + [sums[names[0]].new_tensor([float(counts[n]) for n in names])]
            *reduced, n_rows = all_reduce_flat(parts, dist.ReduceOp.SUM, data_parallel_group())
            for n, total, rows in zip(names, reduced, n_rows.tolist(), strict=True):
                sums[n], counts[n] = total, int(rows)
        return {n: (sums[n] / counts[n]).float() for n in sums}
