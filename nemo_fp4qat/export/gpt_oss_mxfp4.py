"""gpt-oss's own MXFP4 checkpoint layout: the one OpenAI's published weights ship in, which transformers, vLLM, SGLang
and TensorRT-LLM load as gpt-oss.

Each expert projection of a ``GptOssExperts`` container is stored as ``<container>.<proj>_blocks`` (uint8
``[E, out, in / 32, 16]``: two E2M1 codes per byte, the first in the low nibble, blocked along the contraction) and
``<container>.<proj>_scales`` (uint8 E8M0 exponents, ``[E, out, in / 32]``); every other tensor (attention, its
sinks, the router, the experts' biases, embeddings, norms, ``lm_head``) unquantized; ``config.json`` carries
``quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}``.

modelopt's unified HF exporter writes its own layout for these experts, which the engines do not load as gpt-oss
(modelopt's gpt-oss example converts a QAT model with a script of its own). The codes and scales here are modelopt's
(``MXFP4QTensor``, the arithmetic of its MXFP4 fake quant); the layout is gpt-oss's. Validation decodes every expert
tensor with transformers' own MXFP4 decoder (what its gpt-oss loader runs) and compares it with the trained
fake-quantized weight, code for code.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn as nn

from ..numerics.formats import format_name_of, get_format
from ..qat.experts.fused import is_transposed_experts
from .runtime_support import ExportRefused, LayerFormat
from .validation_report import ValidationReport

__all__ = [
    "GPT_OSS_NOT_CONVERTED",
    "gpt_oss_expert_containers",
    "gpt_oss_preflight",
    "is_gpt_oss_mxfp4_checkpoint",
    "validate_gpt_oss_mxfp4",
    "write_gpt_oss_mxfp4",
]

_PROJECTIONS = ("gate_up_proj", "down_proj")
# what gpt-oss's published checkpoints keep unquantized (their config's modules_to_not_convert)
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def gpt_oss_expert_containers(model: nn.Module) -> dict[str, nn.Module]:
    """Every gpt-oss expert container of ``model`` whose weights are quantized, by module name."""
    out = {}
    for name, module in model.named_modules():
        if not is_transposed_experts(module):
            continue
        quantizers = [getattr(module, f"{p}_weight_quantizer", None) for p in _PROJECTIONS]
        if any(q is not None and q.is_enabled for q in quantizers):
            out[name] = module
    return out


def gpt_oss_preflight(model: nn.Module, kind: str) -> list[LayerFormat]:
    """Refuse, before anything is written, what gpt-oss's MXFP4 layout cannot hold; returns each expert
    projection's format (weight-only MXFP4).

    Raises:
        ExportRefused: a TensorRT-LLM checkpoint of quantized gpt-oss experts; an expert projection in a format other
            than weight-only MXFP4; another quantized layer beside them (the layout quantizes the experts only).
    """
    containers = gpt_oss_expert_containers(model)
    first = next(iter(containers))
    if kind != "hf":
        raise ExportRefused(f"{first}: gpt-oss's quantized experts export as a Hugging Face checkpoint in gpt-oss's "
                            "own MXFP4 layout (kind='hf'), which TensorRT-LLM, vLLM and SGLang load.")  # fmt: skip
    for name, module in containers.items():
        for proj in _PROJECTIONS:
            weight = format_name_of(getattr(module, f"{proj}_weight_quantizer"))
            act = getattr(module, f"{proj}_input_quantizer", None)
            if weight != "mxfp4" or (act is not None and act.is_enabled):
                act_name = format_name_of(act) if act is not None else None
                raise ExportRefused(
                    f"{name}.{proj} trained as weight {weight}, input {act_name}: gpt-oss's checkpoint "
                    " layout holds its experts as weight-only MXFP4 (OpenAI's format, which the engines "
                    "serve). Train them with policy 'gpt_oss_mxfp4' (or a rule giving '*.experts.*' weight mxfp4, "
                    "input null)."
                )
    others = [n for n, m in model.named_modules()
              if not n.startswith(tuple(containers)) and getattr(m, "weight_quantizer", None) is not None
              and m.weight_quantizer.is_enabled]  # fmt: skip
    if others:
        raise ExportRefused(
            f"{others[0]}{' ...' if len(others) > 1 else ''} is quantized beside the gpt-oss experts: gpt-oss's MXFP4 "
            "layout quantizes the experts only (attention, router, embeddings and lm_head stay 16-bit). Keep the "
            "other layers in 16 bits (policy 'gpt_oss_mxfp4')."
        )
    mxfp4 = get_format("mxfp4")
    return [LayerFormat(f"{name}.{proj}", mxfp4, int(getattr(m, proj).shape[-2]), int(getattr(m, proj).shape[-1]))
            for name, m in containers.items() for proj in _PROJECTIONS]  # fmt: skip


def _pack(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's ``(blocks, scales)`` of a ``[E, in, out]`` expert weight: each expert's ``[out, in]`` in MXFP4."""
    from modelopt.torch.quantization.qtensor import MXFP4QTensor

    blocks, scales = [], []
    for expert in weight.detach().float():
        packed, scale = MXFP4QTensor.quantize(expert.transpose(0, 1).contiguous(), block_size=block)
        blocks.append(packed._quantized_data)
        scales.append(scale)
    out_dim, half = blocks[0].shape
    b = torch.stack(blocks).view(len(blocks), out_dim, half * 2 // block, block // 2)
    return b.contiguous(), torch.stack(scales).view(len(blocks), out_dim, -1).contiguous()


def write_gpt_oss_mxfp4(model: nn.Module, out: Path, dtype: torch.dtype) -> None:
    """Write ``model`` (a Hugging Face gpt-oss whose experts trained in MXFP4) to ``out`` in gpt-oss's layout, its
    unquantized tensors in ``dtype``."""
    from safetensors.torch import save_file

    containers = gpt_oss_expert_containers(model)
    tensors: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if "_quantizer" in key:
            continue
        owner, _, leaf = key.rpartition(".")
        if owner in containers and leaf in _PROJECTIONS:
            block = int(getattr(containers[owner], f"{leaf}_weight_quantizer").block_sizes[-1])
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = _pack(value, block)
        else:
            tensors[key] = (value.detach().to(dtype) if value.is_floating_point() else value.detach()).contiguous()
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    config.architectures = config.architectures or [type(model).__name__]
    config.dtype = dtype
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": list(GPT_OSS_NOT_CONVERTED)}
    config.save_pretrained(str(out))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(out))


def is_gpt_oss_mxfp4_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` holds a checkpoint in gpt-oss's MXFP4 layout (its config's ``quant_method``)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    q = json.loads(cfg.read_text()).get("quantization_config") or {}
    return q.get("quant_method") == "mxfp4"


def _trained_expert_weight(module: nn.Module, proj: str) -> torch.Tensor:
    """The ``[E, in, out]`` weight the model trained with: each expert's through the projection's weight quantizer
    (modelopt quantizes it transposed, blocked along the contraction)."""
    q = getattr(module, f"{proj}_weight_quantizer")
    weight = getattr(module, proj).detach()
    with torch.no_grad():
        return q(weight.transpose(-1, -2)).transpose(-1, -2)


def validate_gpt_oss_mxfp4(path: str | Path, model: nn.Module | None = None, runtime: str = "vllm") -> ValidationReport:
    """Check a gpt-oss MXFP4 checkpoint: the layout (dtypes, shapes, the blocks tiling each weight) and, with the
    trained ``model``, every expert weight as transformers decodes it against the trained fake-quantized weight (0
    E2M1 codes different) and every other tensor against the model's rounded to the checkpoint's dtype."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = Path(path)
    rep = ValidationReport(str(path), "hf", "MXFP4", None, runtime)
    config = json.loads((path / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    experts = sorted({k[: -len("_blocks")] for k in tensors if k.endswith("_blocks")})
    if not experts:
        rep.error("model.safetensors", "declares quant_method 'mxfp4' but holds no *_blocks expert tensors.")
    decoded: dict[str, torch.Tensor] = {}
    for name in experts:
        blocks, scales = tensors[f"{name}_blocks"], tensors.get(f"{name}_scales")
        if scales is None:
            rep.error(f"{name}_scales", "missing: each *_blocks tensor needs its E8M0 scales.")
            continue
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            rep.error(name, f"blocks {blocks.dtype} / scales {scales.dtype}: both must be uint8.")
            continue
        if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape:
            rep.error(name, f"blocks {list(blocks.shape)} / scales {list(scales.shape)}: gpt-oss's layout is "
                      "[E, out, in / 32, 16] blocks with [E, out, in / 32] scales.")  # fmt: skip
            continue
        rep.layers[name] = "MXFP4"
        decoded[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    if model is None:
        return rep
    state = {k: v for k, v in model.state_dict().items() if "_quantizer" not in k}
    modules = dict(model.named_modules())
    codes = different = 0
    for name, got in decoded.items():
        owner, _, proj = name.rpartition(".")
        module = modules.get(owner)
        if module is None or not hasattr(module, f"{proj}_weight_quantizer"):
            rep.error(name, "no quantized expert projection of the model has this name.")
            continue
        want = _trained_expert_weight(module, proj).float()
        if got.shape != want.shape:
            rep.error(name, f"decodes to {list(got.shape)}; the model's weight is {list(want.shape)}.")
            continue
        codes += want.numel()
        off = int((got != want).sum())
        different += off
        if off:
            rep.error(name, f"{off} of {want.numel()} decoded values differ from the trained weight (max "
                      f"{float((got - want).abs().max()):.3g}): the checkpoint is not what trained.")  # fmt: skip
    packed = {f"{n}_blocks" for n in decoded} | {f"{n}_scales" for n in decoded}
    for key, value in tensors.items():
        if key in packed:
            continue
        if key not in state:
            rep.error(key, "the model has no tensor of this name.")
            continue
        want = state[key].detach().to(value.dtype) if value.is_floating_point() else state[key].detach()
        if value.shape != want.shape or not torch.equal(value, want):
            rep.error(key, f"differs from the model's (rounded to {value.dtype}).")
    missing = [k for k in state if k not in tensors and f"{k}_blocks" not in tensors
               and not (k == "lm_head.weight" and config.get("tie_word_embeddings"))]  # fmt: skip
    for key in missing:
        rep.error(key, "the model's tensor is missing from the checkpoint.")
    rep.numeric.update(
        layers_compared=len(decoded), fp4_codes_compared=codes, fp4_codes_different=different,
        unquantized_compared=len(tensors) - len(packed), max_rel_error=0.0 if not different else None,
    )  # fmt: skip
    return rep
