"""modelopt's static per-block NVFP4 fake quant and LSQ's FP4 cast, in torch, for any device.

modelopt >= 0.46 quantizes NVFP4 weights with *static* per-block scales (after its ``mse`` /
``local_hessian`` / Four-Over-Six weight-scale calibrations, and in LSQ, where the block amax is a learnable
parameter). Its two forward ops for that, ``static_blockwise_fp4_fake_quant`` and ``fp4_cast_ste``
(``modelopt.torch.quantization.tensor_quant``), run only as Triton kernels on CUDA: on a CPU they raise.
This module computes what those kernels compute, element for element, in torch:

* the block scale ``amax / 6`` as E4M3 in units of the per-tensor scale ``global_amax / (6 * fp8_max)`` (448; 256
  for Four-Over-Six), in the order modelopt's exporter computes the checkpoint's two scales
  (:func:`static_block_scales`: what a runtime multiplies, to the last bit; modelopt's kernel goes through its FP8
  fake quant, and on CUDA through its extension, which lands an ulp or an E4M3 step away on some blocks: measured
  on the H200, ``benchmarks/results/gpu_check.md``); LSQ's block scales are computed the same way
  (:func:`lsq_block_scale`);
* each element ``|x| / scale`` rounded to the E2M1 grid with the kernels' decision boundaries (ties to the
  even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; above 5 -> 6, NaN -> 6),
  times the scale, signed by ``x >= 0``; a zero block scale gives a zero block.

Only the forward passes are replaced (:func:`install_static_nvfp4`): modelopt's autograd functions keep their
backward passes (clipped or pass-through STE to the input; LSQ's gradients to its learnable amax flow through
the torch ops around the cast), so training here follows modelopt's gradients.

All arithmetic is IEEE float32 division and multiplication in torch, which is correctly rounded on both CPU
and CUDA, so the result is the same on either device; on CUDA this is the ``"exact"`` kernel choice
(:func:`~nemo_fp4qat.numerics.cpu_backend.cuda_nvfp4_kernel`), and ``"modelopt"`` keeps modelopt's Triton
kernels there. Written by hand because modelopt ships these ops for CUDA only.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "E4M3_MAX",
    "fp4_cast",
    "install_static_nvfp4",
    "lsq_block_scale",
    "static_block_scales",
    "static_nvfp4_fake_quant",
    "uninstall_static_nvfp4",
]

E4M3_MAX = 448.0
_E2M1_MAX = 6.0
_ORIGINAL: dict[str, Any] = {}


def _fp4_round_magnitude(a: torch.Tensor) -> torch.Tensor:
    """``a`` (non-negative float32) to the nearest E2M1 magnitude with modelopt's kernels' boundaries."""
    w = torch.where
    return w(a <= 0.25, 0.0, w(a < 0.75, 0.5, w(a <= 1.25, 1.0, w(a < 1.75, 1.5, w(a <= 2.5, 2.0,
             w(a < 3.5, 3.0, w(a <= 5.0, 4.0, 6.0)))))))  # fmt: skip


def fp4_cast(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Round pre-scaled ``x`` to the nearest E2M1 value (no scale), as ``static_blockwise_fp4_cast``.

    Args:
        x: any shape and float dtype (computed in float32).
        out_dtype: the result's dtype (``x.dtype`` by default).

    Example:
        >>> fp4_cast(torch.tensor([0.3, -2.6, 7.0]))
        tensor([ 0.5000, -3.0000,  6.0000])
    """
    xf = x.float()
    q = _fp4_round_magnitude(xf.abs())
    return torch.where(xf >= 0, q, -q).to(out_dtype or x.dtype)


def _div(a: torch.Tensor, b: float) -> torch.Tensor:
    """``a / b`` correctly rounded on every device: PyTorch's CUDA division by a Python (CPU) scalar multiplies by the
    divisor's reciprocal, which is not IEEE division when the reciprocal is inexact (1/6, 1/448)."""
    return a / torch.full((), b, dtype=a.dtype, device=a.device)


def static_block_scales(
    amax: torch.Tensor,
    global_amax: torch.Tensor | None = None,
    quantize_block_scales: bool = True,
    fp8_max_for_normalization: float = E4M3_MAX,
) -> torch.Tensor:
    """Per-block scales from per-block amax (float32, amax's shape), as the exported checkpoint holds them.

    modelopt's exporter writes ``weight_scale_2 = global_amax / (6 * fp8_max)`` and the E4M3 block scale
    ``clamp((amax / 6) * fp8_max / (global_amax / 6), 2**-9, 448)``; a runtime multiplies the two. Computed in that
    order here, so training uses the scale that deploys to the last bit (modelopt's own kernel scales through its
    FP8 fake quant, an ulp away on some blocks, which NVFP4 activations downstream amplify). A zero block amax gives
    a zero scale (a zero block), as in modelopt's kernel.
    """
    scale = _div(amax.float(), _E2M1_MAX)
    if not quantize_block_scales:
        return scale
    if global_amax is None:
        global_amax = amax.float().abs().amax()
    g = global_amax.float().to(scale.device).reshape(())
    m = torch.full((), fp8_max_for_normalization, dtype=torch.float32, device=scale.device)
    ws2 = g / (m * _E2M1_MAX)
    code = (scale * m / _div(g, _E2M1_MAX)).clamp(2.0**-9, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch.where(scale == 0, torch.zeros_like(scale), code.float() * ws2)


def lsq_block_scale(quantizer: Any, amax: torch.Tensor, quantize: bool) -> torch.Tensor:
    """LSQ's block scale from a learnable amax in :func:`static_block_scales`' arithmetic, with the gradient
    modelopt's ``StaticBlockScaleQuantizer._block_scale_from_amax`` gives it (a straight-through FP8 cast; zero where
    the scale is clamped to the smallest or is above the per-tensor scale). Stands in for that method while the
    backend is installed, so LSQ trains the scale the export holds."""
    if not quantize:
        return _ORIGINAL["lsq_scale"](quantizer, amax, quantize)
    from modelopt.torch.quantization.utils.numeric_utils import fp8_max_for_normalization

    m = fp8_max_for_normalization(quantizer)
    g = quantizer.global_amax.float().reshape(())
    per_tensor = _div(g, _E2M1_MAX)
    s = amax.float() / _E2M1_MAX
    live = (s.detach() >= 2.0**-9 * per_tensor / E4M3_MAX) & (s.detach() <= per_tensor)
    q = static_block_scales(amax.detach().float().clamp_min(0.0), g, True, m)
    q = torch.where(q == 0, (2.0**-9 * g) / (torch.full((), m, device=g.device) * _E2M1_MAX), q)  # clamped below
    return s * live + (q - s * live).detach()


def static_nvfp4_fake_quant(
    x: torch.Tensor,
    amax: torch.Tensor,
    global_amax: torch.Tensor | None = None,
    quantize_block_scales: bool = True,
    fp8_max_for_normalization: float = E4M3_MAX,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """NVFP4 fake quant of ``x`` with static per-block amax, as ``static_blockwise_fp4_fake_quant``.

    Args:
        x: blocks run along the flattened tensor: ``x.numel() == amax.numel() * block_size``.
        amax: per-block amax (any shape with one value per block).
        global_amax: the per-tensor amax of the FP8 block-scale quantization (``amax.max()`` when ``None``).
        quantize_block_scales: FP8 (E4M3) quantize the block scales.
        fp8_max_for_normalization: 448, or 256 for Four-Over-Six.
        out_dtype: the result's dtype (``x.dtype`` by default).

    Raises:
        ValueError: ``x.numel()`` is not a multiple of ``amax.numel()``.
    """
    nblk = amax.numel()
    if nblk == 0 or x.numel() % nblk:
        raise ValueError(
            f"static NVFP4 fake quant: x.numel() ({x.numel()}) must be amax.numel() ({nblk}) times the block size"
        )
    scale = static_block_scales(amax, global_amax, quantize_block_scales, fp8_max_for_normalization)
    s = scale.reshape(nblk, 1).float()
    xf = x.detach().reshape(nblk, -1).float()
    zero = s == 0.0
    s_safe = torch.where(zero | s.isnan() | s.isinf(), torch.ones_like(s), s)
    q = _fp4_round_magnitude(xf.abs() / s_safe) * s_safe
    y = torch.where(xf >= 0, q, -q)
    y = torch.where(zero, torch.zeros_like(y), y)
    return y.reshape(x.shape).to(out_dtype or x.dtype)


def _use_torch(x: torch.Tensor) -> bool:
    if x.device.type == "cpu":
        return True
    from .kernel_choice import cuda_nvfp4_kernel

    return cuda_nvfp4_kernel() == "exact"


def _static_forward(
    ctx: Any,
    x: torch.Tensor,
    amax: torch.Tensor,
    global_amax: torch.Tensor | None = None,
    quantize_block_scales: bool = True,
    fp8_max_for_normalization: float = E4M3_MAX,
    out_dtype: torch.dtype | None = None,
    pass_through_bwd: bool = False,
) -> torch.Tensor:
    if not _use_torch(x):
        return _ORIGINAL["static"](ctx, x, amax, global_amax, quantize_block_scales, fp8_max_for_normalization,
                                   out_dtype, pass_through_bwd)  # fmt: skip
    from modelopt.torch.quantization import tensor_quant

    tensor_quant._save_for_backward_if_needed(ctx, pass_through_bwd, x, amax)  # as modelopt's forward does
    return static_nvfp4_fake_quant(x, amax, global_amax, quantize_block_scales, fp8_max_for_normalization, out_dtype)


def _cast_forward(ctx: Any, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if not _use_torch(x):
        return _ORIGINAL["cast"](ctx, x, out_dtype)
    ctx.save_for_backward(x)  # modelopt's backward: STE masked to |x| <= 6
    return fp4_cast(x, out_dtype)


def install_static_nvfp4() -> bool:
    """Route modelopt's static NVFP4 and FP4-cast forwards to this module (idempotent).

    Returns False where the installed modelopt has neither op (0.37).
    """
    from modelopt.torch.quantization import tensor_quant

    static = getattr(tensor_quant, "StaticBlockwiseFP4FakeQuantFunction", None)
    cast = getattr(tensor_quant, "FP4CastSTEFunction", None)
    if static is None or cast is None:
        return False
    if "static" not in _ORIGINAL:
        from modelopt.torch.quantization.nn.modules.tensor_quantizer import StaticBlockScaleQuantizer

        _ORIGINAL["static"] = static.forward
        _ORIGINAL["cast"] = cast.forward
        _ORIGINAL["lsq_scale"] = StaticBlockScaleQuantizer._block_scale_from_amax
        static.forward = staticmethod(_static_forward)
        cast.forward = staticmethod(_cast_forward)
        StaticBlockScaleQuantizer._block_scale_from_amax = lsq_block_scale
    return True


def uninstall_static_nvfp4() -> None:
    """Give modelopt its own forwards back."""
    from modelopt.torch.quantization import tensor_quant

    if "static" in _ORIGINAL:
        from modelopt.torch.quantization.nn.modules.tensor_quantizer import StaticBlockScaleQuantizer

        tensor_quant.StaticBlockwiseFP4FakeQuantFunction.forward = staticmethod(_ORIGINAL.pop("static"))
        tensor_quant.FP4CastSTEFunction.forward = staticmethod(_ORIGINAL.pop("cast"))
        StaticBlockScaleQuantizer._block_scale_from_amax = _ORIGINAL.pop("lsq_scale")
