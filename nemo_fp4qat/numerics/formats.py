"""The quantization formats this plugin trains in, and what each needs from modelopt.

A :class:`QuantFormat` is the single source of truth for one numeric format: its element type,
block and scale layout, its storage cost (bits per element *including* scales), the modelopt
``QuantizerAttributeConfig`` fields for weights and for inputs, the calibration algorithm it needs,
and where it can be deployed (TensorRT-LLM ``quant_algo``, GPU generations). Everything else in the
package (policies, schedules, export checks, reports) looks formats up here by name.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FORMATS",
    "FULL_PRECISION",
    "QuantFormat",
    "format_of_quantizer",
    "get_format",
    "list_formats",
]

# Attribute names that a complete quantizer config always carries. modelopt 0.37 *merges*
# attributes when a quantizer is reconfigured (a switch NVFP4 -> FP8 would keep the stale
# ``block_sizes``), 0.47 replaces them; emitting every field explicitly makes both behave the same.
_COMPLETE_FIELDS: dict[str, Any] = {"num_bits": 8, "axis": None, "block_sizes": None}


def _dyn_block(block: int, scale_bits: tuple[int, int]) -> dict[str, Any]:
    return {-1: block, "type": "dynamic", "scale_bits": scale_bits}


@dataclass(frozen=True)
class QuantFormat:
    """One numeric format.

    Attributes:
        name: registry key (lower case, e.g. ``"nvfp4"``).
        element: ``(exponent_bits, mantissa_bits)`` for floats, ``("int", bits)`` for integers,
            ``None`` for full precision.
        block_size: elements sharing one scale (``None``: per tensor or per channel).
        scale: the scale's type: ``"e4m3"`` (NVFP4), ``"e8m0"`` (MX), ``"fp32"``.
        bits_per_element: storage cost including block scales (per-tensor scales are negligible).
        weight_cfg / input_cfg: modelopt quantizer attributes; ``None`` leaves that quantizer off.
        calib_algorithm: the modelopt algorithm that sets its amax (``None``: dynamic, no amax).
        trtllm_quant_algo: TensorRT-LLM ``QuantAlgo`` value for deployment, ``None`` if TRT-LLM
            has no kernel for it (MXFP6, dense MXFP4 as modelopt writes it).
        hardware: GPU generations with native kernels for it.
        needs_amax: whether the quantizer's static ``_amax`` enters the numerics (and must be
            recalibrated when switching to this format).
    """

    name: str
    element: tuple[Any, int] | None
    block_size: int | None
    scale: str
    bits_per_element: float
    weight_cfg: dict[str, Any] | None
    input_cfg: dict[str, Any] | None
    calib_algorithm: str | dict[str, Any] | None
    trtllm_quant_algo: str | None
    hardware: tuple[str, ...] = ()
    needs_amax: bool = True
    description: str = ""
    aliases: tuple[str, ...] = field(default=())

    @property
    def is_full_precision(self) -> bool:
        return self.element is None

    @property
    def is_block_dynamic(self) -> bool:
        """Formats modelopt fake-quantizes with its CUDA-only dynamic block kernels."""
        cfg = self.weight_cfg or {}
        bs = cfg.get("block_sizes") or {}
        return bs.get("type") == "dynamic"

    def quantizer_cfg(self, kind: str) -> dict[str, Any]:
        """The *complete* modelopt attribute dict for ``kind`` in {"weight", "input"}.

        Every field in ``_COMPLETE_FIELDS`` is present, so applying it over an existing quantizer
        leaves nothing of the previous format behind under either modelopt version.
        """
        if kind not in ("weight", "input"):
            raise ValueError(f"kind must be 'weight' or 'input', got {kind!r}")
        cfg = self.weight_cfg if kind == "weight" else self.input_cfg
        if cfg is None:
            return {"enable": False}
        out = dict(_COMPLETE_FIELDS)
        out.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in cfg.items()})
        out["enable"] = True
        return out

    def weight_bytes(self, numel: int) -> float:
        """Bytes to store ``numel`` weights in this format, scales included."""
        return numel * self.bits_per_element / 8.0


_FP8 = {"num_bits": (4, 3), "axis": None}

FULL_PRECISION = QuantFormat(
    name="bf16",
    element=None,
    block_size=None,
    scale="none",
    bits_per_element=16.0,
    weight_cfg=None,
    input_cfg=None,
    calib_algorithm=None,
    trtllm_quant_algo=None,
    hardware=("ampere", "hopper", "blackwell"),
    needs_amax=False,
    description="Full precision (no fake quantization; bf16 on GPU, fp32 on CPU).",
    aliases=("full", "none", "fp32", "fp16", "fp", "full_precision"),
)

_ALL: tuple[QuantFormat, ...] = (
    FULL_PRECISION,
    QuantFormat(
        name="nvfp4",
        element=(2, 1),
        block_size=16,
        scale="e4m3",
        bits_per_element=4.0 + 8.0 / 16,
        weight_cfg={"num_bits": (2, 1), "block_sizes": _dyn_block(16, (4, 3)), "axis": None},
        input_cfg={"num_bits": (2, 1), "block_sizes": _dyn_block(16, (4, 3)), "axis": None},
        calib_algorithm="max",
        trtllm_quant_algo="NVFP4",
        hardware=("blackwell",),
        description="E2M1 elements, blocks of 16 with an E4M3 scale, plus an FP32 per-tensor scale.",
        aliases=("fp4",),
    ),
    QuantFormat(
        name="mxfp4",
        element=(2, 1),
        block_size=32,
        scale="e8m0",
        bits_per_element=4.0 + 8.0 / 32,
        weight_cfg={"num_bits": (2, 1), "block_sizes": _dyn_block(32, (8, 0))},
        input_cfg={"num_bits": (2, 1), "block_sizes": _dyn_block(32, (8, 0))},
        calib_algorithm=None,
        # modelopt writes quant_algo "mxfp4" for dense MXFP4, which TensorRT-LLM rejects; only the
        # weight-only / W4A8 variants below have TRT-LLM kernels.
        trtllm_quant_algo=None,
        hardware=("blackwell",),
        needs_amax=False,
        description="OCP MX: E2M1 elements, blocks of 32 with an E8M0 (power of two) scale.",
    ),
    QuantFormat(
        name="mxfp6_e2m3",
        element=(2, 3),
        block_size=32,
        scale="e8m0",
        bits_per_element=6.0 + 8.0 / 32,
        weight_cfg={"num_bits": (2, 3), "block_sizes": _dyn_block(32, (8, 0))},
        input_cfg={"num_bits": (2, 3), "block_sizes": _dyn_block(32, (8, 0))},
        calib_algorithm=None,
        trtllm_quant_algo=None,
        hardware=("blackwell",),
        needs_amax=False,
        description="OCP MX: E2M3 elements (more mantissa), blocks of 32, E8M0 scale. Training-only.",
        aliases=("fp6", "mxfp6"),
    ),
    QuantFormat(
        name="mxfp6_e3m2",
        element=(3, 2),
        block_size=32,
        scale="e8m0",
        bits_per_element=6.0 + 8.0 / 32,
        weight_cfg={"num_bits": (3, 2), "block_sizes": _dyn_block(32, (8, 0))},
        input_cfg={"num_bits": (3, 2), "block_sizes": _dyn_block(32, (8, 0))},
        calib_algorithm=None,
        trtllm_quant_algo=None,
        hardware=("blackwell",),
        needs_amax=False,
        description="OCP MX: E3M2 elements (more range), blocks of 32, E8M0 scale. Training-only.",
    ),
    QuantFormat(
        name="mxfp8",
        element=(4, 3),
        block_size=32,
        scale="e8m0",
        bits_per_element=8.0 + 8.0 / 32,
        weight_cfg={"num_bits": (4, 3), "block_sizes": _dyn_block(32, (8, 0))},
        input_cfg={"num_bits": (4, 3), "block_sizes": _dyn_block(32, (8, 0))},
        calib_algorithm=None,
        trtllm_quant_algo=None,
        hardware=("blackwell",),
        needs_amax=False,
        description="OCP MX: E4M3 elements, blocks of 32, E8M0 scale.",
    ),
    QuantFormat(
        name="fp8",
        element=(4, 3),
        block_size=None,
        scale="fp32",
        bits_per_element=8.0,
        weight_cfg=dict(_FP8),
        input_cfg=dict(_FP8),
        calib_algorithm="max",
        trtllm_quant_algo="FP8",
        hardware=("hopper", "blackwell"),
        description="E4M3 with one FP32 scale per tensor (weights and inputs).",
        aliases=("fp8_e4m3",),
    ),
    QuantFormat(
        name="int8_sq",
        element=("int", 8),
        block_size=None,
        scale="fp32",
        bits_per_element=8.0,
        weight_cfg={"num_bits": 8, "axis": 0},
        input_cfg={"num_bits": 8, "axis": None},
        calib_algorithm="smoothquant",
        trtllm_quant_algo="W8A8_SQ_PER_CHANNEL",
        hardware=("ampere", "hopper", "blackwell"),
        description="INT8 per-channel weights, INT8 per-tensor inputs with SmoothQuant (W8A8).",
        aliases=("int8", "w8a8", "smoothquant"),
    ),
    QuantFormat(
        name="int8_wo",
        element=("int", 8),
        block_size=None,
        scale="fp32",
        bits_per_element=8.0,
        weight_cfg={"num_bits": 8, "axis": 0},
        input_cfg=None,
        calib_algorithm="max",
        trtllm_quant_algo="W8A16",
        hardware=("ampere", "hopper", "blackwell"),
        description="INT8 per-channel weights, full-precision inputs (W8A16).",
        aliases=("w8a16",),
    ),
    QuantFormat(
        name="int4_awq",
        element=("int", 4),
        block_size=128,
        scale="fp16",
        bits_per_element=4.0 + 16.0 / 128,
        weight_cfg={"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}},
        input_cfg=None,
        calib_algorithm={"method": "awq_lite", "alpha_step": 0.1},
        trtllm_quant_algo="W4A16_AWQ",
        hardware=("ampere", "hopper", "blackwell"),
        description="INT4 weights in blocks of 128 (AWQ), full-precision inputs (W4A16).",
        aliases=("w4a16", "awq"),
    ),
)

FORMATS: dict[str, QuantFormat] = {f.name: f for f in _ALL}
_ALIASES: dict[str, str] = {a: f.name for f in _ALL for a in f.aliases}


def get_format(name: str | QuantFormat) -> QuantFormat:
    """Look a format up by name or alias (case-insensitive).

    Raises:
        ValueError: naming the unknown format, the closest known name and the full list.
    """
    if isinstance(name, QuantFormat):
        return name
    if not isinstance(name, str):
        raise TypeError(f"format must be a name or QuantFormat, got {type(name).__name__}")
    key = name.strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key in FORMATS:
        return FORMATS[key]
    known = sorted(set(FORMATS) | set(_ALIASES))
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"Unknown quantization format {name!r}.{hint} Known formats: {', '.join(known)}.")


def format_of_quantizer(quantizer: Any) -> QuantFormat:
    """The registered format a (weight) quantizer is configured as; full precision if disabled."""
    if quantizer is None or not quantizer.is_enabled:
        return FULL_PRECISION

    def norm(v: Any) -> Any:  # modelopt may hand back lists where the config had tuples
        return tuple(v) if isinstance(v, (list, tuple)) else v

    bs = dict(quantizer.block_sizes or {})
    for f in FORMATS.values():
        cfg = f.weight_cfg
        if not cfg or norm(cfg["num_bits"]) != norm(quantizer.num_bits):
            continue
        fbs = cfg.get("block_sizes") or {}
        if fbs.get(-1) == bs.get(-1) and norm(fbs.get("scale_bits")) == norm(bs.get("scale_bits")):
            return f
    raise ValueError(f"Weight quantizer {quantizer} matches no registered format; add it to formats.py.")


def format_name_of(quantizer: Any) -> str | None:
    """The registered format's name of ``quantizer``, or None for a configuration no format describes."""
    try:
        return format_of_quantizer(quantizer).name
    except ValueError:
        return None


def list_formats() -> list[QuantFormat]:
    """All registered formats, in registry order."""
    return list(FORMATS.values())
