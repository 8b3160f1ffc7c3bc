"""Reading an exported checkpoint (unified HF or TensorRT-LLM/qnemo) into tensors with unified HF names.

Shared by the validator and by :mod:`nemo_fp4qat.export.deployed_model` (which serves the
checkpoint), so both read ranks, names and fused q/k/v the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .unpack import TRTLLM_TO_HF_NAMES
from .validation_report import ValidationReport

__all__ = ["export_kind", "group_by_module", "head_counts", "load_export", "merge_ranks"]


def export_kind(path: Path) -> str:
    if (path / "hf_quant_config.json").is_file():
        return "hf"
    if (path / "config.json").is_file() and (path / "rank0.safetensors").is_file():
        return "trtllm"
    raise FileNotFoundError(
        f"{path} is neither a unified HF checkpoint (hf_quant_config.json) nor a TensorRT-LLM checkpoint "
        "(config.json + rank0.safetensors)."
    )


def load_export(path: str | Path) -> tuple[str, dict[str, Any], list[dict[str, torch.Tensor]]]:
    """(kind, quantization config, tensors per rank); TRT-LLM names are mapped to unified HF names."""
    from safetensors.torch import load_file

    path = Path(path)
    kind = export_kind(path)
    if kind == "hf":
        qcfg = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        if (path / "config.json").is_file():  # the model's shape (head counts) for the numeric check
            qcfg["_config"] = json.loads((path / "config.json").read_text())
        return kind, qcfg, [tensors]
    config = json.loads((path / "config.json").read_text())
    qcfg = dict(config.get("quantization") or {})
    if (path / "quant_cfg.json").is_file():
        qcfg.update(json.loads((path / "quant_cfg.json").read_text()))
    qcfg["_config"] = config
    tp = int(config.get("mapping", {}).get("tp_size", 1)) * int(config.get("mapping", {}).get("pp_size", 1))
    ranks = []
    for r in range(tp):
        f = path / f"rank{r}.safetensors"
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: config.json declares {tp} ranks.")
        raw = load_file(str(f))
        ranks.append({_hf_name(k): v for k, v in raw.items()})
    return kind, qcfg, ranks


def _hf_name(key: str) -> str:
    mod, _, attr = key.rpartition(".")
    return f"{mod}.{TRTLLM_TO_HF_NAMES.get(attr, attr)}"


def group_by_module(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        mod, _, attr = k.rpartition(".")
        out.setdefault(mod, {})[attr] = v
    return out


def head_counts(config: dict[str, Any]) -> tuple[int, int, int]:
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    return heads, kv, int(config.get("head_size") or config["hidden_size"] // heads)


def merge_ranks(
    ranks: list[dict[str, torch.Tensor]], config: dict[str, Any], rep: ValidationReport
) -> dict[str, torch.Tensor]:
    """One tensor dict from TensorRT-LLM tensor-parallel ranks (row/column splits undone, fused q/k/v
    re-joined per rank); shared scales that disagree between ranks are reported to ``rep``."""
    if len(ranks) == 1:
        return ranks[0]
    heads, kv, hd = head_counts(config)
    tp = len(ranks)
    merged: dict[str, torch.Tensor] = {}
    for key in ranks[0]:
        parts = [r[key] for r in ranks]
        mod, _, attr = key.rpartition(".")
        if parts[0].dim() == 0 or parts[0].numel() == 1 or attr in ("input_scale", "weight_scale_2"):
            if any(not torch.equal(p.float(), parts[0].float()) for p in parts[1:]):
                rep.error(key, "tensor-parallel ranks disagree on this shared scale.")
            merged[key] = parts[0]
        elif mod.endswith(("attention.dense", "mlp.proj")) and attr != "bias":
            merged[key] = torch.cat(parts, dim=-1)  # row parallel: split along in_features
        elif mod.endswith("attention.qkv"):
            rows = [heads * hd // tp, kv * hd // tp, kv * hd // tp]
            scale_rows = parts[0].shape[0] // sum(rows) if parts[0].shape[0] % sum(rows) == 0 else 1
            qkv = [p.split([r * scale_rows for r in rows], dim=0) for p in parts]
            merged[key] = torch.cat([torch.cat([q[j] for q in qkv], 0) for j in range(3)], 0)
        elif (
            (parts[0].dim() >= 1 and mod.endswith(("mlp.fc", "mlp.gate")))
            or "vocab_embedding" in mod
            or "lm_head" in mod
        ):
            merged[key] = torch.cat(parts, dim=0)
        else:
            merged[key] = parts[0]  # replicated (norms)
    return merged
