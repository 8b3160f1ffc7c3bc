"""Convert an NVFP4 unified HF export to compressed-tensors ``nvfp4-pack-quantized``.

This is the independent consumer of our exports: transformers + compressed-tensors (neither
modelopt nor this plugin) load the result on a CPU and run it, so a test can compare its logits
with the trained fake-quant model. The renaming is hand-written because no library converts
between the two NVFP4 checkpoint dialects; the tensors are the same bytes:
``weight`` -> ``weight_packed``, ``weight_scale`` stays, ``weight_global_scale`` =
1/``weight_scale_2``, ``input_global_scale`` = 1/``input_scale``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from .atomic import atomic_directory

__all__ = ["to_compressed_tensors"]


def _quantization_config(targets: list[str], ignore: list[str], activations: bool) -> dict[str, Any]:
    args = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
            "dynamic": False, "observer": "minmax"}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": targets,
                "weights": args,
                "input_activations": {**args, "dynamic": "local"} if activations else None,
                "format": "nvfp4-pack-quantized",
            }
        },
        "ignore": ignore,
    }


def to_compressed_tensors(
    export_dir: str | Path, out_dir: str | Path, overwrite: bool = False, activations: bool = True
) -> Path:
    """Write ``out_dir``: the NVFP4 export ``export_dir`` in compressed-tensors' NVFP4 layout.

    ``activations=False`` declares a weight-only scheme: compressed-tensors' dynamic NVFP4
    activation quantization does not reproduce modelopt's input quantizer (measured: 0.15 relative
    logits error on a tiny Llama where weight-only agrees to bf16 rounding), so the weight path can
    be checked on its own.
    """
    from safetensors.torch import load_file, save_file

    src = Path(export_dir)
    qcfg = json.loads((src / "hf_quant_config.json").read_text())["quantization"]
    if qcfg.get("quant_algo") != "NVFP4":
        raise ValueError(
            f"to_compressed_tensors converts NVFP4 exports; {src} is {qcfg.get('quant_algo')!r}. Export with an "
            "all-NVFP4 policy (e.g. default 'nvfp4' for every linear) to use this consumer."
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        mod, _, attr = key.rpartition(".")
        if attr == "weight" and f"{mod}.weight_scale_2" in tensors:
            out[f"{mod}.weight_packed"] = t
        elif attr == "weight_scale_2":
            out[f"{mod}.weight_global_scale"] = (1.0 / t.float()).reshape(1)
        elif attr == "input_scale":
            out[f"{mod}.input_global_scale"] = (1.0 / t.float()).reshape(1)
        else:
            out[key] = t
    config = json.loads((src / "config.json").read_text())
    excluded = list(qcfg.get("exclude_modules") or [])
    config["quantization_config"] = _quantization_config(["Linear"], excluded, activations)
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in src.iterdir():  # tokenizer and generation files
            if f.is_file() and f.suffix in (".json", ".txt", ".model") and f.name not in (
                "config.json", "hf_quant_config.json", "model.safetensors.index.json"
            ):  # fmt: skip
                shutil.copy2(f, tmp / f.name)
    return Path(out_dir)
