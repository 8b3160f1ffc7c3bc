"""What the deployment runtimes accept, and the checks that refuse an export before it is written.

The accepted ``quant_algo`` values are TensorRT-LLM's ``QuantAlgo`` enum
(``tensorrt_llm/quantization/mode.py``, TRT-LLM 1.2) and ``KV_CACHE_QUANT_ALGO_LIST``; TensorRT-LLM
cannot be installed on CPU machines, so the lists are written down here (and checked by
``nemo-fp4qat validate``) instead of imported. vLLM's and SGLang's are the per-layer algorithms their
modelopt loaders give a linear kernel; ``make test-engines`` checks both lists against the engines' own code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..numerics.formats import QuantFormat, format_of_quantizer
from ..qat.calibration.w4a8_scaling import calibrated_w4a8_layers, w4a8_export_amax
from ..qat.modelopt_compat import uses_list_config
from ..qat.policy.rules import ENGINE_RUNTIMES, RUNTIMES, is_quantizer

__all__ = [
    "ENGINE_QUANT_ALGOS",
    "ENGINE_RUNTIMES",
    "HF_ONLY_RUNTIMES",
    "RUNTIMES",
    "SGLANG_QUANT_ALGOS",
    "TRTLLM_KV_CACHE_QUANT_ALGOS",
    "TRTLLM_QUANT_ALGOS",
    "VLLM_QUANT_ALGOS",
    "ExportRefused",
    "LayerFormat",
    "preflight",
    "quantized_layers",
]

TRTLLM_QUANT_ALGOS = frozenset(
    {
        "W8A16", "W4A16", "W4A16_AWQ", "W4A8_AWQ", "W8A16_GPTQ", "W4A16_GPTQ", "W8A8_SQ_PER_CHANNEL",
        "W8A8_SQ_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
        "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN",
        "W4A8_QSERVE_PER_GROUP", "W4A8_QSERVE_PER_CHANNEL", "FP8", "FP8_PER_CHANNEL_PER_TOKEN",
        "FP8_BLOCK_SCALES", "MIXED_PRECISION", "NVFP4", "W4A8_NVFP4_FP8", "W4A8_MXFP4_FP8",
        "W4A8_MXFP4_MXFP8", "W4A16_MXFP4", "NO_QUANT",
    }
)  # fmt: skip
TRTLLM_KV_CACHE_QUANT_ALGOS = frozenset({"FP8", "INT8", "NVFP4"})
# vLLM 0.32's LINEAR_ALGOS (model_executor/layers/quantization/modelopt.py)
VLLM_QUANT_ALGOS = frozenset({"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8"})
# SGLang 0.5.23's ModelOptMixedPrecisionConfig.get_quant_method (srt/layers/quantization/modelopt_quant.py); a layer
# with any other algorithm gets its unquantized linear method, which then fails on the packed weight's shape
SGLANG_QUANT_ALGOS = frozenset({"FP8", "FP8_PB_WO", "FP8_BLOCK_SCALES", "MXFP8", "NVFP4", "W4A16_NVFP4"})
HF_ONLY_RUNTIMES = ("vllm", "sglang")  # they load unified HF checkpoints only
ENGINE_QUANT_ALGOS = {"trtllm": TRTLLM_QUANT_ALGOS, "vllm": VLLM_QUANT_ALGOS, "sglang": SGLANG_QUANT_ALGOS}
_ENGINE_NAMES = {"trtllm": "TensorRT-LLM", "vllm": "vLLM", "sglang": "SGLang"}


class ExportRefused(ValueError):
    """An export a runtime would reject; raised before anything is written."""


@dataclass(frozen=True)
class LayerFormat:
    module: str
    weight: QuantFormat
    in_features: int
    out_features: int


def quantized_layers(model: nn.Module) -> list[LayerFormat]:
    """Every linear whose weight quantizer is enabled, with the format it is in now."""
    out = []
    for name, mod in model.named_modules():
        wq = getattr(mod, "weight_quantizer", None)
        if wq is None or not is_quantizer(wq) or not wq.is_enabled:
            continue
        w = getattr(mod, "weight", None)
        if w is None or w.dim() != 2:
            continue
        out.append(LayerFormat(name, format_of_quantizer(wq), w.shape[1], w.shape[0]))
    return out


def _w4a8_exporter_problems(model: nn.Module) -> list[str]:
    """Ask the installed modelopt exporter which per-tensor scale it writes for a W4A8 layer.

    TensorRT-LLM's W4A8_NVFP4_FP8 kernel needs ``weight_scale_2 = amax / 448`` (modelopt 0.47 writes
    that); modelopt 0.37 writes the W4A4 scale ``amax / (6 * 448)``, whose block scales overflow the
    kernel's FP8 weight dequantization.
    """
    layers = list(calibrated_w4a8_layers(model))
    if not layers:  # none, or not calibrated (reported per layer by preflight)
        return []
    import modelopt
    from modelopt.torch.export.quant_utils import get_weight_scaling_factor_2

    name, mod = layers[0]
    with w4a8_export_amax(model):
        amax = float(mod.weight_quantizer._amax.float().max())
        got = float(get_weight_scaling_factor_2(mod).float().reshape(-1)[0])
    if abs(got * 448.0 - amax) <= 1e-6 * max(amax, 1e-12):
        return []
    return [
        f"{name} (and {len(layers) - 1} more W4A8 layers): modelopt {modelopt.__version__} exports W4A8_NVFP4_FP8 with "
        f"weight_scale_2 = amax / {amax / got:.0f}, but TensorRT-LLM's W4A8 kernel needs amax / 448 (its block scales "
        "would overflow the FP8 weight dequantization). Export with modelopt 0.47 (the core environment), or train "
        "the MLP with NVFP4 inputs (policy 'trtllm_mixed')."
    ]


def _input_format(iq: nn.Module | None) -> str:
    return "bf16" if iq is None or not iq.is_enabled else format_of_quantizer(iq).name


def _mixed_fused_siblings(model: nn.Module, layers: list[LayerFormat]) -> list[str]:
    """Fused siblings (q/k/v, gate/up) in different formats: modelopt's exporters assert "Modules have different
    quantization formats", and the engines load each group as one GEMM in one format (vLLM raises "Mixed
    quant_algo within fused layer"; TensorRT-LLM and SGLang fuse them too)."""
    from ..qat.policy.fused_siblings import find_fused_siblings

    modules = dict(model.named_modules())
    formats = {lf.module: (lf.weight.name, _input_format(getattr(modules[lf.module], "input_quantizer", None)))
               for lf in layers}  # fmt: skip
    problems = []
    for group in find_fused_siblings(model):
        seen = {m: formats.get(m, ("bf16", "bf16")) for m in group}
        if len(set(seen.values())) > 1:
            named = ", ".join(f"{m.rsplit('.', 1)[-1]}={w}/{a}" for m, (w, a) in seen.items())
            problems.append(
                f"{group[0].rsplit('.', 1)[0]}: fused siblings in different formats ({named}, weight/input); "
                "modelopt's exporters and the serving engines handle them as one GEMM in one format. Give them one "
                "rule in the policy."
            )
    return problems


def _unified_hf_algo_problems(model: nn.Module, runtime: str) -> list[str]:
    """The ``quant_algo`` each layer of the unified HF checkpoint will declare (modelopt's ``get_quant_config``, what
    its exporter writes) that the engine's loader has no linear kernel for."""
    import inspect

    from modelopt.torch.export.quant_utils import get_quant_config

    # modelopt 0.37 takes the model's named modules, later releases the model
    takes_modules = next(iter(inspect.signature(get_quant_config).parameters)) == "named_modules"
    q = get_quant_config(model.named_modules() if takes_modules else model)["quantization"]
    mixed = q.get("quant_algo") == "MIXED_PRECISION"
    per_layer = {k: v.get("quant_algo") for k, v in (q.get("quantized_layers") or {}).items()} if mixed else {}
    algos = {a: [m for m, b in per_layer.items() if b == a] for a in set(per_layer.values())} if mixed else {
        q.get("quant_algo"): ["every quantized layer"]}  # fmt: skip
    engine, accepted = _ENGINE_NAMES[runtime], ENGINE_QUANT_ALGOS[runtime]
    problems = [
        f"{', '.join(mods[:3])}{f' (and {len(mods) - 3} more)' if len(mods) > 3 else ''}: quant_algo {a}, which "
        f"{engine}'s modelopt loader has no kernel for (it runs {', '.join(sorted(accepted))}). Change these "
        "layers' rule in the policy, or export for runtime='trtllm' or 'pytorch'."
        for a, mods in sorted(algos.items(), key=lambda kv: str(kv[0])) if a not in accepted
    ]  # fmt: skip
    if runtime == "sglang" and mixed and not {"NVFP4", "W4A16_NVFP4"} & set(per_layer.values()):
        # SGLang's ModelConfig._parse_modelopt_quant_config
        problems.append(
            "a MIXED_PRECISION checkpoint without NVFP4 layers: SGLang 0.5.23 loads those with its W4AFP8 method, "
            "not its modelopt one. Give every quantized layer one format, or export for runtime='vllm'."
        )
    return problems


def preflight(model: nn.Module, runtime: str = "trtllm", tensor_parallel: int = 1) -> list[LayerFormat]:
    """Refuse (``ExportRefused``) what modelopt cannot export or ``runtime`` would reject.

    Checks, per quantized linear: the format has an exporter (MXFP6 has none); the runtime has a
    kernel for it (TensorRT-LLM has none for dense MXFP4 / MXFP8); block sizes divide
    ``in_features`` (INT4 AWQ: 128; NVFP4: 16) including after tensor-parallel splitting; weight
    quantizers are calibrated; fused siblings (q/k/v, gate/up) share one format; for vLLM and
    SGLang, every layer's unified HF ``quant_algo`` is one the engine's loader has a kernel for.
    Returns the layer formats when everything passes.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"Unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}.")
    layers = quantized_layers(model)
    if not layers:
        raise ExportRefused(
            "The model has no enabled quantizers: nothing to export as a quantized checkpoint. Insert quantizers "
            "first (FP4QATCallback / QATController.prepare) or export the full-precision model with its own tools."
        )
    problems: list[str] = []
    modules = dict(model.named_modules())
    old_modelopt = not uses_list_config()
    for lf in layers:
        f = lf.weight
        if f.name.startswith("mxfp6") or f.name == "fp6":
            problems.append(
                f"{lf.module}: weights are {f.name}; modelopt has no MXFP6 exporter. Train to the target format "
                "(the schedule's last stage) before exporting."
            )
            continue
        iq = getattr(modules[lf.module], "input_quantizer", None)
        weight_only_int8 = f.element == ("int", 8) and (iq is None or not iq.is_enabled)
        if weight_only_int8 and old_modelopt:
            problems.append(
                f"{lf.module}: INT8 weight-only; modelopt < 0.40 labels it W8A8_SQ_PER_CHANNEL without input scales "
                "(a checkpoint TensorRT-LLM cannot load). Export with modelopt >= 0.40, or train int8_sq."
            )
            continue
        if f.name == "mxfp8" and old_modelopt:
            # measured with 0.37: the TensorRT-LLM export labels the layers fp8_pb_wo (FP8 with 128 x 128
            # float block scales, another format) and the unified HF export raises inside modelopt
            problems.append(
                f"{lf.module}: MXFP8; modelopt < 0.40 exports MXFP8 as fp8_pb_wo (FP8 per-block weight-only, a "
                "different scale layout) or fails. Export with modelopt >= 0.40 (the core environment)."
            )
            continue
        nvfp4_weights_only = f.name == "nvfp4" and _input_format(iq) not in ("nvfp4", "fp8")
        if nvfp4_weights_only and old_modelopt:
            problems.append(
                f"{lf.module}: NVFP4 weights with {_input_format(iq)} inputs; modelopt < 0.40 labels them NVFP4 "
                "without an input scale (a W4A4 checkpoint with its activation scale missing). Export with modelopt "
                ">= 0.40 (the core environment; it writes W4A16_NVFP4), or set the rule's input to 'nvfp4' or 'fp8'."
            )
            continue
        if runtime == "trtllm" and nvfp4_weights_only:
            # TensorRT-LLM has NVFP4 (W4A4) and W4A8_NVFP4_FP8 kernels, no W4A16 NVFP4; modelopt 0.47
            # labels such a layer W4A16_NVFP4, modelopt 0.37 labels it NVFP4 without an input scale.
            problems.append(
                f"{lf.module}: NVFP4 weights with {_input_format(iq)} inputs; TensorRT-LLM runs NVFP4 weights only "
                "with NVFP4 inputs (NVFP4) or FP8 per-tensor inputs (W4A8_NVFP4_FP8). Set the rule's input to "
                "'nvfp4' or 'fp8' (preset 'nvfp4_w4a8'), or export with runtime='pytorch'."
            )
        elif runtime == "trtllm" and f.trtllm_quant_algo is None:
            problems.append(
                f"{lf.module}: weights are {f.name}, which TensorRT-LLM has no kernel for (no QuantAlgo). Use a "
                "policy TensorRT-LLM deploys (e.g. 'trtllm_mixed': FP8 attention, NVFP4 MLP) or export with "
                "runtime='pytorch' (--runtime pytorch) for this plugin's own server."
            )
        if f.block_size:
            per_rank = lf.in_features // tensor_parallel
            if lf.in_features % f.block_size or (tensor_parallel > 1 and per_rank % f.block_size):
                problems.append(
                    f"{lf.module}: in_features={lf.in_features} (per tensor-parallel rank {per_rank}) is not divisible "
                    f"by the {f.name} block size {f.block_size}; exclude this layer in the policy or pick a format "
                    "whose block divides it."
                )
        if f.element == ("int", 4) and lf.out_features % 2:
            problems.append(f"{lf.module}: out_features={lf.out_features} must be even to pack INT4 pairs.")
        wq = modules[lf.module].weight_quantizer
        if f.needs_amax and getattr(wq, "_amax", None) is None:
            problems.append(f"{lf.module}: weight quantizer has no amax; calibrate before exporting.")
    problems += _w4a8_exporter_problems(model)
    problems += _mixed_fused_siblings(model, layers)
    if runtime in HF_ONLY_RUNTIMES and not problems:
        problems += _unified_hf_algo_problems(model, runtime)
    if problems:
        raise ExportRefused("Export refused, nothing was written:\n  - " + "\n  - ".join(problems))
    return layers
