"""GPTQ: weights rounded with second-order error compensation, on the scales calibration set.

modelopt >= 0.47 ships GPTQ (``GPTQCalibConfig``, ported from IST-DASLab's FP-Quant): per linear layer, the
Hessian of its (quantized) inputs on the calibration batches, then a column-by-column rounding of the weights in
which each column's rounding error is carried into the columns not yet rounded. The weights it leaves are the
quantized ones, so QAT / QAD starts on the grid with less output error than round-to-nearest.

modelopt's ``gptq`` algorithm calibrates max scales first and has no option for other weight scales (its own TODO).
:func:`apply_gptq` runs modelopt's per-layer helper (``GPTQHelper``: Hessian collection, damped inverse, the
blockwise update) on the quantizers as calibration left them, so GPTQ follows whatever set the scales: max (the
same result as modelopt's ``gptq``), MSE or local-Hessian block scales (``CalibrationConfig.weight_scale``), and
the plugin's fused q/k/v and gate/up amax. Under data parallelism each rank's Hessian is averaged over the ranks
that hold the same weights (weighted by their token counts), so every replica rounds alike.

modelopt's unfused update fake-quantizes the whole weight matrix once per column to read that column back: on a
CPU that is most of GPTQ's time (about 130 s for SmolLM2-135M on 2 cores). Where a column's quantized value depends
only on its own quantization block (per-block scales computed from the weights, per-tensor or per-channel amax
already calibrated), :class:`_BlockSliceGPTQ` quantizes only the column's own quantization block (16 columns for
NVFP4, the column alone for per-tensor FP8), which gives the same column: the same update, a fraction of the work.
Static per-block scales (MSE, local Hessian) are indexed by the whole matrix and keep modelopt's own update.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from nemo_fp4qat.qat.calibration.batches import forward_batches
from nemo_fp4qat.specs import ConfigError, optional_spec

__all__ = ["GPTQConfig", "apply_gptq", "require_gptq"]

GPTQ_MODELOPT = "0.47"  # the first modelopt with GPTQ (GPTQCalibConfig, calib_utils.GPTQHelper)


@dataclass
class GPTQConfig:
    """GPTQ after calibration (``CalibrationConfig.gptq``).

    Attributes:
        perc_damp: damping added to the Hessian's diagonal, as a fraction of its mean (FP-Quant's 0.01).
        block_size: columns per GPTQ block (a multiple of the quantization block size; FP-Quant's 128).

    Raises:
        ConfigError: a damping outside (0, 1] or a block size that is not a positive multiple of 16.

    Example:
        >>> QATConfig(calibration={"num_samples": 128, "gptq": True}, distillation="qad")  # doctest: +SKIP
    """

    perc_damp: float = 0.01
    block_size: int = 128

    def __post_init__(self) -> None:
        if (
            isinstance(self.perc_damp, bool)
            or not isinstance(self.perc_damp, (int, float))
            or not (0 < self.perc_damp <= 1)
        ):
            raise ConfigError(f"gptq perc_damp must be in (0, 1] (e.g. 0.01), got {self.perc_damp!r}.")
        if (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int)
            or self.block_size < 16
            or (self.block_size % 16)
        ):
            raise ConfigError(
                f"gptq block_size must be a positive multiple of 16 (NVFP4's block; e.g. 128), got {self.block_size!r}."
            )

    @classmethod
    def resolve_spec(cls, spec: Any) -> GPTQConfig | None:
        return optional_spec(cls, spec, "calibration gptq", "use true, false or a dict of its fields "
                             "(e.g. {'perc_damp': 0.01, 'block_size': 128}).")  # fmt: skip


def require_gptq() -> None:
    """Refuse GPTQ on a modelopt without it, naming the version that has it."""
    try:
        from modelopt.torch.quantization.utils.calib_utils import GPTQHelper  # noqa: F401
    except ImportError:
        from nemo_fp4qat.qat.modelopt_compat import modelopt_version

        raise ConfigError(
            f"calibration gptq needs modelopt >= {GPTQ_MODELOPT} (GPTQCalibConfig); modelopt {modelopt_version()} is "
            "installed (NeMo 2.7.3 pins 0.37). Install nvidia-modelopt>=0.47 or set gptq to false."
        ) from None


def _slices_alike(quantizer: nn.Module, block_size: int) -> bool:
    """Whether fake-quantizing a ``block_size``-column slice of a weight gives the same values as the slice of the whole
    matrix fake-quantized: a calibrated amax (per tensor or per output channel) and, if the quantizer has blocks
    along the input dimension, dynamic block scales whose block divides ``block_size``."""
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import StaticBlockScaleQuantizer

    if isinstance(quantizer, StaticBlockScaleQuantizer) or getattr(quantizer, "_amax", None) is None:
        return False
    amax = quantizer._amax
    if amax.numel() > 1 and amax.dim() >= 1 and amax.shape[-1] != 1:  # not per-tensor or per-output-channel
        return False
    blocks = getattr(quantizer, "block_sizes", None) or {}
    if blocks.get("type", "dynamic") != "dynamic":
        return False
    along = blocks.get(-1) or blocks.get(1)
    return along is None or block_size % int(along) == 0


def _quant_block(quantizer: nn.Module) -> int:
    """Columns that share a scale in a quantizer :func:`_slices_alike` accepts (1: per-tensor or per-channel amax)."""
    blocks = getattr(quantizer, "block_sizes", None) or {}
    along = blocks.get(-1) or blocks.get(1)
    return int(along) if along else 1


def _direct_quantize(quantizer: nn.Module, sample: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The fake-quant op modelopt's forward reaches for ``quantizer``, called without the module around it (its
    Python costs more than the op on a column's block, and GPTQ calls it once per column): NVFP4 / MX dynamic blocks
    (``dynamic_block_quantize_op``) or per-tensor / per-channel FP8 (``scaled_e4m3_impl``) with the calibrated amax.
    Used only if it gives exactly what the quantizer gives on ``sample`` (anything the module adds, such as a
    pre-quantization scale or a rotation, would show there); the quantizer itself otherwise."""
    from modelopt.torch.quantization import tensor_quant

    nb, blocks, amax = quantizer._num_bits, getattr(quantizer, "block_sizes", None) or {}, quantizer._amax
    fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    if isinstance(nb, tuple) and blocks.get("type") == "dynamic" and isinstance(blocks.get("scale_bits"), tuple):
        bs, (se, sm) = int(blocks.get(-1) or blocks.get(1)), blocks["scale_bits"]
        a = None if getattr(quantizer, "is_mx_format", False) else amax

        def fn(x: torch.Tensor) -> torch.Tensor:
            return tensor_quant.dynamic_block_quantize_op(x, bs, a, nb[0] + nb[1] + 1, nb[0], se + sm + 1, se)
    elif nb == (4, 3) and not blocks:

        def fn(x: torch.Tensor) -> torch.Tensor:
            return tensor_quant.scaled_e4m3_impl(x, amax)

    if fn is not None and torch.equal(fn(sample), quantizer(sample)):
        return fn
    return quantizer


def _block_slice_helper(base: type) -> type:
    """``base`` (modelopt's ``GPTQHelper``) with the blockwise update quantizing only the GPTQ block's columns where
    that gives the same columns (:func:`_slices_alike`); modelopt's own update elsewhere."""

    class _BlockSliceGPTQ(base):  # type: ignore[misc, valid-type]
        def _blockwise_update(self, block_size: int) -> None:
            quantizer = self.module.weight_quantizer
            if not _slices_alike(quantizer, block_size):
                return super()._blockwise_update(block_size)
            weight, h_inv = self.weight, self.h_inv
            num_cols = weight.shape[1]
            qb = _quant_block(quantizer)
            quantize = _direct_quantize(quantizer, weight[:, : min(qb, num_cols)].clone())
            # modelopt's gptq_blockwise_update, the quantizer applied to each column's own quantization block (all
            # its columns as they stand, rounded and not yet rounded) instead of the whole matrix
            for start in range(0, num_cols, block_size):
                end = min(start + block_size, num_cols)
                h_blk = h_inv[start:end, start:end]
                wblk = weight[:, start:end].clone()
                errs = torch.zeros_like(wblk)
                for i in range(end - start):
                    w_ci = wblk[:, i].clone()
                    lo = i - i % qb
                    q_ci = quantize(wblk[:, lo : lo + qb])[:, i - lo]
                    weight[:, start + i] = q_ci
                    err = (w_ci - q_ci) / h_blk[i, i]
                    wblk[:, i:].addr_(err, h_blk[i, i:], alpha=-1)
                    errs[:, i] = err
                weight[:, end:].addmm_(errs, h_inv[start:end, end:], alpha=-1)
            return None

    return _BlockSliceGPTQ


def _gptq_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from modelopt.torch.quantization.utils import is_quantized_linear

    return [
        (n, m)
        for n, m in model.named_modules()
        if is_quantized_linear(m) and m.weight_quantizer.is_enabled and not getattr(m.weight_quantizer, "_lsq", False)
    ]


def _average_hessians(handles: dict[str, Any]) -> None:
    """Average each layer's Hessian over the ranks that hold the same weights, weighted by token counts."""
    import torch.distributed as dist

    from nemo_fp4qat.qat.experts.moe import split_expert_name
    from nemo_fp4qat.qat.parallel.groups import data_parallel_group, expert_data_parallel_group

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    dense, experts = data_parallel_group(), expert_data_parallel_group()
    for name in sorted(handles):
        h = handles[name]
        group = experts if experts is not None and split_expert_name(name) else dense
        weighted = h.hessian * float(h.n_samples)
        count = torch.tensor([float(h.n_samples)], device=weighted.device)
        dist.all_reduce(weighted, group=group)
        dist.all_reduce(count, group=group)
        if count.item() > 0:
            h.hessian = weighted / count.item()
            h.n_samples = int(count.item())


def apply_gptq(
    model: nn.Module,
    batches: list[Any],
    forward_fn: Callable[[nn.Module, Any], Any],
    config: GPTQConfig,
    verbose: bool = False,
) -> int:
    """GPTQ-round the weights of every quantized linear of ``model`` (already calibrated) on ``batches``.

    Args:
        model: a model whose quantizers modelopt calibrated (input amax set; weight scales as calibration left
            them).
        batches: the calibration batches the Hessians are collected on.
        forward_fn: how a batch goes through ``model``.
        config: damping and block size.
        verbose: keep modelopt's per-layer error lines on stdout.

    Returns:
        The number of layers whose weights GPTQ rounded.

    Raises:
        ConfigError: modelopt < 0.47.
    """
    require_gptq()
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context
    from modelopt.torch.quantization.utils import enable_weight_access_and_writeback
    from modelopt.torch.quantization.utils.calib_utils import _GPTQ_HELPER_REGISTRY, GPTQHelper

    layers = _gptq_layers(model)
    if not layers:
        return 0
    t0 = time.time()
    handles = {}
    for name, m in layers:
        registered = _GPTQ_HELPER_REGISTRY.get(getattr(m.weight_quantizer, "backend", None))
        cls = registered or _block_slice_helper(GPTQHelper)
        handles[name] = cls(m, name, offload_to_cpu=True, fused=False)
    for h in handles.values():
        h.setup()
    try:  # the Hessians are of the layers' quantized inputs, with every weight in full precision (as modelopt does)
        with set_quantizer_by_cfg_context(model, [{"quantizer_name": "*weight_quantizer", "enable": False}]):
            forward_batches(model, batches, forward_fn)
    finally:
        for h in handles.values():
            h.cleanup()
    _average_hessians(handles)
    modules = dict(model.named_modules())
    out = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
    with out, torch.no_grad():
        for h in handles.values():
            with enable_weight_access_and_writeback(h.module, model, modules):
                h.update_weights(config.block_size, config.perc_damp)
            h.free()
    import logging

    logging.getLogger("nemo_fp4qat").info(
        "nemo_fp4qat: GPTQ rounded %d layers in %.1f s (damping %g, block %d)",
        len(handles), time.time() - t0, config.perc_damp, config.block_size,
    )  # fmt: skip
    return len(handles)
