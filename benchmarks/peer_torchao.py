"""torchao's NVFP4 QAT as a peer row for the accuracy benchmarks, run on a CPU.

torchao's API is used as published (``quantize_(model, QATConfig(NVFP4DynamicActivationNVFP4WeightConfig(),
step="prepare"))``, which swaps every selected ``nn.Linear`` for its ``NVFP4FakeQuantizedLinear``). Its
forward quantizes input and weight with its own ``NVFP4Tensor.to_nvfp4`` (dynamic per-tensor + per-16
E4M3 block scales, no calibration) and multiplies them with an FP4 GEMM (``torch._scaled_mm``), which
exists only on Blackwell GPUs. Here that one GEMM is replaced by the matmul of the same two tensors
dequantized (what the FP4 tensor core computes, up to fp32 accumulation order); quantization, the
backward (dequantized operands, straight-through) and the module swap stay torchao's own code.
"""

from __future__ import annotations

import torch
import torch.nn as nn

TORCHAO_VERSION = "0.18.0"


def _dequantized_addmm(a, b, aten_op, bias):  # signature of torchao's _addmm_nvfp4_dispatch
    out = a.dequantize(torch.float32) @ b.dequantize(torch.float32)
    return out if bias is None else out + bias


def torchao_available() -> str | None:
    """None when torchao imports, else the reason (shown in the results table)."""
    try:
        import torchao  # noqa: F401
    except ImportError as e:
        return f"torchao is not installed ({e}); `make bench` installs requirements/bench.txt"
    return None


def prepare_torchao_nvfp4_qat(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Swap the model's linears (except ``skip``, as modelopt's default config skips lm_head) for
    torchao's NVFP4 fake-quantized linears, with the FP4 GEMM emulated on the CPU."""
    import torchao.prototype.qat.nvfp4 as tq
    from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    if torch.cuda.is_available():
        raise RuntimeError("prepare_torchao_nvfp4_qat emulates the FP4 GEMM for CPUs; on a GPU use torchao directly.")
    tq._addmm_nvfp4_dispatch = _dequantized_addmm  # the only replaced piece (Blackwell-only kernel)
    cfg = QATConfig(NVFP4DynamicActivationNVFP4WeightConfig(use_triton_kernel=False), step="prepare")
    quantize_(model, cfg, filter_fn=lambda m, name: isinstance(m, nn.Linear) and not name.endswith(skip))
    n = sum(type(m).__name__ == "NVFP4FakeQuantizedLinear" for m in model.modules())
    if n == 0:
        raise RuntimeError("torchao swapped no linear layer; check the model and the skip list.")
    return model
