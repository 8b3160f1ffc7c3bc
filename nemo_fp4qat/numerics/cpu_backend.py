"""Plugs :mod:`nemo_fp4qat.numerics.fake_quant` into modelopt for CPU tensors only.

modelopt's ``DynamicBlockQuantizationFunction`` (the autograd function used for NVFP4 and MX
quantizers) calls the module-level ``tensor_quant.dynamic_block_quantize_op`` at run time. We wrap
that one op: a CPU input goes to our kernel, anything else goes to modelopt's original op. Because
only the op is replaced, modelopt's own autograd function still decides the backward pass, so the
straight-through estimator is exactly the installed version's (clipped STE by default in 0.37,
pass-through in 0.47). CUDA tensors: see below.

On modelopt >= 0.47 we also register a named backend (``cfg["backend"] = "nemo_fp4qat_cpu"``) with
``register_quant_backend`` for users who want to select it explicitly in a quant config.

FP8 (E4M3, per tensor or per channel) is not CUDA-only, but modelopt's fake quant (its eager path and its
CUDA extension ``fake_e4m3fy``) multiplies by ``448 / amax`` where its exporter divides by ``amax / 448``, which
moves elements next to an E4M3 rounding boundary by a whole step. ``tensor_quant.fp8_eager`` (CPU tensors) and
``tensor_quant.scaled_e4m3_impl`` (CUDA tensors, unless the kernel choice below is ``"modelopt"``) are wrapped
to compute with the exported scale (:func:`~.fake_quant.fake_quant_fp8`), so an FP8 layer trained on either
device exports to exactly the weights it trained with.

CUDA tensors: NVFP4 goes to :func:`~.triton_nvfp4.triton_nvfp4` by default, a Triton kernel that
rounds exactly as modelopt's exporter (``NVFP4QTensor``) does, so what QAT trains on a GPU is what
the exported checkpoint runs (modelopt's own Triton kernel divides approximately and differs from its
exporter by a whole FP4 step on elements next to a rounding boundary). Only the op is replaced here
too, so the straight-through estimator stays modelopt's. ``set_cuda_nvfp4_kernel("modelopt")``
(``QATConfig(cuda_nvfp4_kernel="modelopt")``, or ``NEMO_FP4QAT_CUDA_NVFP4=modelopt``) goes back to
modelopt's kernel, for FP8 too; the MX formats on CUDA are always modelopt's (its kernels equal its exporter).

modelopt >= 0.46's static per-block NVFP4 (weights after ``mse`` / ``local_hessian`` / Four-Over-Six
calibration) and LSQ's FP4 cast are Triton-only in modelopt; :mod:`.static_nvfp4` runs them in torch on CPU
tensors, and on CUDA tensors unless the kernel choice is ``"modelopt"``.

The hook is installed when ``nemo_fp4qat`` is imported; set ``NEMO_FP4QAT_CPU_BACKEND=0`` to opt
out (CPU and CUDA routing both), or call :func:`uninstall_cpu_backend`.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from . import weight_reuse
from .fake_quant import CPU_BLOCK_FORMATS, fake_quant_block, fake_quant_fp8
from .kernel_choice import CUDA_NVFP4_KERNELS, cuda_nvfp4_kernel, set_cuda_nvfp4_kernel

__all__ = [
    "BACKEND_NAME",
    "CUDA_NVFP4_KERNELS",
    "cpu_backend_installed",
    "cuda_nvfp4_kernel",
    "install_cpu_backend",
    "set_cuda_nvfp4_kernel",
    "uninstall_cpu_backend",
]

BACKEND_NAME = "nemo_fp4qat_cpu"
_ORIGINAL_OP: Any = None
_ORIGINAL_FP8: Any = None
_ORIGINAL_FP8_IMPL: Any = None
log = logging.getLogger("nemo_fp4qat")

_NVFP4_OP_BITS = (4, 2, 8, 4)  # (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) of NVFP4


@functools.lru_cache(maxsize=1)
def _exact_kernel_usable() -> bool:
    from .triton_nvfp4 import triton_available

    if triton_available():
        return True
    log.warning("triton is not installed: NVFP4 on CUDA uses modelopt's kernel, which rounds unlike its exporter")
    return False


def _cuda_dynamic_block_quantize(
    inputs: torch.Tensor,
    block_size: int,
    amax: torch.Tensor | None,
    num_bits: int,
    exponent_bits: int,
    scale_num_bits: int,
    scale_exponent_bits: int,
) -> torch.Tensor:
    """The op for a non-CPU tensor: NVFP4 through the exact kernel (unless set otherwise), the rest modelopt's."""
    nvfp4 = (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) == _NVFP4_OP_BITS
    if nvfp4 and cuda_nvfp4_kernel() == "exact" and _exact_kernel_usable():
        from .triton_nvfp4 import triton_nvfp4

        with torch.no_grad():
            return triton_nvfp4(inputs.detach(), amax, block_size)
    return _ORIGINAL_OP(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)


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
    fmt = (block_size, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
    return weight_reuse.kept_or_computed(inputs, amax, fmt, lambda: _block_quantize(inputs, amax, fmt))


def _block_quantize(inputs: torch.Tensor, amax: torch.Tensor | None, fmt: tuple[int, ...]) -> torch.Tensor:
    """The op's work: ``fmt`` is its ``(block_size, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)``."""
    block_size, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits = fmt
    if inputs.device.type != "cpu":
        return _cuda_dynamic_block_quantize(
            inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits
        )
    if exponent_bits == 0:
        # integer MX elements (MXINT8): modelopt has only a CUDA kernel, which would fail obscurely on a CPU tensor
        raise NotImplementedError(
            f"MXINT{num_bits} has no CPU fake quant (modelopt implements it in CUDA only). On a CPU use "
            f"one of: {CPU_BLOCK_FORMATS}; or run on a GPU."
        )
    element, scale = _decode_bits(num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
    with torch.no_grad():
        return fake_quant_block(inputs.detach(), block_size, amax, element, scale)


_FP8 = ("fp8",)  # the weight-reuse key of per-tensor / per-channel FP8 (E4M3)


def _cpu_fp8_eager(x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
    if x.device.type != "cpu" or amax is None:
        return _ORIGINAL_FP8(x, amax)  # CUDA without modelopt's extension, or unscaled casts
    return weight_reuse.kept_or_computed(x, amax, _FP8, lambda: fake_quant_fp8(x, amax))


def _exact_scaled_e4m3_impl(inputs: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """modelopt's ``scaled_e4m3_impl`` (FP8 fake quant) with the exporter's division on CUDA tensors."""
    if inputs.device.type == "cpu" or amax is None or cuda_nvfp4_kernel() != "exact":
        return _ORIGINAL_FP8_IMPL(inputs=inputs, amax=amax)  # CPU tensors reach fp8_eager (wrapped above)
    return weight_reuse.kept_or_computed(inputs, amax, _FP8, lambda: fake_quant_fp8(inputs, amax))


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
    global _ORIGINAL_OP, _ORIGINAL_FP8, _ORIGINAL_FP8_IMPL
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
    if _ORIGINAL_FP8_IMPL is None:
        _ORIGINAL_FP8_IMPL = tensor_quant.scaled_e4m3_impl
        functools.update_wrapper(_exact_scaled_e4m3_impl, _ORIGINAL_FP8_IMPL, updated=())
        tensor_quant.scaled_e4m3_impl = _exact_scaled_e4m3_impl
    from .static_nvfp4 import install_static_nvfp4

    install_static_nvfp4()  # modelopt >= 0.46: static per-block NVFP4 and LSQ's FP4 cast
    try:
        from modelopt.torch.quantization.nn.modules import tensor_quantizer as tq

        if hasattr(tq, "register_quant_backend") and not tq.is_registered_quant_backend(BACKEND_NAME):
            tq.register_quant_backend(BACKEND_NAME, _backend_entrypoint)
    except ImportError:  # modelopt 0.37: no backend registry; the op hook is the scoped equivalent
        pass
    return True


def uninstall_cpu_backend() -> None:
    """Restore modelopt's original op (and drop the named backend where registered)."""
    global _ORIGINAL_OP, _ORIGINAL_FP8, _ORIGINAL_FP8_IMPL
    from modelopt.torch.quantization import tensor_quant

    if _ORIGINAL_OP is not None:
        tensor_quant.dynamic_block_quantize_op = _ORIGINAL_OP
        _ORIGINAL_OP = None
    if _ORIGINAL_FP8 is not None:
        tensor_quant.fp8_eager = _ORIGINAL_FP8
        _ORIGINAL_FP8 = None
    if _ORIGINAL_FP8_IMPL is not None:
        tensor_quant.scaled_e4m3_impl = _ORIGINAL_FP8_IMPL
        _ORIGINAL_FP8_IMPL = None
    from .static_nvfp4 import uninstall_static_nvfp4

    uninstall_static_nvfp4()
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
        and tensor_quant.scaled_e4m3_impl is _exact_scaled_e4m3_impl
    )
