"""A float32 model's unified HF checkpoint in the 16-bit dtype the engines run.

TensorRT-LLM, vLLM and SGLang run 16-bit activations: vLLM downcasts a declared float32 to bfloat16 (and refuses
``--dtype float32`` for modelopt checkpoints). modelopt's HF exporter, asked for a 16-bit dtype, casts the weights
*before* it packs them, so block scales and FP4 codes are derived from rounded weights and move away from the ones
a float32 model trained with. Here the checkpoint is packed from the float32 weights and only its unquantized
tensors (embeddings, norms, lm_head, biases) are rounded afterwards, once, to the declared dtype; scales stay as
modelopt writes them. No library offers the rounding of an already packed checkpoint, hence this file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["is_scale_tensor", "round_unquantized_tensors"]


def is_scale_tensor(name: str) -> bool:
    """Scales (``weight_scale``, ``weight_scale_2``, ``input_scale``, ``pre_quant_scale``, ``k_scale`` ...): kept."""
    attr = name.rpartition(".")[2]
    return attr.endswith("scale") or attr.endswith("scale_2")


def round_unquantized_tensors(out: str | Path, dtype: torch.dtype) -> int:
    """Round the float32 unquantized tensors of the unified HF checkpoint in ``out`` to ``dtype`` and declare
    ``dtype`` in ``config.json`` (in place; a checkpoint whose config came from the source model may declare
    another); returns how many tensors were rounded."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = Path(out)
    rounded = 0
    for f in sorted(out.glob("*.safetensors")) if dtype != torch.float32 else []:
        with safe_open(str(f), framework="pt") as sf:
            metadata = sf.metadata()
            tensors = {k: sf.get_tensor(k) for k in sf.keys()}
        changed = [k for k, t in tensors.items() if t.dtype == torch.float32 and not is_scale_tensor(k)]
        if not changed:
            continue
        for k in changed:
            tensors[k] = tensors[k].to(dtype).contiguous()
        save_file(tensors, str(f), metadata=metadata)
        rounded += len(changed)
    cfg_path = out / "config.json"
    if cfg_path.is_file():
        config = json.loads(cfg_path.read_text())
        name = str(dtype).replace("torch.", "")
        for key in ("torch_dtype", "dtype"):
            if key in config or key == "torch_dtype":
                config[key] = name
        cfg_path.write_text(json.dumps(config, indent=2))
    return rounded
