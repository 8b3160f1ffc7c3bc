"""``nemo-fp4qat validate``: check an exported checkpoint the way a runtime would, and against the model.

Checks, for unified HF and TensorRT-LLM (qnemo) checkpoints alike:

1. completeness (the export manifest, every listed file present with its size);
2. ``quant_algo`` / ``kv_cache_quant_algo`` values the runtime accepts;
3. per linear layer, the tensors, dtypes and shapes its algorithm needs (a missing scale, a wrong
   dtype or a scale grid that does not tile the weight is named with the tensor);
4. fused siblings (q/k/v, gate/up) share ``input_scale`` and ``weight_scale_2`` (TensorRT-LLM's
   loader asserts this); tensor-parallel ranks agree on shared scales;
5. excluded modules really are unquantized; a unified HF checkpoint names its 16-bit linear layers and its KV-cache
   format where the engines' loaders look (:mod:`.engine_fields`);
6. with the trained model: every exported weight, dequantized by this plugin's own unpacker,
   equals the model's fake-quantized weight (FP4: the E2M1 codes equal exactly, ties included;
   otherwise within the rounding of the scale product); and every unquantized tensor (embeddings,
   norms, lm_head, biases) equals the model's rounded to the checkpoint's dtype, which for a
   TensorRT-LLM checkpoint is the dtype its ``config.json`` declares.
"""

from __future__ import annotations

import fnmatch
import math
import re
from pathlib import Path

import torch
import torch.nn as nn

from ..architectures import fused_sibling_sets
from ..qat.experts.moe import expert_projections
from .atomic import file_sha256, read_manifest
from .engine_fields import engine_field_problems, is_fused_alias, layer_entry
from .gpt_oss_mxfp4 import is_gpt_oss_mxfp4_checkpoint, validate_gpt_oss_mxfp4
from .hub_names import model_name_resolver
from .layout import FLOAT_DTYPES, SCALE_NAMES, check_layout, layer_layout
from .reader import group_by_module, load_export, merge_ranks
from .runtime_support import (
    ENGINE_QUANT_ALGOS,
    ENGINE_RUNTIMES,
    HF_ONLY_RUNTIMES,
    RUNTIMES,
    TRTLLM_KV_CACHE_QUANT_ALGOS,
    TRTLLM_QUANT_ALGOS,
)
from .unquantized_check import compare_unquantized, declared_dtype
from .validation_report import Problem, ValidationReport
from .weight_check import compare_weights, model_reference, resmoothed

__all__ = ["Problem", "ValidationReport", "load_export", "validate_export"]

_EMBEDDING = re.compile(r"(embed|vocab_embedding|lm_head|output_layer)")
# the layers that deploy fused (architectures.py), and TensorRT-LLM checkpoints' fc / gate
_FUSED = [*fused_sibling_sets(), ("fc", "gate")]
_SMOOTHED = ("W4A16_AWQ", "W4A8_AWQ", "W8A8_SQ_PER_CHANNEL")


# --- entry point ---------------------------------------------------------------------------------
def validate_export(
    path: str | Path, model: nn.Module | None = None, runtime: str = "trtllm", require_manifest: bool = True
) -> ValidationReport:
    """Validate the checkpoint at ``path`` (see the module docstring); ``model`` adds the numeric check."""
    if runtime not in RUNTIMES:
        raise ValueError(f"Unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}.")
    path = Path(path)
    if is_gpt_oss_mxfp4_checkpoint(path):
        rep = validate_gpt_oss_mxfp4(path, model, runtime)
        _check_manifest(rep, path, require_manifest)
        return rep
    kind, qcfg, ranks = load_export(path)
    algo = qcfg.get("quant_algo")
    kv = qcfg.get("kv_cache_quant_algo")
    rep = ValidationReport(str(path), kind, algo, kv, runtime)
    _check_manifest(rep, path, require_manifest)

    if algo is None:
        rep.error("quant_algo", "not set: the checkpoint declares no quantization.")
    elif runtime == "trtllm" and algo not in TRTLLM_QUANT_ALGOS:
        fix = (
            " (modelopt writes 'mxfp4' for dense MXFP4; TRT-LLM deploys MXFP4 only as W4A8_MXFP4_FP8/W4A16_MXFP4)"
            if str(algo).lower() == "mxfp4"
            else ""
        )
        rep.error("quant_algo", f"{algo!r} is not a TensorRT-LLM QuantAlgo{fix}; re-export with a format TRT-LLM "
                  "deploys, or validate with runtime='pytorch' for this plugin's own server.")  # fmt: skip
    elif runtime in HF_ONLY_RUNTIMES and algo not in ENGINE_QUANT_ALGOS[runtime] | {"MIXED_PRECISION"}:
        rep.error("quant_algo", f"{algo!r} has no kernel in {runtime}'s modelopt loader; re-export for this runtime "
                  "(its preflight names the layers), or validate with runtime='trtllm' / 'pytorch'.")  # fmt: skip
    config = qcfg.get("_config", {})
    if runtime in ENGINE_RUNTIMES and kind == "hf" and declared_dtype(config, kind) == "float32":
        rep.warnings.append(Problem("config.json", f"declares float32; {runtime} runs 16-bit activations (vLLM "
                                    "downcasts to bfloat16), so what it runs is not what was validated. Re-export "
                                    f"for runtime={runtime!r}, which writes float16."))  # fmt: skip
    if runtime in HF_ONLY_RUNTIMES and kind == "trtllm":
        rep.error(str(path), f"a TensorRT-LLM checkpoint; {runtime} loads unified HF checkpoints (export kind='hf').")
    if kv is not None and kv not in TRTLLM_KV_CACHE_QUANT_ALGOS:
        rep.error("kv_cache_quant_algo", f"{kv!r} is not one of {sorted(TRTLLM_KV_CACHE_QUANT_ALGOS)}.")

    tensors = merge_ranks(ranks, config, rep) if kind == "trtllm" else ranks[0]
    mods = group_by_module(tensors)
    mixed = qcfg.get("quantized_layers") or {}
    excludes = list(qcfg.get("exclude_modules") or [])
    group = qcfg.get("group_size")

    def layer_algo(mod: str, t: dict[str, torch.Tensor]) -> str | None:
        if algo == "MIXED_PRECISION":
            entry = layer_entry(mod, mixed)
            return entry.get("quant_algo") if entry else None
        if any(fnmatch.fnmatch(mod, p) or mod == p for p in excludes):
            return None
        if _EMBEDDING.search(mod) and not any(n in t for n in SCALE_NAMES):
            return None
        return algo

    model_modules = dict(model.named_modules()) if model is not None else {}
    model_name = model_name_resolver(model) if model is not None and kind == "hf" else (lambda name: name)
    skipped: dict[str, str] = {}  # quantized layers the numeric check could not compare, and why
    names = set(mods)
    for mod, t in sorted(mods.items()):
        w = t.get("weight")
        if w is None or w.dim() != 2:
            continue
        a = layer_algo(mod, t)
        rep.layers[mod] = a
        if a is None:
            carried = [n for n in SCALE_NAMES if n in t and n != "pre_quant_scale"]
            if carried or w.dtype not in FLOAT_DTYPES:
                rep.error(f"{mod}.weight", f"the config excludes this module from quantization but it has dtype "
                          f"{w.dtype} and scales {carried}; excluded modules must be stored unquantized.")  # fmt: skip
            continue
        if runtime == "trtllm" and a not in TRTLLM_QUANT_ALGOS:
            rep.error(mod, f"layer quant_algo {a!r} is not a TensorRT-LLM QuantAlgo.")
        elif runtime in HF_ONLY_RUNTIMES and a not in ENGINE_QUANT_ALGOS[runtime]:
            rep.error(mod, f"layer quant_algo {a!r} has no kernel in {runtime}'s modelopt loader (it runs "
                      f"{', '.join(sorted(ENGINE_QUANT_ALGOS[runtime]))}).")  # fmt: skip
        if not layer_layout(a, t, group):
            rep.error(mod, f"no layout known for quant_algo {a!r}.")
            continue
        layout_ok = check_layout(rep, mod, a, t, group)
        top = float(t["weight_scale"].float().max()) if layout_ok and a.upper() == "W4A8_NVFP4_FP8" else 0.0
        if top * 6.0 > 448.0:
            # the W4A8 kernel dequantizes code * block scale to FP8 (max 448) before the FP8 GEMM
            rep.error(f"{mod}.weight_scale", f"max {top:g} > 448 / 6: the W4A8 kernel's FP8 dequantization of the "
                      "weights would overflow (weight_scale_2 must be amax / 448).")  # fmt: skip
            layout_ok = False
        if layout_ok and model is not None:
            ref = model_reference(model_modules, model_name(mod), kind, config, names)
            if ref is None:
                rep.numeric["layers_without_counterpart"] = rep.numeric.get("layers_without_counterpart", 0) + 1
                skipped[mod] = "no layer of the given model maps to this exported layer"
            elif a.upper() in _SMOOTHED and resmoothed(model_modules, mod, t):
                # modelopt's HF exporter re-smooths siblings that share an input (q/k/v, gate/up; one
                # averaged pre_quant_scale, or folded into the preceding norm) and requantizes their
                # weights: what deploys is not bit-for-bit what was trained. Reported, not hidden.
                rep.numeric["resmoothed_layers"] = rep.numeric.get("resmoothed_layers", 0) + 1
                msg = "numeric check skipped: the exporter re-smoothed (pre_quant_scale changed) and requantized."
                rep.warnings.append(Problem(f"{mod}.weight", msg))
                skipped[mod] = "re-smoothed and requantized by the exporter"
            else:

                def unquantized(mod: str = mod) -> torch.Tensor | None:
                    return model_reference(model_modules, model_name(mod), kind, config, names, quantized=False)

                compare_weights(rep, mod, a, t, ref, unquantized)

    if model is not None:
        quantized = {m for m, a in rep.layers.items() if a is not None}
        compare_unquantized(rep, tensors, quantized, model, kind, config, model_name)

    expert_containers = {layer for layer, _ in expert_projections(mods)}
    for mod in mixed:
        if mod not in mods and not is_fused_alias(mod, mixed) and mod not in expert_containers:
            rep.error(mod, "listed in quantized_layers but the checkpoint has no tensors for it.")

    # fused siblings: TRT-LLM loads q/k/v and gate/up as one GEMM with one input_scale / weight_scale_2
    for mod in mods:
        parent, _, leaf = mod.rpartition(".")
        for group_names in _FUSED:
            if leaf != group_names[0]:
                continue
            sibs = [f"{parent}.{n}" for n in group_names if f"{parent}.{n}" in mods]
            for attr in ("input_scale", "weight_scale_2"):
                vals = [mods[s][attr] for s in sibs if attr in mods[s]]
                if len(vals) > 1 and any(not torch.equal(v.float(), vals[0].float()) for v in vals[1:]):
                    rep.error(f"{parent}.{{{','.join(group_names)}}}.{attr}",
                              f"fused siblings disagree ({[float(v.float().max()) for v in vals]}); TensorRT-LLM "
                              "loads them as one GEMM with one scale. Train with share_fused_amax=True.")  # fmt: skip

    # a MoE layer's experts: the engines' fused MoE kernels take one input scale per projection for all of them
    for (layer, proj), experts in expert_projections(mods).items():
        scales = [mods[e]["input_scale"] for e in experts if "input_scale" in mods[e]]
        if len(scales) > 1 and any(not torch.equal(s.float(), scales[0].float()) for s in scales[1:]):
            values = sorted({float(s.float().max()) for s in scales})
            rep.error(f"{layer}.*.{proj}.input_scale",
                      f"the experts disagree ({len(values)} values from {values[0]:g} to {values[-1]:g}); the "
                      "engines run a layer's experts as one fused GEMM with one input scale, so they would deploy "
                      "with another quantization than trained. Train with this plugin (it ties them after every "
                      "calibration) or recalibrate.")  # fmt: skip

    if model is not None and kind == "trtllm":
        _check_rotary_base(rep, model, config)

    if kv is not None:
        kv_scales = [k for k in tensors if k.endswith(("k_scale", "v_scale", "kv_cache_scaling_factor"))]
        if not kv_scales:
            rep.error("kv_cache_quant_algo", f"declares {kv} but no KV-cache scale tensors (k_scale/v_scale) exist.")
    if kind == "hf":
        for where, what in engine_field_problems(path):
            rep.error(where, what + "; re-export with this version of nemo-fp4qat.")
    if skipped:
        rep.numeric["layers_skipped"] = skipped
    if model is not None and not rep.numeric.get("layers_compared"):
        rep.warnings.append(Problem(str(path), "no exported layer matched a model layer: numeric check skipped."))
    return rep


def _check_manifest(rep: ValidationReport, path: Path, require_manifest: bool) -> None:
    """Every file the export manifest lists is present, with its size and sha256."""
    manifest = read_manifest(path)
    if manifest is None:
        if require_manifest:
            rep.warnings.append(Problem(str(path), "no nemo_fp4qat manifest: not written by nemo-fp4qat export."))
        return
    for rel, meta in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != meta["bytes"]:
            rep.error(rel, "missing or truncated (size differs from the export manifest).")
        elif "sha256" in meta and file_sha256(f) != meta["sha256"]:
            rep.error(rel, "contents differ from the export manifest (sha256): changed after export; re-export.")


def _check_rotary_base(rep: ValidationReport, model: nn.Module, config: dict) -> None:
    """A TensorRT-LLM checkpoint runs the rotary base its ``config.json`` names (10000 where it names none): the
    trained model's, or another model."""
    hf = getattr(model, "config", None)
    rope = getattr(hf, "rope_parameters", None)
    theta = getattr(hf, "rope_theta", None) or (rope.get("rope_theta") if isinstance(rope, dict) else None)
    written = config.get("rotary_base", 10000.0)
    if theta is not None and not math.isclose(float(written), float(theta)):
        rep.error("config.json", f"rotary_base {written:g}{'' if 'rotary_base' in config else ' (not written)'} but "
                  f"the model was trained with rope_theta {theta:g}: TensorRT-LLM would run another model. "
                  "Re-export with this plugin's exporter (it gives modelopt the base).")  # fmt: skip
