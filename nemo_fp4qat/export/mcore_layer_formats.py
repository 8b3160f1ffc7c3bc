"""Per-layer formats in a megatron-core model's unified HF checkpoint, where modelopt's exporter writes one.

modelopt 0.37's ``export_mcore_gpt_to_hf`` (NeMo 2.7.3's environment) declares a single model-wide
``quant_algo`` in ``hf_quant_config.json``: the format of the first quantized module it finds. A layer-wise
policy's checkpoint holds several (attention FP8, MLP and experts NVFP4), so every layer in another format would
be read by the engines in the wrong one, and it excludes only ``lm_head``, so the 16-bit routers would be
read as quantized. modelopt 0.4x's exporter builds the per-layer table itself (``process_layer_quant_config``); for
the older one the same declaration is built here, from the trained model's quantizers under the checkpoint's
Hugging Face names, with modelopt's own ``get_quantization_format``, ``get_weight_block_size`` and
``process_layer_quant_config`` (one format: ``quant_algo`` and ``exclude_modules``; several: ``MIXED_PRECISION``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch.nn as nn

from .weight_check import mcore_module_of

__all__ = ["declare_mcore_layer_formats"]

# the 16-bit linears of a megatron-core GPT under their Hugging Face names (the quantizable ones: weight_check)
_SIXTEEN_BIT = [(r"lm_head", "output_layer"), (r"model\.layers\.(\d+)\.mlp\.gate", r"decoder.layers.\1.mlp.router")]


def _module_of(hf_name: str) -> str | None:
    for pattern, repl in _SIXTEEN_BIT:
        if m := re.fullmatch(pattern, hf_name):
            return m.expand(repl)
    return mcore_module_of(hf_name)


def _writes_one_format() -> bool:
    import modelopt
    from packaging.version import Version

    return Version(modelopt.__version__) < Version("0.40")


def _hf_linears(out: Path) -> list[str]:
    from safetensors import safe_open

    names = set()
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            names |= {k[: -len(".weight")] for k in sf.keys() if k.endswith(".weight")}
    return sorted(names)


def declare_mcore_layer_formats(model: nn.Module, out: Path) -> bool:
    """Rewrite ``out``'s model-wide quantization declaration as the per-layer one the model's quantizers give
    (``hf_quant_config.json`` and ``config.json["quantization_config"]``). Returns whether anything changed."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.export.quant_utils import (
        QUANTIZATION_NONE,
        get_quantization_format,
        get_weight_block_size,
        process_layer_quant_config,
    )

    path = out / "hf_quant_config.json"
    declared = json.loads(path.read_text())
    quant = declared.get("quantization", {})
    if not _writes_one_format() or "quantized_layers" in quant:
        return False
    modules = dict(model.named_modules())
    layers: dict[str, object] = {}
    for name in _hf_linears(out):
        target = _module_of(name)
        if target is None or target not in modules:
            continue
        module = modules[target]
        layers[f"{name}.quantization"] = get_quantization_format(module) or QUANTIZATION_NONE
        layers[f"{name}.awq_block_size"] = get_weight_block_size(module)
    formats = {v for k, v in layers.items() if k.endswith(".quantization") and v != QUANTIZATION_NONE}
    if not formats:
        return False
    table = process_layer_quant_config(layers)
    table["kv_cache_quant_algo"] = quant.get("kv_cache_quant_algo")
    declared["quantization"] = table
    path.write_text(json.dumps(declared, indent=4))
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = convert_hf_quant_config_format(declared)
    config_path.write_text(json.dumps(config, indent=2))
    return True
