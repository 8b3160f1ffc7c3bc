"""The plugin's own unpacker for exported quantized linear weights.

Written by hand on purpose: it is the independent side of the export check (``validate``) and the
weight loader of the PyTorch serving backend, so it must not reuse modelopt's packing code it is
checking. Layouts (modelopt's exporters, TensorRT-LLM / unified HF checkpoints):

- NVFP4: ``weight`` uint8 [out, in/2], two E2M1 codes per byte, even element in the low nibble;
  ``weight_scale`` float8_e4m3fn [out, in/16]; ``weight_scale_2`` fp32 scalar.
  w = E2M1[code] * weight_scale * weight_scale_2.
- MXFP4: ``weight`` as NVFP4, ``weight_scale`` uint8 E8M0 [out, in/32]; w = E2M1[code] * 2^(s-127).
- MXFP8: ``weight`` float8_e4m3fn [out, in], ``weight_scale`` uint8 E8M0 [out, in/32].
- FP8: ``weight`` float8_e4m3fn, ``weight_scale`` fp32 scalar (or per output channel).
- INT8 (W8A16, W8A8 SmoothQuant): ``weight`` int8 [out, in], ``weight_scale`` fp32 [out].
- INT4 AWQ (W4A16_AWQ): ``weight`` uint8 [out/2, in], rows 2j (low nibble) and 2j+1 (high nibble),
  signed two's complement; ``weight_scale`` [out, in/group].
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_VALUES",
    "TRTLLM_TO_HF_NAMES",
    "dequantize_fp8",
    "dequantize_int4_awq",
    "dequantize_int8",
    "dequantize_linear",
    "dequantize_mxfp4",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "e8m0_to_float",
    "unpack_e2m1_codes",
]

# E2M1 code -> value: sign bit 3, exponent bits 2-1, mantissa bit 0 (OCP MX spec table).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float64
)

# TensorRT-LLM checkpoint tensor names -> unified HF names.
TRTLLM_TO_HF_NAMES = {
    "weights_scaling_factor": "weight_scale",
    "weights_scaling_factor_2": "weight_scale_2",
    "activation_scaling_factor": "input_scale",
    "prequant_scaling_factor": "pre_quant_scale",
}


def unpack_e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> uint8 codes [..., n] (even element from the low nibble)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 weights must be uint8, got {packed.dtype}")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> float64 powers of two (255 is NaN)."""
    if s.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8, got {s.dtype}")
    v = torch.pow(torch.tensor(2.0, dtype=torch.float64), s.to(torch.float64) - 127.0)
    return torch.where(s == 255, torch.tensor(float("nan"), dtype=torch.float64), v)


def _expand_blocks(scale: torch.Tensor, n: int) -> torch.Tensor:
    block = n // scale.shape[-1]
    if block * scale.shape[-1] != n:
        raise ValueError(f"scale has {scale.shape[-1]} blocks per row, which does not divide {n} elements")
    return scale.repeat_interleave(block, dim=-1)


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    codes = unpack_e2m1_codes(weight)
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"NVFP4 weight_scale must be float8_e4m3fn, got {weight_scale.dtype}")
    # (block scale x global scale) in fp32 first: the order modelopt's fake quant uses.
    scale = (weight_scale.to(torch.float32) * weight_scale_2.to(torch.float32).reshape(())).to(torch.float64)
    return E2M1_VALUES[codes.long()] * _expand_blocks(scale, codes.shape[-1])


def dequantize_mxfp4(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    codes = unpack_e2m1_codes(weight)
    return E2M1_VALUES[codes.long()] * _expand_blocks(e8m0_to_float(weight_scale), codes.shape[-1])


def dequantize_mxfp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"MXFP8 weight must be float8_e4m3fn, got {weight.dtype}")
    return weight.to(torch.float64) * _expand_blocks(e8m0_to_float(weight_scale), weight.shape[-1])


def _per_tensor_or_channel(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype, algo: str):
    if weight.dtype != dtype:
        raise TypeError(f"{algo} weight must be {dtype}, got {weight.dtype}")
    s = weight_scale.to(torch.float64)
    s = s.reshape(()) if s.numel() == 1 else s.reshape(-1, 1)
    return weight.to(torch.float64) * s


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    return _per_tensor_or_channel(weight, weight_scale, torch.float8_e4m3fn, "FP8")


def dequantize_int8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    return _per_tensor_or_channel(weight, weight_scale, torch.int8, "INT8")


def dequantize_int4_awq(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    w = weight.view(torch.uint8) if weight.dtype == torch.int8 else weight
    if w.dtype != torch.uint8:
        raise TypeError(f"INT4 AWQ weight must be uint8 (or int8 in TRT-LLM checkpoints), got {weight.dtype}")
    lo = (w & 0x0F).to(torch.int16)
    hi = (w >> 4).to(torch.int16)
    lo = torch.where(lo > 7, lo - 16, lo)
    hi = torch.where(hi > 7, hi - 16, hi)
    q = torch.stack([lo, hi], dim=1).reshape(w.shape[0] * 2, w.shape[1])  # rows 2j, 2j+1
    return q.to(torch.float64) * _expand_blocks(weight_scale.to(torch.float64), q.shape[-1])


def dequantize_linear(tensors: dict[str, torch.Tensor], quant_algo: str | None) -> torch.Tensor:
    """Dequantize one exported linear (tensor names as in a unified HF checkpoint) to float64."""
    algo = (quant_algo or "").upper()
    w = tensors["weight"]
    if algo in ("", "NO_QUANT", "NONE"):
        return w.to(torch.float64)
    try:
        if algo in ("NVFP4", "W4A8_NVFP4_FP8", "W4A16_NVFP4"):
            return dequantize_nvfp4(w, tensors["weight_scale"], tensors["weight_scale_2"])
        if algo in ("MXFP4", "W4A16_MXFP4"):
            return dequantize_mxfp4(w, tensors["weight_scale"])
        if algo == "MXFP8":
            return dequantize_mxfp8(w, tensors["weight_scale"])
        if algo == "FP8":
            return dequantize_fp8(w, tensors["weight_scale"])
        if algo in ("W8A16", "W8A8_SQ_PER_CHANNEL", "INT8"):
            return dequantize_int8(w, tensors["weight_scale"])
        if algo in ("W4A16_AWQ", "W4A8_AWQ"):
            return dequantize_int4_awq(w, tensors["weight_scale"])
    except KeyError as e:
        raise KeyError(f"{algo} layer is missing tensor {e.args[0]!r}") from e
    raise ValueError(f"No unpacker for quant_algo {quant_algo!r}")
