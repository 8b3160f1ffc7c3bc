"""The unquantized tensors of an export (embeddings, norms, lm_head, biases) against the trained model's.

Each must equal the model's tensor rounded to the checkpoint's dtype, and be in the dtype its ``config.json``
declares (what an engine loads it as): an export whose embeddings or norms were written in another dtype
than asked, or from other weights, would evaluate differently from the trained model although every FP4 code
matched.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .layout import FLOAT_DTYPES, SCALE_NAMES
from .validation_report import ValidationReport

__all__ = ["compare_unquantized", "declared_dtype"]

# TensorRT-LLM names -> candidate model tensors (megatron-core local spec, Transformer Engine spec, Hugging Face)
_TRTLLM_SOURCES: list[tuple[str, list[str]]] = [
    (r"transformer\.vocab_embedding\.weight", ["embedding.word_embeddings.weight", "model.embed_tokens.weight"]),
    (r"transformer\.position_embedding\.weight", ["embedding.position_embeddings.weight"]),
    (
        r"transformer\.layers\.(\d+)\.input_layernorm\.(weight|bias)",
        [
            r"decoder.layers.\1.input_layernorm.\2",
            r"decoder.layers.\1.self_attention.linear_qkv.layer_norm_\2",
            r"model.layers.\1.input_layernorm.\2",
        ],
    ),
    (
        r"transformer\.layers\.(\d+)\.post_layernorm\.(weight|bias)",
        [
            r"decoder.layers.\1.pre_mlp_layernorm.\2",
            r"decoder.layers.\1.mlp.linear_fc1.layer_norm_\2",
            r"model.layers.\1.post_attention_layernorm.\2",
        ],
    ),
    (r"transformer\.ln_f\.(weight|bias)", [r"decoder.final_layernorm.\1", r"model.norm.\1"]),
    (
        r"lm_head\.weight",
        ["output_layer.weight", "lm_head.weight", "embedding.word_embeddings.weight", "model.embed_tokens.weight"],
    ),
    (r"transformer\.layers\.(\d+)\.attention\.dense\.bias", [r"decoder.layers.\1.self_attention.linear_proj.bias"]),
    (r"transformer\.layers\.(\d+)\.mlp\.proj\.bias", [r"decoder.layers.\1.mlp.linear_fc2.bias"]),
]
# Hugging Face names (a megatron-core model exported to a unified HF checkpoint) -> megatron-core tensors
_HF_SOURCES: list[tuple[str, list[str]]] = [
    (r"model\.embed_tokens\.weight", ["embedding.word_embeddings.weight"]),
    (
        r"model\.layers\.(\d+)\.input_layernorm\.(weight|bias)",
        [r"decoder.layers.\1.input_layernorm.\2", r"decoder.layers.\1.self_attention.linear_qkv.layer_norm_\2"],
    ),
    (
        r"model\.layers\.(\d+)\.post_attention_layernorm\.(weight|bias)",
        [r"decoder.layers.\1.pre_mlp_layernorm.\2", r"decoder.layers.\1.mlp.linear_fc1.layer_norm_\2"],
    ),
    (r"model\.norm\.(weight|bias)", [r"decoder.final_layernorm.\1"]),
    (r"lm_head\.weight", ["output_layer.weight", "embedding.word_embeddings.weight"]),
]


_NORM = re.compile(r"(norm|ln_f)")


def _source(name: str, kind: str, state: dict[str, torch.Tensor]) -> torch.Tensor | None:
    if kind == "hf" and name in state:
        return state[name]
    for pattern, candidates in _HF_SOURCES if kind == "hf" else _TRTLLM_SOURCES:
        if re.fullmatch(pattern, name):
            for c in candidates:
                found = state.get(re.sub(pattern, c, name))
                if found is not None:
                    return found
    return None


def declared_dtype(config: dict[str, Any], kind: str) -> str | None:
    """The dtype a checkpoint's ``config.json`` declares: TensorRT-LLM's ``dtype``; a unified HF checkpoint's
    ``torch_dtype`` (transformers < 5) or ``dtype``."""
    return config.get("dtype") if kind == "trtllm" else config.get("torch_dtype") or config.get("dtype")


def compare_unquantized(
    rep: ValidationReport,
    tensors: dict[str, torch.Tensor],
    quantized: set[str],
    model: nn.Module,
    kind: str,
    config: dict[str, Any],
    model_name: Callable[[str], str] | None = None,
) -> None:
    """Check every unquantized float tensor of the export that maps to a model tensor (see the module docstring).

    Args:
        rep: the report the problems and counts go to (``numeric["unquantized_compared"]`` / ``_different``).
        tensors: the export's tensors (TensorRT-LLM ranks merged).
        quantized: the modules whose ``weight`` is quantized (their weights are the FP4/FP8 check's).
        model: the trained model.
        kind: ``"hf"`` or ``"trtllm"``.
        config: the checkpoint's ``config.json`` (the dtype it declares), or empty.
        model_name: an exported module name -> the model's (:func:`~.hub_names.model_name_resolver`).
    """
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    # the exporter folds the smoothing scales it re-derives (AWQ, SmoothQuant siblings) into the norms before them
    refolded = bool(rep.numeric.get("resmoothed_layers"))
    declared = declared_dtype(config, kind)
    num = rep.numeric
    for name, t in sorted(tensors.items()):
        mod, _, attr = name.rpartition(".")
        if t.dtype not in FLOAT_DTYPES or attr in SCALE_NAMES or (attr == "weight" and mod in quantized):
            continue
        if attr not in ("weight", "bias") or (refolded and _NORM.search(mod)):
            continue
        if declared is not None and str(t.dtype).replace("torch.", "") != declared:
            rep.error(name, f"stored as {t.dtype} but config.json declares dtype {declared!r}.")
        ref = _source(name, kind, state)
        if ref is None and model_name is not None:
            ref = state.get(f"{model_name(mod)}.{attr}")
        if ref is None or ref.dim() != t.dim() or ref.shape[1:] != t.shape[1:] or ref.shape[0] > t.shape[0]:
            continue
        num["unquantized_compared"] = num.get("unquantized_compared", 0) + 1
        want = ref.detach().to(device="cpu", dtype=t.dtype)
        rows = want.shape[0] if want.dim() else None
        same = torch.equal(t[:rows] if rows is not None else t, want)
        padded_zero = rows is None or rows == t.shape[0] or not bool(t[rows:].float().abs().gt(0).any())
        if not (same and padded_zero):
            num["unquantized_different"] = num.get("unquantized_different", 0) + 1
            diff = float((t[:rows].float() - want.float()).abs().max()) if want.numel() else 0.0
            rep.error(name, f"differs from the trained model's tensor in {t.dtype} (max abs diff {diff:.3g}): the "
                      "export must carry the trained weights, rounded once to the checkpoint's dtype.")  # fmt: skip
