"""Plugs :mod:`nemo_fp4qat.numerics.fake_quant` into modelopt for CPU tensors only.

modelopt's ``DynamicBlockQuantizationFunction`` (the autograd function used for NVFP4 and MX
quantizers) calls the module-level ``tensor_quant.dynamic_block_quantize_op`` at run time. We wrap
that one op: a CPU input goes to our kernel, anything else goes to modelopt's original op. Because
only the op is replaced, modelopt's own autograd function still decides the backward pass, so the
straight-through estimator is exactly the installed version's (clipped STE by default in 0.37,
pass-through in 0.47). CUDA tensors never reach our code.

On modelopt >= 0.47 we also register a named backend (``cfg["backend"] = "nemo_fp4qat_cpu"``) with
``register_quant_backend`` for users who want to select it explicitly in a quant config.

FP8 (E4M3, per tensor or per channel) is not CUDA-only, but modelopt's eager CPU path multiplies by
``448 / amax`` where its exporter divides by ``amax / 448``; for CPU tensors ``tensor_quant.fp8_eager``
is wrapped the same way and computes with the exported scale (:func:`~.cpu_fake_quant.fake_quant_fp8`),
so a CPU-trained FP8 layer exports to exactly the weights it trained with.

The hook is installed when ``nemo_fp4qat`` is imported; set ``NEMO_FP4QAT_CPU_BACKEND=0`` to opt
out, or call :func:`uninstall_cpu_backend`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from .fake_quant import CPU_BLOCK_FORMATS, fake_quant_block, fake_quant_fp8

__all__ = [
    "BACKEND_NAME",
    "cpu_backend_installed",
    "install_cpu_backend",
    "uninstall_cpu_backend",
]

BACKEND_NAME = "nemo_fp4qat_cpu"
_ORIGINAL_OP: Any = None
_ORIGINAL_FP8: Any = None


def _decode_bits(num_bits: int, exponent_bits: int, scale_num_bits: int, scale_exponent_bits: int):
    """The op's integer signature back to modelopt's ``(E, M)`` tuples."""
    element = (exponent_bits, num_bits - exponent_bits - 1)
    scale = (scale_exponent_bits, scale_num_bits - scale_exponent_bits - 1)
    return element, scale


def _cpu_dynamic_block_quantize_op(
    inputs: torch.Tensor,
    block_size: int,
    amax: torch.Tensor | None,
    num_bits: int,
    exponent_bits: int,
    scale_num_bits: int,
    scale_exponent_bits: int,
) -> torch.Tensor:
    if inputs.device.type != "cpu":  # CUDA: modelopt's own kernels, untouched
        return _ORIGINAL_OP(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
    if exponent_bits == 0:
        # integer MX elements (MXINT8): modelopt has only a CUDA kernel, which would fail obscurely on a CPU tensor
        raise NotImplementedError(
            f"MXINT{num_bits} has no CPU fake quant (modelopt implements it in CUDA only). On a CPU use "
            f"one of: {CPU_BLOCK_FORMATS}; or run on a GPU."
        )
    element, scale = _decode_bits(num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
    with torch.no_grad():
        return fake_quant_block(inputs.detach(), block_size, amax, element, scale)


def _cpu_fp8_eager(x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    if x.device.type != "cpu" or amax is None:
        return _ORIGINAL_FP8(x, amax)  # CUDA without modelopt's extension, or unscaled casts
    return fake_quant_fp8(x, amax)


def _backend_entrypoint(inputs: torch.Tensor, quantizer: Any) -> torch.Tensor:
    """modelopt 0.47 ``register_quant_backend`` entrypoint: same numerics, chosen by config."""
    from modelopt.torch.quantization import tensor_quant

    bs = quantizer.block_sizes or {}
    if bs.get("type") != "dynamic" or not isinstance(quantizer._num_bits, tuple):
        raise ValueError(
            f"Backend {BACKEND_NAME!r} implements dynamic block formats (NVFP4, MXFP4/6/8) only; "
            f"got num_bits={quantizer._num_bits}, block_sizes={bs}. Remove 'backend' from this config."
        )
    amax = None if quantizer.is_mx_format else quantizer._get_amax(inputs)
    return tensor_quant.dynamic_block_quant(
        inputs,
        bs.get(-1) or bs.get(inputs.dim() - 1),
        amax,
        quantizer._get_bias(inputs),
        quantizer._num_bits,
        bs.get("scale_bits"),
        getattr(quantizer, "_trt_high_precision_dtype", None),
        getattr(quantizer, "_onnx_quantizer_type", None),
        quantizer._pass_through_bwd,
    )


def install_cpu_backend() -> bool:
    """Install the CPU op hook (idempotent). Returns True if it is active afterwards."""
    global _ORIGINAL_OP, _ORIGINAL_FP8
    if os.environ.get("NEMO_FP4QAT_CPU_BACKEND", "1") == "0":
        return False
    from modelopt.torch.quantization import tensor_quant

    if _ORIGINAL_OP is None:
        _ORIGINAL_OP = tensor_quant.dynamic_block_quantize_op
        functools.update_wrapper(_cpu_dynamic_block_quantize_op, _ORIGINAL_OP, updated=())
        tensor_quant.dynamic_block_quantize_op = _cpu_dynamic_block_quantize_op
    if _ORIGINAL_FP8 is None:
        _ORIGINAL_FP8 = tensor_quant.fp8_eager
        functools.update_wrapper(_cpu_fp8_eager, _ORIGINAL_FP8, updated=())
        tensor_quant.fp8_eager = _cpu_fp8_eager
    try:
        from modelopt.torch.quantization.nn.modules import tensor_quantizer as tq

        if hasattr(tq, "register_quant_backend") and not tq.is_registered_quant_backend(BACKEND_NAME):
            tq.register_quant_backend(BACKEND_NAME, _backend_entrypoint)
    except ImportError:  # modelopt 0.37: no backend registry; the op hook is the scoped equivalent
        pass
    return True


def uninstall_cpu_backend() -> None:
    """Restore modelopt's original op (and drop the named backend where registered)."""
    global _ORIGINAL_OP, _ORIGINAL_FP8
    from modelopt.torch.quantization import tensor_quant

    if _ORIGINAL_OP is not None:
        tensor_quant.dynamic_block_quantize_op = _ORIGINAL_OP
        _ORIGINAL_OP = None
    if _ORIGINAL_FP8 is not None:
        tensor_quant.fp8_eager = _ORIGINAL_FP8
        _ORIGINAL_FP8 = None
    try:
        from modelopt.torch.quantization.nn.modules import tensor_quantizer as tq

        if hasattr(tq, "unregister_quant_backend"):
            tq.unregister_quant_backend(BACKEND_NAME)
    except ImportError:
        pass


def cpu_backend_installed() -> bool:
    from modelopt.torch.quantization import tensor_quant

    return (
        tensor_quant.dynamic_block_quantize_op is _cpu_dynamic_block_quantize_op
        and tensor_quant.fp8_eager is _cpu_fp8_eager
    )
