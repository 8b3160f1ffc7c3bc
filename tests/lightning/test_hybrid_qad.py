"""Hybrid Mamba / linear-attention models through the chain under NVIDIA's Nemotron 3 Nano preset: Lightning QAD (KL
to the model before quantization) and a unified HF export validated code for code against the trained model."""

from __future__ import annotations

import json

import pytest
from tiny_hybrids import build

from nemo_fp4qat.export import ExportConfig, export_checkpoint
from nemo_fp4qat.export.hub_names import model_name_resolver
from nemo_fp4qat.qat.experts.fused import is_fused_projection

from tiny_models import qad_fit

pytestmark = pytest.mark.twice("the Lightning front end over modelopt 0.37's quantizers and transformers 4.57's models")

# attention beside the mixers
FAMILIES = [
    "Bamba",
    "FalconH1",
    "Zamba",
    "Zamba2",
    "Qwen3Next",
    "Qwen3_5",
    "Qwen3_5Moe",
    "OlmoHybrid",
    "Jamba",
    "GraniteMoeHybrid",
]


@pytest.mark.core_only  # the unified HF export of these families needs modelopt 0.47 (the core environment)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_hybrid_trains_with_qad_and_exports_validated_under_the_nano_preset(family, tmp_path):
    model = build(family)
    model.config.architectures = [type(model).__name__]  # a model built from a config names none; the export reads it
    qat, lit = qad_fit(model, "nemotron3_nano", steps=2, n=16)
    assert len(lit.losses) == 2 and qat.distiller is not None and qat.distiller.last
    out = export_checkpoint(model, tmp_path / "export", ExportConfig(kind="hf", runtime="vllm"))
    report = json.loads((out / "validation.json").read_text())
    assert report["ok"], report
    assert report["numeric"]["fp4_codes_compared"] > 0 and report["numeric"]["fp4_codes_different"] == 0
    assert "layers_without_counterpart" not in report["numeric"]  # every exported layer compared with what trained
    declared = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    # the format the checkpoint declares for each exported layer, as the validator read it, by the trained module's
    # name (transformers saves in the hub's layout: Qwen3.5's model.language_model.)
    in_memory = model_name_resolver(model)
    formats = {in_memory(m): a for m, a in report["layers"].items()}

    def algo(module: str) -> str | None:
        return formats[module]

    # the mixers feeding attention (16-bit) are not declared quantized; the others are NVFP4
    rows = qat.controller.table.rows
    feeding = [r.module for r in rows if r.group == "mixer_feeding_attention" and r.quantizable]
    others = [r.module for r in rows if r.group in ("ssm_mixer", "linear_attention")]
    experts = [r.module for r in rows if r.group in ("experts", "mlp", "shared_experts") and r.quantizable]
    assert feeding and all(algo(n) is None for n in feeding)
    # fused experts export as per-expert linears; Zamba's shared transformer, tied across its layers, exports once
    linears = [n for n in others + experts if not is_fused_projection(n) and n in formats]
    assert experts and linears and all(algo(n) == "NVFP4" for n in linears)
    exported_experts = [m for m in report["layers"] if ".experts." in m]
    assert all(report["layers"][m] == "NVFP4" for m in exported_experts)
    assert bool(exported_experts) == any(is_fused_projection(n) or ".experts." in n for n in experts)
    assert declared["kv_cache_quant_algo"] == "FP8"


def test_qad_of_a_model_left_in_eval_mode_says_so():
    """Lightning keeps a submodule's eval mode through fit: the student then runs no training forward, and QAD says
    why instead of failing without a cause."""
    model = build("Bamba").eval()
    with pytest.raises(RuntimeError, match=r"stays in eval mode.*model\.train\(\) before trainer\.fit"):
        qad_fit(model, "nemotron3_nano", n=4, calibration=4)
    # the failed fit left nothing process-wide behind: weight fake quant is computed afresh again
    from nemo_fp4qat.numerics.weight_reuse import weight_reuse_active

    assert not weight_reuse_active()


@pytest.mark.core_only  # NemotronH and its fused experts: transformers 5 and modelopt 0.47 (the core environment)
def test_nemotron_h_under_the_nano_preset_exports_nvidias_published_recipe(tmp_path):
    """NVIDIA's Nemotron 3 Nano NVFP4 recipe on a tiny NemotronH (Mamba, MoE, attention, MoE), read back from the
    export in the hub's layout (``backbone.``): attention, the Mamba layer feeding it (conv1d included), the routers
    and lm_head 16-bit; the routed and shared experts NVFP4; an FP8 KV cache."""
    model = build("NemotronH")
    model.config.architectures = [type(model).__name__]
    qat, _ = qad_fit(model, "nemotron3_nano")
    out = export_checkpoint(model, tmp_path / "export", ExportConfig(kind="hf", runtime="vllm"))
    report = json.loads((out / "validation.json").read_text())
    assert report["ok"], report
    assert report["numeric"]["fp4_codes_compared"] > 0 and "layers_without_counterpart" not in report["numeric"]
    declared = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert declared["kv_cache_quant_algo"] == "FP8" and not any("\x00" in g for g in declared["exclude_modules"])
    layers = report["layers"]  # exported module -> its format, as the validator read the checkpoint's declarations
    sixteen_bit = [m for m, a in layers.items() if a is None]
    for kept in ("backbone.layers.0.mixer.in_proj", "backbone.layers.0.mixer.out_proj",  # feeds attention layer 2
                 "backbone.layers.2.mixer.q_proj", "backbone.layers.2.mixer.o_proj", "lm_head"):  # fmt: skip
        assert kept in sixteen_bit, kept
    experts = [m for m in layers if ".mixer.experts." in m or ".mixer.shared_experts." in m]
    assert len(experts) == 2 * (4 * 2 + 2) and all(layers[m] == "NVFP4" for m in experts)
    assert not [m for m in layers if m.endswith(("conv1d", "mixer.gate")) and layers[m] is not None]
    rows = {r.module: r for r in qat.controller.table.rows}
    assert rows["model.layers.0.mixer.conv1d"].weight == "bf16" and rows["model.layers.1.mixer.gate"].group == "router"


@pytest.mark.core_only  # NemotronH and its fused experts: transformers 5 and modelopt 0.47 (the core environment)
def test_a_hybrid_moe_resumes_bit_for_bit_and_the_monitor_measures_its_mixers_and_experts():
    """modelopt's aggressive Mamba-MoE recipe on NemotronH (its Mamba projections and experts NVFP4): the quantizers
    rebuilt from a checkpoint compute what the saved model did, and the monitor measures each mixer projection and
    each expert."""
    import copy

    import torch

    from nemo_fp4qat import QATController
    from nemo_fp4qat.monitor.analysis import analyze_model

    def forward(m, b):
        return m(b)

    batches = [torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    model = build("NemotronH")
    ctl = QATController(policy="mamba_moe_aggressive", schedule="direct", forward_fn=forward)
    ctl.prepare(model)
    ctl.calibrate(model, batches)
    records = analyze_model(model)
    assert {"model.layers.0.mixer.in_proj", "model.layers.0.mixer.out_proj"} <= set(records)
    assert all(f"model.layers.{layer}.mixer.experts.{i}.up_proj" in records for layer in (1, 3) for i in range(4))
    state, weights = ctl.state_dict(), model.state_dict()
    resumed = build("NemotronH")
    ctl2 = QATController(policy="mamba_moe_aggressive", schedule="direct", forward_fn=forward)
    ctl2.prepare(resumed)
    ctl2.sync_to_checkpoint(resumed, copy.deepcopy(state), weights)
    resumed.load_state_dict(weights, strict=True)
    with torch.no_grad():
        assert torch.equal(resumed(batches[0]).logits, model(batches[0]).logits)


@pytest.mark.core_only  # RecurrentGemma's export: modelopt 0.47 (the core environment)
def test_a_recurrent_hybrid_keeping_its_state_from_training_exports_validated(tmp_path):
    """RecurrentGemma (RG-LRU recurrent blocks beside local attention) keeps its recurrent state from the last training
    forward, computed with gradients: the export copies the model all the same and validates it code for code."""
    import torch
    import transformers

    if not hasattr(transformers, "RecurrentGemmaConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no RecurrentGemma")
    torch.manual_seed(0)
    config = transformers.RecurrentGemmaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                               intermediate_size=64, block_types=["recurrent", "attention"],
                                               lru_width=64, attention_window_size=16, conv1d_width=4)  # fmt: skip
    model = transformers.RecurrentGemmaForCausalLM(config)
    model.config.architectures = [type(model).__name__]
    qad_fit(model, "default")
    out = export_checkpoint(model, tmp_path / "export", ExportConfig(kind="hf", runtime="vllm"))
    report = json.loads((out / "validation.json").read_text())
    assert report["ok"] and report["numeric"]["fp4_codes_compared"] > 0, report
    assert "layers_without_counterpart" not in report["numeric"]
