"""NVFP4 fake quant for CUDA tensors that equals modelopt's export path bit for bit (a Triton kernel).

modelopt fake-quantizes NVFP4 on a GPU with its own Triton kernel, which divides with Triton's
approximate float32 division and casts through bf16/fp8 types; its exporter (``NVFP4QTensor``) uses
IEEE division. The two disagree on elements next to an E2M1 rounding boundary (by a whole FP4 step),
so what QAT trains on a GPU with modelopt's kernel is not exactly what the exported checkpoint runs.

This kernel computes what :func:`nemo_fp4qat.numerics.fake_quant.fake_quant_nvfp4` (and so the
export path) computes, in explicit IEEE float32 arithmetic and integer bit operations only:

* ``gs = amax / (6 * 448)`` and ``block_amax / (6 * gs)`` with round-to-nearest division
  (``tl.math.div_rn``), the E4M3 block scale rounded to nearest-even by bit operations (no fp8 cast),
  ``s = 1`` where ``s < 1e-5`` or where ``gs`` is not a positive finite number;
* elements ``|x| / s`` (``div_rn``) rounded to E2M1 nearest-even by bit operations, saturating at 6,
  then ``* s``; NaN stays NaN; every multiplication is by an exact power of two or stands alone, so
  contraction into FMA cannot change a result.

One pass per tensor: float32, bfloat16 and float16 tensors are read and written in their own dtype (widened to
float32 in registers, the results rounded to nearest-even as torch's cast rounds, so they equal the CPU path's
float32 results cast back), a partial last block of a row reads zeros past the row's end, and a calibrated amax is
read by the kernel where it lies. The kernel never casts through fp8, and bfloat16 is rounded by bit operations,
so Triton's interpreter (``TRITON_INTERPRET=1``) computes on CPU tensors what the GPU computes, which is how it is
tested without a GPU.

Written by hand because neither modelopt nor any other library ships an NVFP4 fake quant that
rounds like modelopt's exporter on a GPU. ``triton`` is imported only when the kernel is first used.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["triton_available", "triton_nvfp4"]

# Blocks handled by one program instance: 64 on a GPU; more under the interpreter, whose cost is per program.
_BLOCKS_PER_PROGRAM = 64
_BLOCKS_PER_PROGRAM_INTERPRETED = 1024
# the kernel's element dtypes (its DTYPE constant); other float dtypes are computed in float32
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def triton_available() -> bool:
    """True when ``triton`` imports (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel() -> Any:
    """The jitted kernel, imported on first use (triton reads ``TRITON_INTERPRET`` when it is decorated)."""
    from . import _triton_nvfp4_kernel

    return _triton_nvfp4_kernel.nvfp4_fake_quant_kernel


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_nvfp4(x: torch.Tensor, amax: torch.Tensor | float | None, block_size: int = 16) -> torch.Tensor:
    """NVFP4 quantize->dequantize of ``x`` with the Triton kernel; bit for bit modelopt's export path.

    Args:
        x: a CUDA tensor (or a CPU tensor under ``TRITON_INTERPRET=1``) of any shape and float dtype;
            blocks run along the last dimension (a partial last block is zero-padded).
        amax: the per-tensor amax (a non-scalar amax is reduced with ``amax()``, as modelopt does);
            ``None`` uses ``x``'s own amax, NaN ignored.
        block_size: elements per E4M3-scaled block (16 for NVFP4).

    Returns:
        The fake-quantized tensor, same shape and dtype as ``x``.

    Raises:
        RuntimeError: ``x`` is a CPU tensor and ``TRITON_INTERPRET=1`` is not set.
        ImportError: ``triton`` is not installed.

    Example:
        >>> y = triton_nvfp4(w.cuda(), w.abs().amax().cuda())  # doctest: +SKIP
    """
    if x.device.type == "cpu" and not _interpreting():
        raise RuntimeError(
            "triton_nvfp4 runs on CUDA tensors; for CPU tensors use fake_quant_nvfp4 (or set TRITON_INTERPRET=1 "
            "to run the Triton kernel in triton's interpreter)."
        )
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"triton_nvfp4 needs a power-of-two block size (NVFP4 uses 16), got {block_size}")
    n = x.shape[-1] if x.dim() > 0 else 1
    xc = x.detach().contiguous()
    if xc.dtype not in _DTYPE_CODES:
        xc = xc.float()
    y = torch.empty_like(xc)
    amax_t = _amax_operand(xc, amax)
    blocks_per_row = -(-n // block_size)
    nblk = (xc.numel() // n if n else 0) * blocks_per_row
    if nblk:
        code = _DTYPE_CODES[xc.dtype]
        xv, yv = (xc.view(torch.int16), y.view(torch.int16)) if xc.dtype == torch.bfloat16 else (xc, y)
        bpp = _BLOCKS_PER_PROGRAM_INTERPRETED if _interpreting() else _BLOCKS_PER_PROGRAM
        _kernel()[(-(-nblk // bpp),)](xv, yv, amax_t, n, blocks_per_row, nblk, BLOCK=block_size, BPP=bpp,
                                      DTYPE=code)  # fmt: skip
    return y.to(x.dtype)


def _amax_operand(x: torch.Tensor, amax: torch.Tensor | float | None) -> torch.Tensor:
    """The per-tensor amax as a one-element tensor on ``x``'s device, read by the kernel as float32: a calibrated
    one-element amax is passed as it is (no arithmetic, no copy), any other is reduced first."""
    if amax is None:
        return torch.nan_to_num(x.abs(), nan=0.0, posinf=float("inf")).amax().float().reshape(1)
    if isinstance(amax, torch.Tensor) and amax.device == x.device and amax.numel() == 1 and amax.dtype == torch.float32:
        return amax if amax.is_contiguous() else amax.contiguous()
    t = torch.as_tensor(amax, device=x.device)
    return (t.amax() if t.numel() > 1 else t.reshape(())).to(torch.float32).reshape(1)
