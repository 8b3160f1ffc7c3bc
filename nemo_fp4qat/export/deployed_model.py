"""The model an exported checkpoint deploys, rebuilt on the CPU from its packed tensors.

One loader for everything that must see what was deployed rather than what was trained: the PyTorch
serving backend and ``nemo-fp4qat eval --model EXPORT_DIR`` (so the quality gate runs on the export).
Linear weights are the exported codes x scales (this plugin's own unpacker, :mod:`.unpack`), and inputs
of NVFP4 / FP8 / W4A8 layers are quantized with the exported ``input_scale`` (forward pre-hooks).

Layouts: a unified HF checkpoint (any architecture transformers builds from its ``config.json``), or a
TensorRT-LLM checkpoint (qnemo) of a Llama-family decoder, whose fused ``qkv`` / ``fc`` + ``gate`` /
``proj`` tensors are mapped back to Hugging Face Llama modules and whose tensor-parallel ranks are merged.
Written by hand because neither transformers nor modelopt loads packed NVFP4/FP8 checkpoints on a CPU.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..numerics.fake_quant import fake_quant_fp8, fake_quant_nvfp4
from ..transformers_compat import rope_fields
from .engine_fields import layer_entry
from .reader import head_counts, load_export, merge_ranks
from .unpack import dequantize_linear

__all__ = ["DeployedModel", "is_export_dir", "load_deployed_model"]

# TensorRT-LLM module names -> Hugging Face Llama module names (qkv is split into q/k/v)
_TRTLLM_TO_HF = [
    (r"transformer\.vocab_embedding", "model.embed_tokens"),
    (r"transformer\.ln_f", "model.norm"),
    (r"lm_head", "lm_head"),
    (r"transformer\.layers\.(\d+)\.input_layernorm", r"model.layers.\1.input_layernorm"),
    (r"transformer\.layers\.(\d+)\.post_layernorm", r"model.layers.\1.post_attention_layernorm"),
    (r"transformer\.layers\.(\d+)\.attention\.qkv", r"model.layers.\1.self_attn.qkv"),
    (r"transformer\.layers\.(\d+)\.attention\.dense", r"model.layers.\1.self_attn.o_proj"),
    (r"transformer\.layers\.(\d+)\.mlp\.fc", r"model.layers.\1.mlp.gate_proj"),  # the activated branch
    (r"transformer\.layers\.(\d+)\.mlp\.gate", r"model.layers.\1.mlp.up_proj"),
    (r"transformer\.layers\.(\d+)\.mlp\.proj", r"model.layers.\1.mlp.down_proj"),
]


# exported quant_algo -> this plugin's format of the weights (for memory accounting)
_ALGO_WEIGHT_FORMAT = {
    "NVFP4": "nvfp4", "W4A8_NVFP4_FP8": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "fp8", "MXFP8": "mxfp8",
    "MXFP4": "mxfp4", "W4A16_MXFP4": "mxfp4", "W8A16": "int8_wo", "W8A8_SQ_PER_CHANNEL": "int8_sq",
    "W4A16_AWQ": "int4_awq", "W4A8_AWQ": "int4_awq",
}  # fmt: skip


# exported quant_algo -> (format of the layer's inputs, amax / input_scale): NVFP4 inputs carry amax / (6 * 448), the
# global scale itself; FP8 per-tensor inputs amax / 448
_INPUT_FORMATS = {"NVFP4": ("nvfp4", 6 * 448), "FP8": ("fp8", 448), "W4A8_NVFP4_FP8": ("fp8", 448)}


@dataclass
class DeployedModel:
    model: nn.Module  # a transformers causal LM in eval mode
    tokenizer: Any
    kind: str  # "hf" | "trtllm"
    algos: dict[str, str]  # HF module (or fused expert projection) name -> quant_algo of its exported weights

    @property
    def weight_formats(self) -> dict[str, str]:
        """HF module name -> format name of its exported weights (``evaluate(weight_formats=...)``)."""
        return {m: _ALGO_WEIGHT_FORMAT[a] for m, a in self.algos.items() if a in _ALGO_WEIGHT_FORMAT}


def is_export_dir(path: str | Path) -> bool:
    """A unified HF (``hf_quant_config.json``) or TensorRT-LLM (``config.json`` + ``rank0.safetensors``) export."""
    p = Path(path)
    trtllm = (p / "config.json").is_file() and (p / "rank0.safetensors").is_file()
    return (p / "hf_quant_config.json").is_file() or trtllm


def _hf_config_from_trtllm(cfg: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    if cfg.get("architecture") not in ("LlamaForCausalLM", "MistralForCausalLM") and cfg.get("decoder") != "llama":
        raise ValueError(
            f"TensorRT-LLM checkpoint of {cfg.get('architecture')!r}: only Llama-family decoders are rebuilt on the "
            "CPU; evaluate or serve the unified HF export of the same model instead (--kind hf)."
        )
    return LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_size"), rms_norm_eps=cfg.get("norm_epsilon", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        **rope_fields(cfg.get("rotary_base", 10000.0)), hidden_act=cfg.get("hidden_act", "silu"),
        tie_word_embeddings=bool(cfg.get("share_embedding_table", False)),
        attention_bias=bool(cfg.get("bias", False)),
    )  # fmt: skip


def _trtllm_modules(path: Path, qcfg: dict[str, Any], ranks: list[dict[str, torch.Tensor]]):
    """{HF module: (tensors, quant_algo)} of a TensorRT-LLM checkpoint (ranks merged, qkv split)."""
    from .validation_report import ValidationReport

    config = qcfg["_config"]
    rep = ValidationReport(str(path), "trtllm", qcfg.get("quant_algo"), None, "pytorch")
    tensors = merge_ranks(ranks, config, rep)
    if rep.errors:
        raise ValueError(f"{path}: tensor-parallel ranks disagree: {rep.errors[0]}")
    mixed = qcfg.get("quantized_layers") or {}
    by_mod: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        mod, _, attr = k.rpartition(".")
        by_mod.setdefault(mod, {})[attr] = v
    out: dict[str, tuple[dict[str, torch.Tensor], str | None]] = {}
    for mod, t in by_mod.items():
        algo = mixed.get(mod, {}).get("quant_algo") if mixed else qcfg.get("quant_algo")
        algo = algo if "weight_scale" in t else None
        for pat, repl in _TRTLLM_TO_HF:
            if re.fullmatch(pat, mod):
                hf = re.sub(pat, repl, mod)
                break
        else:
            raise ValueError(f"{path}: no Hugging Face Llama module for TensorRT-LLM tensor group {mod!r}.")
        if hf.endswith(".qkv"):
            # dequantize the fused GEMM once, then hand each projection its rows (one shared input scale)
            w = dequantize_linear(t, algo) if algo else t["weight"].to(torch.float64)
            parent = hf[: -len(".qkv")]
            heads, kv, hd = head_counts(config)  # TensorRT-LLM's qkv rows are [Q; K; V]
            for leaf, rows in zip(("q_proj", "k_proj", "v_proj"), w.split([heads * hd, kv * hd, kv * hd], 0)):
                out[f"{parent}.{leaf}"] = ({**{k: v for k, v in t.items() if k != "weight"}, "weight": rows}, algo)
        else:
            out[hf] = (t, algo)
    return out


def load_deployed_model(export_dir: str | Path, dtype: torch.dtype = torch.float32) -> DeployedModel:
    """Rebuild the deployed model of ``export_dir`` (unified HF or TensorRT-LLM checkpoint; a plain,
    unquantized Hugging Face model directory loads as it is)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(export_dir)
    if _plain_hf_dir(path):  # an unquantized Hugging Face model: served as is (the baseline beside an export)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        return DeployedModel(model, AutoTokenizer.from_pretrained(path), "hf", {})
    kind, qcfg, ranks = load_export(path)
    if kind == "hf":
        raw = json.loads((path / "config.json").read_text())
        raw.pop("quantization_config", None)
        config = AutoConfig.for_model(**raw)
        mixed = qcfg.get("quantized_layers") or {}
        excluded = set(qcfg.get("exclude_modules") or [])
        modules: dict[str, tuple[dict[str, torch.Tensor], str | None]] = {}
        for k, v in ranks[0].items():
            mod, _, attr = k.rpartition(".")
            modules.setdefault(mod, ({}, None))[0][attr] = v
        for mod, (t, _) in list(modules.items()):
            algo = (layer_entry(mod, mixed) or {}).get("quant_algo") if mixed else qcfg.get("quant_algo")
            modules[mod] = (t, algo if ("weight_scale" in t and mod not in excluded and algo) else None)
        tok_dir = path
    else:
        config = _hf_config_from_trtllm(qcfg["_config"])
        modules = _trtllm_modules(path, qcfg, ranks)
        tok_dir = path / "tokenizer"
    model = _causal_lm(config, dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(tok_dir) if (tok_dir / "tokenizer_config.json").is_file() else None
    params = dict(model.named_parameters())
    algos: dict[str, str] = {}
    missing = set(params)
    fused_inputs: dict[str, tuple[str, torch.Tensor]] = {}
    if kind == "hf":  # a transformers 5 model loads its hub layout renamed, experts into its fused projections
        modules = _fused_experts_loaded(model, modules, dtype, algos, missing, fused_inputs)
    with torch.no_grad():
        for mod, (t, algo) in modules.items():
            if algo:
                w = t["weight"] if t["weight"].dtype == torch.float64 else dequantize_linear(t, algo)
                params[f"{mod}.weight"].copy_(w.to(dtype))
                missing.discard(f"{mod}.weight")
                algos[mod] = str(algo).upper()
                _input_hook(model.get_submodule(mod), algos[mod], t.get("input_scale"))
            for attr, v in t.items():
                name = f"{mod}.{attr}"
                if name in params and not (algo and attr == "weight"):
                    params[name].copy_(v.to(dtype))
                    missing.discard(name)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"{path}: the export has no tensors for {sorted(missing)[:4]} ({len(missing)} in all).")
    _fused_input_quantizers(model, fused_inputs)
    return DeployedModel(model, tokenizer, kind, algos)


def _fused_experts_loaded(
    model: nn.Module,
    modules: dict[str, tuple[dict[str, torch.Tensor], str | None]],
    dtype: torch.dtype,
    algos: dict[str, str],
    missing: set[str],
    fused_inputs: dict[str, tuple[str, torch.Tensor]],
) -> dict[str, tuple[dict[str, torch.Tensor], str | None]]:
    """Load each exported expert linear that belongs in a fused container (transformers 5) into its slice,
    collecting each fused projection's input scale; return the other modules under the names ``model`` holds
    them by (the hub's layout renamed as ``from_pretrained`` would)."""
    from ..qat.experts.fused import fused_expert_slot
    from .hub_names import model_name_resolver, model_tensor_resolver

    resolve, tensor = model_name_resolver(model), model_tensor_resolver(model)
    held = dict(model.named_modules())
    params = {n for n, _ in model.named_parameters()}
    rest: dict[str, tuple[dict[str, torch.Tensor], str | None]] = {}
    unfilled: dict[str, int] = {}
    with torch.no_grad():
        for mod, (t, algo) in modules.items():
            name = resolve(mod)
            slot = fused_expert_slot(held, name) if name not in held else None
            if slot is None:
                for attr, v in t.items():  # a renaming can reach the tensor's own name (a bias, a sink)
                    key = f"{name}.{attr}" if f"{name}.{attr}" in params else tensor(f"{mod}.{attr}")
                    target, _, leaf = key.rpartition(".") if key in params else (name, "", attr)
                    rest.setdefault(target, ({}, algo))[0][leaf] = v
                continue
            container, fused, view = slot
            w = t["weight"] if not algo or t["weight"].dtype == torch.float64 else dequantize_linear(t, algo)
            view.copy_(w.to(dtype))
            param = f"{container}.{fused}"
            unfilled.setdefault(param, getattr(held[container], fused).shape[0] * (2 if fused == "gate_up_proj" else 1))
            unfilled[param] -= 1
            if algo:  # by the fused projection's name (its policy row's)
                algos[param] = str(algo).upper()
                if t.get("input_scale") is not None:  # one input scale per projection, shared by its experts
                    fused_inputs[param] = (algos[param], t["input_scale"])
    missing.difference_update(p for p, left in unfilled.items() if left == 0)
    return rest


def _fused_input_quantizers(model: nn.Module, inputs: dict[str, tuple[str, torch.Tensor]]) -> None:
    """Quantize each fused projection's input as the runtime does, with its exported scale: through modelopt's
    fused-expert quantizers, the only place a fused container's per-expert inputs are reachable (its forward calls
    ``F.linear`` per expert), weights left as the export dequantized them."""
    if not inputs:
        return
    import modelopt.torch.quantization as mtq

    from ..qat.experts.fused import run_experts_eagerly
    from ..qat.modelopt_compat import build_quant_cfg

    unknown = {algo for algo, _ in inputs.values()} - set(_INPUT_FORMATS)
    if unknown:
        raise ValueError(f"fused experts exported with {sorted(unknown)} inputs: no runtime emulation for them here")
    run_experts_eagerly(model)
    assignment = {param: ("bf16", _INPUT_FORMATS[algo][0]) for param, (algo, _) in inputs.items()}
    mtq.quantize(model, build_quant_cfg(assignment, algorithm=None), forward_loop=None)
    for param, (algo, scale) in inputs.items():
        container, _, fused = param.rpartition(".")
        quantizer = getattr(model.get_submodule(container), f"{fused}_input_quantizer")
        quantizer.amax = scale.detach().float().reshape(()) * _INPUT_FORMATS[algo][1]


def _causal_lm(config: Any, dtype: torch.dtype) -> nn.Module:
    """The causal LM ``config`` names, built from it: through the auto class, or by the class its
    ``architectures`` names where the auto class does not list the config (transformers 5's Mistral 4)."""
    import transformers
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError:
        names = [a for a in getattr(config, "architectures", None) or [] if hasattr(transformers, a)]
        if not names:
            raise
        return getattr(transformers, names[0])._from_config(config, dtype=dtype)


def _plain_hf_dir(path: Path) -> bool:
    return (
        (path / "config.json").is_file()
        and (path / "tokenizer_config.json").is_file()
        and not (path / "hf_quant_config.json").is_file()
        and not (path / "rank0.safetensors").is_file()
    )


def _input_hook(module: nn.Module, algo: str, input_scale: torch.Tensor | None) -> None:
    """Quantize the layer's input as the runtime does, with the exported per-tensor scale."""
    if input_scale is None:
        return
    scale = input_scale.detach().float().reshape(())
    fmt = _INPUT_FORMATS.get(algo, (None, 0.0))[0]
    if fmt == "nvfp4":  # input_scale: the NVFP4 global scale itself
        module.register_forward_pre_hook(lambda m, a: (fake_quant_nvfp4(a[0], None, global_scale=scale), *a[1:]))
    elif fmt == "fp8":  # FP8 per-tensor inputs
        module.register_forward_pre_hook(lambda m, a: (fake_quant_fp8(a[0], scale=scale), *a[1:]))
