"""The numeric check: every exported weight, dequantized by this plugin's unpacker, against the trained
model's fake-quantized weight (FP4: the E2M1 codes must name the same grid point)."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..qat.experts.fused import fused_expert_reference
from .layout import FP4_ALGOS, NVFP4_WEIGHT_ALGOS
from .reader import head_counts
from .unpack import E2M1_VALUES, dequantize_linear, e8m0_to_float, unpack_e2m1_codes
from .validation_report import Problem, ValidationReport

__all__ = ["compare_weights", "mcore_module_of", "model_reference", "resmoothed"]

_MCORE = [
    (r"transformer\.layers\.(\d+)\.attention\.qkv", r"decoder.layers.\1.self_attention.linear_qkv"),
    (r"transformer\.layers\.(\d+)\.attention\.dense", r"decoder.layers.\1.self_attention.linear_proj"),
    (r"transformer\.layers\.(\d+)\.mlp\.fc", r"decoder.layers.\1.mlp.linear_fc1"),
    (r"transformer\.layers\.(\d+)\.mlp\.gate", r"decoder.layers.\1.mlp.linear_fc1"),
    (r"transformer\.layers\.(\d+)\.mlp\.proj", r"decoder.layers.\1.mlp.linear_fc2"),
]
# TRT-LLM names -> Hugging Face Llama-family modules (concatenated along rows when several)
_HF = [
    (r"transformer\.layers\.(\d+)\.attention\.qkv", ["q_proj", "k_proj", "v_proj"], "self_attn"),
    (r"transformer\.layers\.(\d+)\.attention\.dense", ["o_proj"], "self_attn"),
    (r"transformer\.layers\.(\d+)\.mlp\.fc", ["gate_proj"], "mlp"),  # the activated branch
    (r"transformer\.layers\.(\d+)\.mlp\.gate", ["up_proj"], "mlp"),
    (r"transformer\.layers\.(\d+)\.mlp\.proj", ["down_proj"], "mlp"),
]
# Hugging Face Llama-family names -> megatron-core modules (a megatron-core model exported to a unified HF
# checkpoint): the part of the fused module each one is
_MCORE_FROM_HF = [
    (r"model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj", r"decoder.layers.\1.self_attention.linear_qkv"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj", r"decoder.layers.\1.self_attention.linear_proj"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up)_proj", r"decoder.layers.\1.mlp.linear_fc1"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj", r"decoder.layers.\1.mlp.linear_fc2"),
    # mixture-of-experts: routed experts (SequentialMLP, one module per expert) and shared experts
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up)_proj",
        r"decoder.layers.\1.mlp.experts.local_experts.\2.linear_fc1",
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj",
        r"decoder.layers.\1.mlp.experts.local_experts.\2.linear_fc2",
    ),
    (r"model\.layers\.(\d+)\.mlp\.shared_experts?\.(gate|up)_proj", r"decoder.layers.\1.mlp.shared_experts.linear_fc1"),
    (r"model\.layers\.(\d+)\.mlp\.shared_experts?\.down_proj", r"decoder.layers.\1.mlp.shared_experts.linear_fc2"),
]


def mcore_module_of(hf_name: str) -> str | None:
    """The megatron-core module (local layer spec) that holds the Hugging Face linear ``hf_name`` whole or in part."""
    found = next(((m, repl) for pat, repl in _MCORE_FROM_HF if (m := re.fullmatch(pat, hf_name))), None)
    return found[0].expand(found[1]) if found is not None else None


def _qkv_rows(config: dict[str, Any]) -> torch.Tensor:
    """Row order that turns megatron's per-group interleaved [q.., k, v] into TRT-LLM's [Q; K; V]."""
    heads, kv, hd = head_counts(config)
    per = heads // kv
    group = (per + 2) * hd
    q = [g * group + j for g in range(kv) for j in range(per * hd)]
    k = [g * group + per * hd + j for g in range(kv) for j in range(hd)]
    v = [g * group + (per + 1) * hd + j for g in range(kv) for j in range(hd)]
    return torch.tensor(q + k + v)


def _fake_quant(mod: nn.Module, quantized: bool = True) -> torch.Tensor | None:
    """The trained fake-quantized weight, in the weight's own dtype (what training computed with); with
    ``quantized=False`` the weight the quantizer is given."""
    if getattr(mod, "weight_quantizer", None) is None:
        return None
    with torch.no_grad():
        return mod.weight_quantizer(mod.weight.detach()) if quantized else mod.weight.detach()


def model_reference(
    modules: dict[str, nn.Module], name: str, kind: str, config: dict[str, Any], names: set[str],
    quantized: bool = True,
) -> torch.Tensor | None:  # fmt: skip
    """The model's fake-quantized weight for exported module ``name``, in its training dtype (None: no
    counterpart); with ``quantized=False`` the same rows of the weight before its quantizer."""
    fq = functools.partial(_fake_quant, quantized=quantized)
    if name in modules:
        return fq(modules[name])
    if kind == "hf":
        fused = fused_expert_reference(modules, name, quantized)  # an expert of a fused container, exported split
        return fused if fused is not None else _mcore_part(modules, name, config, quantized)
    for pat, leaves, block in _HF:  # Hugging Face model exported to a TRT-LLM checkpoint
        m = re.fullmatch(pat, name)
        found = [modules.get(f"model.layers.{m.group(1)}.{block}.{leaf}") for leaf in leaves] if m else []
        if found and all(f is not None for f in found):
            refs = [fq(f) for f in found]
            return None if any(r is None for r in refs) else torch.cat(refs, 0)
    for pat, repl in _MCORE:  # megatron-core model
        if re.fullmatch(pat, name):
            target = re.sub(pat, repl, name)
            break
    else:
        return None
    ref = fq(modules[target]) if target in modules else None
    if ref is None:
        return None
    if target.endswith("linear_qkv"):
        ref = ref[_qkv_rows(config)]
    if target.endswith("linear_fc1") and f"{name.rsplit('.', 1)[0]}.gate" in names:
        half = ref.shape[0] // 2  # gated MLP: linear_fc1 = [activated half; linear half] -> "fc", "gate"
        ref = ref[:half] if name.endswith(".fc") else ref[half:]
    return ref


def _mcore_part(
    modules: dict[str, nn.Module], name: str, config: dict[str, Any], quantized: bool = True
) -> torch.Tensor | None:
    """The rows of a megatron-core fused module that the Hugging Face module ``name`` holds: q/k/v of
    ``linear_qkv`` (megatron interleaves them per query group), gate/up halves of a gated ``linear_fc1``."""
    target = mcore_module_of(name)
    if target is None:
        return None
    mod = modules.get(target)
    ref = _fake_quant(mod, quantized) if mod is not None else None
    if ref is None:
        return None
    leaf = name.rsplit(".", 1)[1]
    if leaf in ("q_proj", "k_proj", "v_proj"):
        heads, kv, hd = head_counts(config)
        q_rows, kv_rows = heads * hd, kv * hd
        ref = ref[_qkv_rows(config)]  # [Q; K; V]
        start, size = {"q_proj": (0, q_rows), "k_proj": (q_rows, kv_rows), "v_proj": (q_rows + kv_rows, kv_rows)}[leaf]
        return ref[start : start + size]
    if leaf in ("gate_proj", "up_proj"):
        half = ref.shape[0] // 2  # gated MLP: linear_fc1 = [activated half (gate); linear half (up)]
        return ref[:half] if leaf == "gate_proj" else ref[half:]
    return ref


def resmoothed(modules: dict[str, nn.Module], name: str, t: dict[str, torch.Tensor]) -> bool:
    """Whether the exporter changed this layer's smoothing scale (so its weights were requantized)."""
    mod = modules.get(name)
    iq = getattr(mod, "input_quantizer", None)
    trained = getattr(iq, "_pre_quant_scale", None) if iq is not None else None
    if trained is None:
        return False
    exported = t.get("pre_quant_scale")
    return exported is None or not torch.allclose(exported.double().flatten(), trained.double().flatten(), rtol=1e-6)


def compare_weights(
    rep: ValidationReport, mod: str, algo: str, t: dict[str, torch.Tensor], ref: torch.Tensor,
    unquantized: Callable[[], torch.Tensor | None] | None = None,
) -> None:  # fmt: skip
    """Compare one exported layer with ``ref``, the trained fake-quantized weight in its training dtype.

    ``unquantized`` gives the weight before its quantizer: an INT / FP8 value that lies on a rounding tie (half
    way between two grid points, to float32 rounding) may be rounded either way by the exporter's arithmetic and
    the training kernel's; such elements are excused, counted and named, any other difference is an error.

    A bfloat16 / float16 model trains on ``code * scale`` rounded to its dtype, so the comparison allows that
    dtype's rounding (and no more): an FP4 code differs when ``ref / scale`` is further from the exported code's
    E2M1 value than one unit in the last place of the dtype (grid points are at least 0.5 apart, so this cannot
    mistake a neighbouring code for the trained one)."""
    eps = torch.finfo(ref.dtype).eps if ref.is_floating_point() else 0.0
    code_tol, value_tol = max(1e-5, eps), max(2e-6, eps)
    ref = ref.detach().to("cpu", torch.float64)  # checkpoint tensors load on the CPU; the model may be on a GPU
    num = rep.numeric
    try:
        got = dequantize_linear(t, algo)
    except Exception as e:  # reported as a problem of this tensor
        rep.error(f"{mod}.weight", f"cannot be unpacked as {algo}: {e}")
        return
    if got.shape != ref.shape:
        rep.error(f"{mod}.weight", f"unpacks to shape {tuple(got.shape)} but the model's weight is {tuple(ref.shape)}.")
        return
    num["layers_compared"] = num.get("layers_compared", 0) + 1
    if algo.upper() in FP4_ALGOS:
        codes = unpack_e2m1_codes(t["weight"]).long()
        if algo.upper() in NVFP4_WEIGHT_ALGOS:
            s = (t["weight_scale"].float() * t["weight_scale_2"].float().reshape(())).double()
        else:
            s = e8m0_to_float(t["weight_scale"])
        s = s.repeat_interleave(codes.shape[-1] // s.shape[-1], dim=-1)
        want = ref / s  # the model's E2M1 values (up to the rounding of q * s to fp32 and to the training dtype)
        # The exported code must name exactly the model's E2M1 value. E2M1 grid points are >= 0.5
        # apart, so a distance below 1e-5 relative means "same grid point", and anything else is a
        # different code or a model value off the grid (both errors). Zero scales carry no codes.
        code_values = E2M1_VALUES[codes]
        differ = ((want - code_values).abs() > code_tol * code_values.abs().clamp_min(0.5)) & (s != 0)
        if algo.upper() in NVFP4_WEIGHT_ALGOS and bool(differ.any()):
            excused = _excuse_tiny_blocks(rep, mod, t, ref, differ)
            differ &= ~excused
            got = torch.where(excused, ref, got)  # within the bound the warning states
        bad = int(differ.sum())
        num["fp4_codes_compared"] = num.get("fp4_codes_compared", 0) + codes.numel()
        num["fp4_codes_different"] = num.get("fp4_codes_different", 0) + bad
        if bad:
            rep.error(
                f"{mod}.weight", f"{bad} of {codes.numel()} FP4 codes differ from the trained fake-quant weights."
            )
            return
    denom = ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
    off = (got - ref).abs() > value_tol * denom
    if algo.upper() not in FP4_ALGOS and unquantized is not None and bool(off.any()):
        got = _excuse_ties(rep, mod, got, ref, unquantized())
    rel = ((got - ref).abs() / denom).max().item() if ref.numel() else 0.0
    num["max_rel_error"] = max(num.get("max_rel_error", 0.0), rel)
    if not math.isfinite(rel) or rel > value_tol:
        rep.error(f"{mod}.weight", f"dequantized weights differ from the trained fake-quant weights (max rel error "
                  f"{rel:.3g}, allowed {value_tol:.3g}: the rounding of the scale product, and of the training "
                  "dtype).")  # fmt: skip


def _excuse_ties(
    rep: ValidationReport, mod: str, got: torch.Tensor, ref: torch.Tensor, raw: torch.Tensor | None
) -> torch.Tensor:
    """``got`` with the elements whose unquantized value is the midpoint of the exported and the trained value
    (a rounding tie, within float32 rounding of it) set to the trained value; the count goes to the report."""
    if raw is None or raw.shape != ref.shape:
        return got
    raw = raw.detach().to("cpu", torch.float64)
    step = (got - ref).abs()
    tie = (step > 0) & ((raw - (got + ref) / 2).abs() <= 1e-4 * step)
    n = int(tie.sum())
    if n:
        rep.numeric["rounding_ties_excused"] = rep.numeric.get("rounding_ties_excused", 0) + n
        msg = (f"{n} weight(s) on a rounding tie (half way between two grid points) rounded the other way than in "
               "training; both roundings are exact.")  # fmt: skip
        rep.warnings.append(Problem(f"{mod}.weight", msg))
    return torch.where(tie, ref, got)


# modelopt's NVFP4 training kernels (Triton on GPUs; this plugin's CPU kernels follow them) give a
# block whose scale fp8(block_amax / (6 gs)) * gs is below 1e-5 the scale 1, so its trained values are
# all 0; modelopt's exporter (NVFP4QTensor) keeps the block at its tiny scale (0.47 clamps the FP8
# ratio up to 2**-9 first), so its codes are not 0. The two disagree only on blocks whose values are
# all below 6e-5 (or 6 * 2**-9 * gs): excused, counted and named, everything else must match exactly.
_TRAINING_MIN_SCALE = 1e-5


def _excuse_tiny_blocks(
    rep: ValidationReport, mod: str, t: dict[str, torch.Tensor], ref: torch.Tensor, differ: torch.Tensor
) -> torch.Tensor:
    """Elements of blocks whose difference is the training kernel's scale rule (see above)."""
    scale = t["weight_scale"].float()
    gs = float(t["weight_scale_2"].float().reshape(()))
    block = differ.shape[-1] // scale.shape[-1]
    s = (scale * gs).double()
    floor = max(_TRAINING_MIN_SCALE, 2.0**-9 * gs) * (1 + 2**-20)
    zero_in_training = (ref.reshape(*scale.shape, block) == 0).all(dim=-1) & (s <= floor)
    excused = differ.reshape(*scale.shape, block).any(dim=-1) & zero_in_training
    n = int(excused.sum())
    if n:
        rep.numeric["fp4_tiny_blocks_excused"] = rep.numeric.get("fp4_tiny_blocks_excused", 0) + n
        rep.warnings.append(
            Problem(
                f"{mod}.weight",
                (
                    f"{n} block(s) of values below {6 * floor:.1e} are 0 in training (modelopt's kernel scale rule) "
                    "but kept by modelopt's exporter; the difference is below that bound."
                ),
            )
        )
    return excused.repeat_interleave(block, dim=-1)
