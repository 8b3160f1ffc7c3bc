"""Pure-PyTorch fake quantization for the block formats modelopt runs only on CUDA.

modelopt fake-quantizes NVFP4 with a Triton kernel (``fp4_fake_quant_block``) and the MX formats
with a CUDA extension (``tensor_quant_mx.cu``); neither runs on a CPU. This module computes the same
results on CPU tensors so QAT can be developed, tested and smoke-run without a GPU. It is written
by hand because no library provides these kernels for the CPU (torchao's MX/NVFP4 code targets
CUDA and uses its own scale rules).

What is reproduced, read from modelopt 0.37/0.47 sources:

* NVFP4 (Triton kernel): ``gs = amax / (6*448)``; per block of 16,
  ``s = fp8_e4m3(min(block_amax / (6*gs), 448)) * gs``, ``s = 1`` where ``s < 1e-5``;
  elements rounded to E2M1 with round-half-to-even, saturating at 6.
* MX (CUDA extension, E8M0 scale "NV" rule): ``unscale = 2**ceil(log2(block_amax / elem_max))``
  (no rounding up for exact powers of two), scale 1 for a zero/Inf block amax; NaN is ignored
  by the block max (``fmaxf``); elements rounded half-to-even and saturated; E4M3 elements
  convert with saturation (``__NV_SATFINITE``).
* Partial last blocks are zero-padded, as the CUDA extension does.

Measured on an H200 (``benchmarks/gpu_check.py``, ``benchmarks/RESULTS.md``): the MX formats match
modelopt's CUDA extension bit for bit. For NVFP4 this module uses IEEE float32 division and so
equals modelopt's ``NVFP4QTensor`` (the export path) exactly, while modelopt's Triton kernel uses
Triton's approximate float32 division: it differs from both by an ulp in the scale, and on
bfloat16 inputs rounds about 0.05% of elements that sit on an E2M1 tie to the other neighbour.
What is trained on a CPU here is therefore exactly what modelopt exports.

One deliberate difference: a NaN input element gives NaN here. The CUDA kernels turn it into a
finite value (the Triton compare chain yields ``-6 * scale``), which would hide divergence from
the quantization monitor.
"""

from __future__ import annotations

import contextlib
import math
import struct
from collections.abc import Iterator

import torch

from . import native_kernels

__all__ = [
    "CPU_BLOCK_FORMATS",
    "FLOAT_FORMAT_MAX",
    "blocked",
    "fake_quant_block",
    "fake_quant_fp8",
    "fake_quant_mx",
    "fake_quant_nvfp4",
    "nan_free_block_amax",
    "nvfp4_global_scale",
    "round_to_minifloat",
    "unblocked",
    "use_native",
]

_NATIVE_ENABLED = True


@contextlib.contextmanager
def use_native(enabled: bool) -> Iterator[None]:
    """Force (or forbid) the native C kernels inside the block; for tests and benchmarks."""
    global _NATIVE_ENABLED
    old, _NATIVE_ENABLED = _NATIVE_ENABLED, enabled
    try:
        yield
    finally:
        _NATIVE_ENABLED = old


def _native_ok(x: torch.Tensor) -> bool:
    return (
        _NATIVE_ENABLED
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and x.numel() > 0
        and native_kernels.native_available()
    )


# (exponent_bits, mantissa_bits) -> (largest finite value, minimum normal exponent).
# OCP MX element formats have no Inf/NaN encodings (E4M3 "fn" reserves one code for NaN only).
FLOAT_FORMAT_MAX: dict[tuple[int, int], float] = {
    (2, 1): 6.0,
    (2, 3): 7.5,
    (3, 2): 28.0,
    (4, 3): 448.0,
}
_EMIN: dict[tuple[int, int], int] = {(2, 1): 0, (2, 3): 0, (3, 2): -2, (4, 3): -6}
# log2 of the largest power of two <= max (used by the OCP scale rule; kept for reference).
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127


def _pow2(exp: torch.Tensor) -> torch.Tensor:
    """Exact 2**exp as float32 for integer ``exp`` in [-149, 127], built from the bit pattern."""
    exp = exp.to(torch.int32)
    normal = ((exp + 127).clamp(min=1) << 23).view(torch.float32)
    # Subnormals: 2**exp = 2**-149 * 2**(exp+149) with the mantissa bit at position exp+149.
    sub_shift = (exp + 149).clamp(min=0, max=22)
    subnormal = (torch.ones_like(exp) << sub_shift).view(torch.float32)
    return torch.where(exp >= -126, normal, subnormal)


def round_to_minifloat(v: torch.Tensor, element: tuple[int, int]) -> torch.Tensor:
    """Round non-negative float32 ``v`` to the nearest value of ``element``, ties to even.

    Values above the format's maximum (and +Inf) saturate to the maximum; NaN stays NaN.
    Works by snapping to the quantum of the value's binade: ``q = 2**(max(floor(log2 v), emin) - M)``,
    then ``round(v / q) * q`` with PyTorch's round-half-to-even; both scalings are exact.
    ``v`` must be float32 (its bit pattern is read).
    """
    if element not in FLOAT_FORMAT_MAX:
        raise ValueError(f"No CPU rounding for element format E{element[0]}M{element[1]}")
    fmax = FLOAT_FORMAT_MAX[element]
    # floor(log2 v) from the float32 exponent field (exact; subnormals read as -127, below every emin).
    e = (((v.view(torch.int32) >> 23) & 0xFF) - 127).clamp(min=_EMIN[element])
    shift = e - element[1]
    q = torch.round(v * _pow2(-shift)) * _pow2(shift)
    q = torch.where(v >= fmax, torch.full_like(q, fmax), q)  # saturation, +Inf included
    return torch.clamp(q, max=fmax)


def blocked(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """View ``x`` (any shape) as float32 [rows, nblocks, block], zero-padding the last dim."""
    n = x.shape[-1] if x.dim() > 0 else 1
    xf = x.reshape(-1, n).to(torch.float32)
    pad = (-n) % block_size
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return xf.view(xf.shape[0], -1, block_size), n


def unblocked(y: torch.Tensor, like: torch.Tensor, n: int) -> torch.Tensor:
    y = y.reshape(y.shape[0], -1)[:, :n]
    return y.reshape(like.shape).to(like.dtype)


def _to_f32(v: float) -> float:
    """``v`` rounded to the nearest float32 (as ``torch.tensor(v, dtype=torch.float32)`` does)."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:  # beyond float32's range: float32 rounds it to infinity
        return math.copysign(math.inf, v)


def nvfp4_global_scale(
    x: torch.Tensor, amax: torch.Tensor | float | None, global_scale: torch.Tensor | float | None
) -> float:
    """NVFP4's per-tensor scale ``amax / (6*448)`` in float32 arithmetic, as a Python float.

    Python floats rather than 0-d tensor ops: this runs once per quantizer call, and on small layers the
    dispatch of five tensor ops cost more than the kernel. Same float32 results: values rounded to float32,
    then a float32 division (a double quotient of two float32 values rounds to the correctly rounded float32
    quotient).
    """
    if global_scale is not None:
        return _to_f32(float(torch.as_tensor(global_scale).reshape(())))
    if amax is None:
        a = float(nan_free_block_amax(x.detach().abs().float().reshape(1, 1, -1)).amax())
    elif isinstance(amax, torch.Tensor):
        a = float(amax if amax.numel() == 1 else amax.amax())  # a non-scalar amax is reduced, as modelopt does
    else:
        a = float(amax)
    return _to_f32(_to_f32(a) / (6.0 * 448.0))


def nan_free_block_amax(xabs: torch.Tensor) -> torch.Tensor:
    # fmaxf / Triton max ignore NaN; torch.amax propagates it, so mask NaN first.
    return torch.nan_to_num(xabs, nan=0.0, posinf=float("inf")).amax(dim=-1, keepdim=True)


def _native_into(x: torch.Tensor, out: torch.Tensor | None, kernel) -> torch.Tensor:
    """Run a native float32 kernel ``kernel(x32, out32)`` for ``x`` of any float dtype with one allocation at most.

    float32 ``x`` is read in place and written to ``out`` (or a new tensor); a 16-bit ``x`` is widened into a
    float32 buffer that the kernel quantizes in place, then narrowed into ``out`` (or a new tensor).
    """
    x = x.detach()
    if x.dtype == torch.float32:
        x = x.contiguous()
        direct = out is not None and out.dtype == torch.float32 and out.is_contiguous() and out.shape == x.shape
        y = kernel(x, out if direct else None)
        return y if out is None or direct else out.copy_(y)
    buf = x.float().contiguous()
    kernel(buf, buf)
    return buf.to(x.dtype) if out is None else out.copy_(buf)


def _check_out(x: torch.Tensor, out: torch.Tensor | None) -> None:
    if out is not None and out.shape != x.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, x has {tuple(x.shape)}: pass an out of x's shape.")


def fake_quant_nvfp4(
    x: torch.Tensor,
    amax: torch.Tensor | float | None,
    block_size: int = 16,
    global_scale: torch.Tensor | float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 quantize->dequantize of ``x`` as modelopt's Triton kernel computes it.

    Args:
        x: tensor of any shape; blocks run along the last dimension.
        amax: the per-tensor amax (the quantizer's calibrated ``_amax``); a non-scalar amax is
            reduced with ``amax()`` as modelopt does; ``None`` uses ``x``'s own amax.
        block_size: elements per E4M3-scaled block (16 for NVFP4).
        global_scale: the per-tensor scale ``amax / (6 * 448)`` itself (an exported ``input_scale``),
            used as given instead of being recomputed from ``amax`` (a round trip can move it an ulp).
        out: a tensor of ``x``'s shape to write the result into (``x`` itself included); a contiguous
            float32 ``out`` for a float32 ``x`` is written by the kernel directly, with no allocation.

    Returns:
        ``out`` when given, otherwise a new tensor of ``x``'s dtype.
    """
    _check_out(x, out)
    gs = nvfp4_global_scale(x, amax, global_scale)
    valid = math.isfinite(gs) and gs > 0
    if _native_ok(x):
        return _native_into(x, out, lambda a, o: native_kernels.native_nvfp4(a, gs, valid, block_size, out=o))
    xb, n = blocked(x, block_size)
    xabs = xb.abs()
    block_max = nan_free_block_amax(xabs)
    if valid:
        gs_t = torch.tensor(gs, dtype=torch.float32, device=x.device)
        scale = torch.clamp(block_max / (6.0 * gs_t), max=448.0).to(torch.float8_e4m3fn).float() * gs_t
        scale = torch.where(scale < 1e-5, torch.ones_like(scale), scale)
    else:  # no usable global scale: every block scale is 1 (modelopt's kernels do the same)
        scale = torch.ones_like(block_max)
    q = round_to_minifloat(xabs / scale, (2, 1)) * scale
    y = torch.where(xb >= 0, q, -q)
    y = torch.where(torch.isnan(xb), xb, y)
    y = unblocked(y, x, n)
    return y if out is None else out.copy_(y)


def _e8m0_unscale_exponent(block_amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """modelopt's ``compute_scale_e8m0_NV``: exponent of 2**ceil(log2(amax / elem_max)), bit-exact."""
    ratio = block_amax / elem_max
    bits = ratio.view(torch.int32)
    exp_field = (bits >> 23) & 0xFF
    sig = bits & 0x7FFFFF
    round_up = (sig > 0) & (exp_field != 0xFE) & ~((exp_field == 0) & (sig <= 0x400000))
    return torch.where(round_up, exp_field - 126, exp_field - 127)


def fake_quant_mx(
    x: torch.Tensor, element: tuple[int, int], block_size: int = 32, out: torch.Tensor | None = None
) -> torch.Tensor:
    """OCP MX quantize->dequantize (E8M0 power-of-two scale per block) as modelopt's CUDA extension.

    ``out``: as for :func:`fake_quant_nvfp4`.
    """
    if element not in FLOAT_FORMAT_MAX:
        raise ValueError(
            f"MX element format E{element[0]}M{element[1]} has no CPU fake quant; on a CPU use one of: "
            f"{CPU_BLOCK_FORMATS}; or run on a GPU (modelopt's CUDA kernels)."
        )
    _check_out(x, out)
    if _native_ok(x):
        m, emin, fmax = element[1], _EMIN[element], FLOAT_FORMAT_MAX[element]
        return _native_into(x, out, lambda a, o: native_kernels.native_mx(a, m, emin, fmax, block_size, out=o))
    xb, n = blocked(x, block_size)
    xabs = xb.abs()
    block_max = nan_free_block_amax(xabs)
    ue = _e8m0_unscale_exponent(block_max, FLOAT_FORMAT_MAX[element])
    degenerate = (block_max == 0) | torch.isinf(block_max)
    ue = torch.where(degenerate, torch.zeros_like(ue), ue)
    scaled = xabs * _pow2(-ue)
    q = round_to_minifloat(scaled, element) * _pow2(ue)
    y = torch.where(xb < 0, -q, q)
    y = torch.where(torch.isnan(xb), xb, y)
    y = unblocked(y, x, n)
    return y if out is None else out.copy_(y)


# The block formats the CPU kernels cover (what error messages offer instead of an unsupported one).
CPU_BLOCK_FORMATS = "NVFP4 (E2M1, E4M3 scales), MXFP4 (E2M1), MXFP6 (E2M3, E3M2), MXFP8 (E4M3)"


def fake_quant_block(
    x: torch.Tensor,
    block_size: int,
    amax: torch.Tensor | None,
    element: tuple[int, int],
    scale_bits: tuple[int, int],
) -> torch.Tensor:
    """Dispatch on modelopt's ``(num_bits, scale_bits)`` for a dynamic block quantizer."""
    if element == (2, 1) and scale_bits == (4, 3):
        return fake_quant_nvfp4(x, amax, block_size)
    if scale_bits == (8, 0):
        return fake_quant_mx(x, element, block_size)
    raise NotImplementedError(
        f"No CPU fake quant for elements E{element[0]}M{element[1]} with scale "
        f"E{scale_bits[0]}M{scale_bits[1]}; on a CPU use one of: {CPU_BLOCK_FORMATS}; or run on a GPU."
    )


# modelopt's FP8 fake quant zeroes no amax: amax at or below this is treated as 1 (``_fp8_eager``).
_FP8_AMAX_EPS = 1.0 / (1 << 24)


def fake_quant_fp8(
    x: torch.Tensor, amax: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """FP8 (E4M3) per-tensor / per-channel fake quant in the arithmetic of the export and the kernel.

    modelopt's fake quant (``_fp8_eager`` and its CUDA ``fake_e4m3fy``) computes
    ``fp8(x * (448 / amax)) * (1 / (448 / amax))``; its exporter writes ``weight_scale = amax / 448``
    and ``fp8(w / weight_scale)`` (``quant_utils.to_quantized_weight``), and TensorRT-LLM's FP8 GEMM
    multiplies the codes by that ``weight_scale``. ``x * (448 / amax)`` and ``x / (amax / 448)``
    differ by a float32 ulp, which moves elements next to an E4M3 rounding boundary by a whole E4M3
    step: on SmolLM2 about 100 weights per FP8 q/k/v layer exported one step (up to 11%) away from
    what was trained. Here training divides by the exported scale, so what deploys is what trained.

    Args:
        amax: the quantizer's amax (training); the scale is ``amax / 448``.
        scale: an exported ``weight_scale`` / ``input_scale`` itself (serving), used as given:
            recomputing it from ``scale * 448`` could move it by an ulp.
    """
    if scale is None:
        if amax is None:
            raise ValueError("fake_quant_fp8 needs amax (training) or scale (an exported scale).")
        a = amax.to(device=x.device, dtype=torch.float32)
        # the exported weight_scale; divided by a device tensor: PyTorch's CUDA division by a Python scalar
        # multiplies by its reciprocal (1/448 is inexact), which is not the exporter's correctly rounded quotient
        scale = torch.where(a <= _FP8_AMAX_EPS, torch.ones_like(a), a) / torch.full((), 448.0, device=a.device)
    dtype = x.dtype
    q = (x.to(torch.float32) / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * scale).to(dtype)
