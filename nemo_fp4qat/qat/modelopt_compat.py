"""One translation layer between our resolved per-quantizer formats and modelopt 0.37 / 0.47.

The two supported modelopt lines differ in ways that silently change numerics:

* quant config: 0.37 takes a dict ``{glob: attrs, "default": attrs}``; 0.47 an ordered list of
  ``{"quantizer_name": glob, "cfg": attrs, "enable": bool}`` (it still accepts the dict, deprecated);
* ``set_quantizer_by_cfg``: 0.37 *merges* attributes into the existing quantizer (a switch
  NVFP4 -> FP8 keeps the stale ``block_sizes``), 0.47 *replaces* them.

We always emit one exact entry per quantizer with a *complete* attribute set
(:meth:`QuantFormat.quantizer_cfg`), after a catch-all "disable everything", so both versions end
in the same quantizer state. Everything version-specific lives here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from packaging.version import Version

from nemo_fp4qat.numerics.formats import QuantFormat, get_format
from nemo_fp4qat.qat.experts.fused import quantizer_glob

__all__ = [
    "QuantizerAssignment",
    "apply_quant_cfg",
    "build_quant_cfg",
    "calibration_algorithm",
    "modelopt_version",
    "quantizer_format_signature",
    "uses_list_config",
]

# (module name) -> (weight format, input format)
QuantizerAssignment = Mapping[str, tuple[QuantFormat, QuantFormat]]


@functools.cache
def modelopt_version() -> Version:
    import modelopt

    return Version(modelopt.__version__.split("+")[0])


def uses_list_config() -> bool:
    """True for modelopt >= 0.40 (ordered-list quant_cfg with replace semantics)."""
    return modelopt_version() >= Version("0.40")


def _entries(assignment: QuantizerAssignment) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for module_name, (wfmt, ifmt) in assignment.items():
        out.append((quantizer_glob(module_name, "weight"), get_format(wfmt).quantizer_cfg("weight")))
        out.append((quantizer_glob(module_name, "input"), get_format(ifmt).quantizer_cfg("input")))
    return out


def calibration_algorithm(formats: list[QuantFormat]) -> str | dict[str, Any] | None:
    """One modelopt algorithm that serves every format in use (AWQ > SmoothQuant > max)."""
    algos = [f.calib_algorithm for f in formats if not f.is_full_precision]
    for algo in algos:
        if isinstance(algo, dict) and str(algo.get("method", "")).startswith("awq"):
            return algo
    if "smoothquant" in algos:
        return "smoothquant"
    return "max" if algos else None


def build_quant_cfg(
    assignment: QuantizerAssignment,
    algorithm: str | dict[str, Any] | object | None = ...,
    extra: list[tuple[str, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """A modelopt ``mtq.quantize`` config for the installed modelopt version.

    Args:
        assignment: module name -> (weight format, input format); full precision disables.
        algorithm: calibration algorithm; by default the one the formats need.
        extra: further ``(quantizer glob, attrs)`` entries appended last (e.g. KV-cache quantizers).
    """
    entries = _entries(assignment) + list(extra or [])
    if algorithm is ...:
        fmts = [get_format(f) for pair in assignment.values() for f in pair]
        algorithm = calibration_algorithm(fmts)
    if uses_list_config():
        quant_cfg: Any = [{"quantizer_name": "*", "enable": False}]
        for name, attrs in entries:
            attrs = dict(attrs)
            enable = attrs.pop("enable", True)
            if enable and attrs:
                quant_cfg.append({"quantizer_name": name, "cfg": attrs, "enable": True})
            else:
                quant_cfg.append({"quantizer_name": name, "enable": False})
    else:
        quant_cfg = {"default": {"enable": False}}
        for name, attrs in entries:
            quant_cfg[name] = dict(attrs)
    return {"quant_cfg": quant_cfg, "algorithm": algorithm}


def apply_quant_cfg(model: Any, quant_cfg: Any) -> None:
    """``set_quantizer_by_cfg`` for either version (configs from :func:`build_quant_cfg`)."""
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg

    set_quantizer_by_cfg(model, quant_cfg)


def quantizer_format_signature(quantizer: Any) -> dict[str, Any]:
    """The attributes that define a quantizer's numerics, for comparing configurations."""
    bs = quantizer.block_sizes
    return {
        "enable": bool(quantizer.is_enabled),
        "num_bits": quantizer.num_bits if quantizer.is_enabled else None,
        "axis": quantizer.axis if quantizer.is_enabled else None,
        "block_sizes": dict(bs) if (bs and quantizer.is_enabled) else None,
    }
