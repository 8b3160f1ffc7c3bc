"""Which NVFP4 fake-quant kernel CUDA tensors use: ``"exact"`` (this package's Triton kernel, which rounds as
modelopt's exporter does) or ``"modelopt"`` (modelopt's own kernel); a process-wide setting that the CPU backend
(:mod:`.cpu_backend`) and the static NVFP4 forwards (:mod:`.static_nvfp4`) both read."""

from __future__ import annotations

import os

__all__ = ["CUDA_NVFP4_KERNELS", "cuda_nvfp4_kernel", "set_cuda_nvfp4_kernel"]

# NVFP4 fake quant of CUDA tensors: "exact" (the export path's rounding, Triton) or "modelopt" (its own kernel).
CUDA_NVFP4_KERNELS = ("exact", "modelopt")
_CUDA_NVFP4_KERNEL: str | None = None  # None: from NEMO_FP4QAT_CUDA_NVFP4 (default "exact")


def _check_kernel_name(name: str, source: str) -> str:
    if name not in CUDA_NVFP4_KERNELS:
        raise ValueError(
            f"{source}={name!r} is not a CUDA NVFP4 kernel; use one of {list(CUDA_NVFP4_KERNELS)}: 'exact' trains "
            "with the exporter's rounding (train = deploy), 'modelopt' with modelopt's own Triton kernel."
        )
    return name


def cuda_nvfp4_kernel() -> str:
    """The NVFP4 fake-quant kernel CUDA tensors use now: ``"exact"`` (default) or ``"modelopt"``."""
    if _CUDA_NVFP4_KERNEL is not None:
        return _CUDA_NVFP4_KERNEL
    return _check_kernel_name(os.environ.get("NEMO_FP4QAT_CUDA_NVFP4", "exact"), "NEMO_FP4QAT_CUDA_NVFP4")


def set_cuda_nvfp4_kernel(name: str | None) -> str | None:
    """Choose the NVFP4 fake-quant kernel for CUDA tensors (process-wide); returns the previous setting.

    Args:
        name: ``"exact"`` (a Triton kernel rounding as modelopt's exporter does), ``"modelopt"`` (modelopt's
            own Triton kernel), or ``None`` to follow ``NEMO_FP4QAT_CUDA_NVFP4`` again.

    Raises:
        ValueError: ``name`` is none of those.

    Example:
        >>> previous = set_cuda_nvfp4_kernel("modelopt")  # train with modelopt's kernel on GPUs
    """
    global _CUDA_NVFP4_KERNEL
    previous = _CUDA_NVFP4_KERNEL
    _CUDA_NVFP4_KERNEL = None if name is None else _check_kernel_name(name, "cuda_nvfp4_kernel")
    return previous
