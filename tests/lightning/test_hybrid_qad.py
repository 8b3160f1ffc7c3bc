"""Hybrid Mamba / linear-attention models through the chain under NVIDIA's Nemotron 3 Nano preset: Lightning QAD (KL
to the model before quantization) and a unified HF export validated code for code against the trained model."""

from __future__ import annotations

import fnmatch
import json

import lightning.pytorch as pl
import pytest
from tiny_hybrids import build

from nemo_fp4qat import FP4QATCallback
from nemo_fp4qat.export import ExportConfig, export_checkpoint

from tiny_models import LitLM, loader

# Jamba is left out: modelopt 0.47's exporter looks for Mixtral's expert names (w1 / w2 / w3) in its MoE
# blocks and fails on JambaMLP's gate / up / down
FAMILIES = ["Bamba", "FalconH1", "Zamba2", "Qwen3Next"]  # hybrids: attention beside the mixers


@pytest.mark.core_only  # the unified HF export of these families needs modelopt 0.47 (the core environment)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_hybrid_trains_with_qad_and_exports_validated_under_the_nano_preset(family, tmp_path):
    model = build(family)
    model.config.architectures = [type(model).__name__]  # a model built from a config names none; the export reads it
    qat = FP4QATCallback(policy="nemotron3_nano", schedule="direct", calibration=8, distillation="qad",
                         module_getter=lambda lit: lit.net)  # fmt: skip
    lit = LitLM(model)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[qat])  # fmt: skip
    trainer.fit(lit, loader(n=16, batch_size=4, seq_len=16))
    assert len(lit.losses) == 2 and qat.distiller is not None and qat.distiller.last
    out = export_checkpoint(model, tmp_path / "export", ExportConfig(kind="hf", runtime="vllm"))
    report = json.loads((out / "validation.json").read_text())
    assert report["ok"], report
    assert report["numeric"]["fp4_codes_compared"] > 0 and report["numeric"]["fp4_codes_different"] == 0
    declared = json.loads((out / "hf_quant_config.json").read_text())["quantization"]

    def algo(module: str) -> str | None:
        """The format the checkpoint declares for ``module``: its per-layer entry, or the one format of the
        checkpoint unless an exclude glob names it."""
        if "quantized_layers" in declared:
            return declared["quantized_layers"].get(module, {}).get("quant_algo")
        excluded = any(fnmatch.fnmatchcase(module, g) for g in declared.get("exclude_modules", []))
        return None if excluded else declared["quant_algo"]

    # the mixers feeding attention (16-bit) are not declared quantized; the others are NVFP4
    rows = qat.controller.table.rows
    feeding = [r.module for r in rows if r.group == "mixer_feeding_attention" and r.quantizable]
    others = [r.module for r in rows if r.group in ("ssm_mixer", "linear_attention")]
    experts = [r.module for r in rows if r.group in ("experts", "mlp", "shared_experts") and r.quantizable]
    assert feeding and all(algo(n) is None for n in feeding)
    assert experts and all(algo(n) == "NVFP4" for n in others + experts)
    assert declared["kv_cache_quant_algo"] == "FP8"


def test_qad_of_a_model_left_in_eval_mode_says_so():
    """Lightning keeps a submodule's eval mode through fit: the student then runs no training forward, and QAD says
    why instead of failing without a cause."""
    model = build("Bamba").eval()
    qat = FP4QATCallback(policy="nemotron3_nano", schedule="direct", calibration=4, distillation="qad",
                         module_getter=lambda lit: lit.net)  # fmt: skip
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[qat])  # fmt: skip
    with pytest.raises(RuntimeError, match=r"stays in eval mode.*model\.train\(\) before trainer\.fit"):
        trainer.fit(LitLM(model), loader(n=4, batch_size=4, seq_len=16))
    # the failed fit left nothing process-wide behind: weight fake quant is computed afresh again
    from nemo_fp4qat.numerics.weight_reuse import weight_reuse_active

    assert not weight_reuse_active()
