"""Per-algorithm tensor layout: which tensors, dtypes and shapes a runtime needs for one linear layer."""

from __future__ import annotations

from typing import Any

import torch

from .validation_report import ValidationReport

__all__ = ["FLOAT_DTYPES", "FP4_ALGOS", "NVFP4_WEIGHT_ALGOS", "SCALE_NAMES", "check_layout", "layer_layout"]

F8 = torch.float8_e4m3fn
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALE_NAMES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")
# the same weight tensors; NVFP4 and W4A8 add an input_scale, W4A16_NVFP4 (weights only) has none
NVFP4_WEIGHT_ALGOS = ("NVFP4", "W4A8_NVFP4_FP8", "W4A16_NVFP4")
FP4_ALGOS = (*NVFP4_WEIGHT_ALGOS, "MXFP4", "W4A16_MXFP4")  # upper case; modelopt writes dense MXFP4 as "mxfp4"


class _Rule:
    """A shape rule that is not one fixed shape, with the words an error message states it in (a bare lambda
    printed as ``<function ...>`` in the message)."""

    def __init__(self, text: str, ok: Any) -> None:
        self.text, self.ok = text, ok

    def __call__(self, t: torch.Tensor) -> bool:
        return bool(self.ok(t))

    def __str__(self) -> str:
        return self.text


_scalar = _Rule("a per-tensor scalar", lambda t: t.numel() == 1)


def _values(n: int) -> _Rule:
    """One value per row or per input channel."""
    return _Rule(f"{n} values", lambda t: t.numel() == n)


def layer_layout(algo: str, t: dict[str, torch.Tensor], group_size: int | None) -> list[tuple[str, Any, Any]]:
    """[(tensor, allowed dtypes, expected shape or predicate)] for one layer; shapes from the weight."""
    w = t["weight"]
    algo = algo.upper()
    if algo in NVFP4_WEIGHT_ALGOS:
        o, i = w.shape[0], w.shape[1] * 2
        spec = [("weight", (torch.uint8,), (o, i // 2)), ("weight_scale", (F8,), (o, i // 16)),
                ("weight_scale_2", (torch.float32,), _scalar)]  # fmt: skip
        return spec if algo == "W4A16_NVFP4" else [*spec, ("input_scale", (torch.float32,), _scalar)]
    if algo in ("MXFP4", "W4A16_MXFP4"):
        o, i = w.shape[0], w.shape[1] * 2
        return [("weight", (torch.uint8,), (o, i // 2)), ("weight_scale", (torch.uint8,), (o, i // 32))]
    if algo == "MXFP8":
        o, i = w.shape
        return [("weight", (F8,), (o, i)), ("weight_scale", (torch.uint8,), (o, i // 32))]
    if algo == "FP8":
        o, i = w.shape
        per_channel = _Rule(f"1 or {o} values", lambda s: s.numel() in (1, o))
        return [("weight", (F8,), (o, i)), ("weight_scale", (torch.float32,), per_channel),
                ("input_scale", (torch.float32,), _scalar)]  # fmt: skip
    if algo in ("W8A16", "W8A8_SQ_PER_CHANNEL"):
        o, i = w.shape
        spec = [("weight", (torch.int8,), (o, i)), ("weight_scale", FLOAT_DTYPES, _values(o))]
        if algo == "W8A8_SQ_PER_CHANNEL":
            spec += [
                ("input_scale", (torch.float32,), _scalar),
                ("pre_quant_scale?", FLOAT_DTYPES, _values(i)),
            ]
        return spec
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        o, i = w.shape[0] * 2, w.shape[1]
        g = group_size or 128
        grids = ((o, i // g), (i // g, o))  # either orientation of one scale per group
        per_group = _Rule(f"{grids[0]} or {grids[1]}", lambda s: tuple(s.shape) in grids)
        return [("weight", (torch.uint8, torch.int8), (o // 2, i)), ("weight_scale", FLOAT_DTYPES, per_group),
                ("pre_quant_scale?", FLOAT_DTYPES, _values(i))]  # fmt: skip
    return []


def check_layout(rep: ValidationReport, mod: str, algo: str, t: dict[str, torch.Tensor], group: int | None) -> bool:
    ok = True
    for name, dtypes, shape in layer_layout(algo, t, group):
        # "?": optional. modelopt folds a smoothing pre_quant_scale into the preceding norm when
        # siblings (q/k/v, gate/up) share their input, so only some layers keep one.
        optional, name = name.endswith("?"), name.rstrip("?")
        full = f"{mod}.{name}"
        if name not in t and optional:
            continue
        if name not in t:
            rep.error(full, f"missing: a {algo} layer needs {name} (scale tensors are part of the checkpoint format).")
            ok = False
            continue
        v = t[name]
        if v.dtype not in dtypes:
            rep.error(full, f"dtype {v.dtype} but {algo} requires {' or '.join(str(d) for d in dtypes)}.")
            ok = False
        good = shape(v) if callable(shape) else tuple(v.shape) == tuple(shape)
        if not good:
            rep.error(full, f"shape {tuple(v.shape)} does not fit {algo} with weight {tuple(t['weight'].shape)} "
                      f"(expected {shape}).")  # fmt: skip
            ok = False
        if v.dtype in FLOAT_DTYPES and not torch.isfinite(v.float()).all():
            rep.error(full, "contains NaN/Inf.")
            ok = False
    return ok
