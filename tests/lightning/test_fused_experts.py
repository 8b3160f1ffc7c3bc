"""transformers 5's fused experts (one 3-D weight per projection for all of a layer's experts) through the chain, for
every MoE family transformers ships in that layout: QAD under Lightning, every expert calibrated (one never
routed to included), a precision switch, a resume bit for bit, the monitor's per-expert token counts, and the
unified HF export in the hub's layout validated code for code against the trained experts."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import transformers
from tiny_moe import FUSED_MOE, OTHER_LAYOUT_MOE, build

from nemo_fp4qat import QATController
from nemo_fp4qat.architectures import FAMILIES
from nemo_fp4qat.export import ExportConfig, export_checkpoint
from nemo_fp4qat.monitor.experts import ExpertLoad
from nemo_fp4qat.qat.experts.fused import fused_expert_containers
from nemo_fp4qat.specs import ConfigError

from tiny_models import qad_fit

pytestmark = [
    # modelopt 0.47's fused-expert wrappers (the core environment); transformers 4 holds experts as linears
    pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="fused experts: transformers 5"),
]


def _batches(n: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (2, 16), generator=g) for _ in range(n)]


def _forward(model, batch):
    return model(batch)


@pytest.mark.parametrize("family", sorted(FUSED_MOE))
def test_a_fused_expert_moe_trains_with_qad_and_exports_validated(family, tmp_path):
    model = build(family)
    assert fused_expert_containers(model), f"{family}: no fused experts found"
    qat, _ = qad_fit(model, "default")
    assert qat.distiller is not None and qat.distiller.last
    rows = {r.module: r for r in qat.controller.table.rows}
    fused = [n for c in fused_expert_containers(model).values() for n in c.projection_names()]
    assert all(rows[n].group == "experts" and rows[n].weight == "nvfp4" for n in fused)
    out = export_checkpoint(model, tmp_path / "export", ExportConfig(kind="hf", runtime="vllm"))
    report = json.loads((out / "validation.json").read_text())
    assert report["ok"], report
    numeric = report["numeric"]
    # every quantized layer of the export (each expert's gate / up / down among them) compared with what trained
    assert "layers_without_counterpart" not in numeric and numeric["fp4_codes_different"] == 0
    experts = [m for m, a in report["layers"].items() if ".experts." in m and a is not None]
    container = next(iter(fused_expert_containers(model).values()))
    assert len(experts) == len(fused_expert_containers(model)) * container.num_experts * (3 if container.gated else 2)


# one family per way an export's names reach the model: Mixtral's w1 / w3 / w2 and router renamed, Ernie 4.5's
# and MiMo-V2's tensors renamed on their own, Gemma 4's router beside the layer's experts, Laguna's shared expert,
# Mistral 4 not in transformers' auto classes
@pytest.mark.parametrize("family", ["Mixtral", "Ernie4_5_Moe", "MiMoV2Flash", "Gemma4", "Laguna", "Mistral4"])
def test_the_served_model_rebuilt_from_a_fused_expert_export_computes_what_trained(family, tmp_path):
    """This plugin's server rebuilds the export's model class, each exported expert linear loaded into its slice of
    the fused projection and each projection's input quantized with its exported scale: the trained logits, bit
    for bit (the export for the "pytorch" runtime keeps float32, as trained)."""
    from nemo_fp4qat.eval.evaluation import quantized_weight_memory
    from nemo_fp4qat.export.deployed_model import load_deployed_model

    model = build(family)
    qad_fit(model, "default")
    out = export_checkpoint(model, tmp_path / "export", ExportConfig(kind="hf", runtime="pytorch"))
    served = load_deployed_model(out)
    assert {a for m, a in served.algos.items() if ".experts." in m} == {"NVFP4"}
    batch = _batches(1, seed=7)[0]
    with torch.no_grad():
        assert torch.equal(served.model(batch).logits, model.eval()(batch).logits)
    # and it weighs what trained: each expert counted in its exported format
    deployed = quantized_weight_memory(served.model, served.weight_formats)
    assert deployed["bytes"] == pytest.approx(quantized_weight_memory(model)["bytes"])


def test_every_expert_is_calibrated_even_one_no_token_reaches():
    """An expert the router never picks gets its weight amax from its own weights, and a projection's experts share
    one input amax (the engines' fused MoE kernels take one input scale)."""
    model = build("Qwen3Moe")
    router = model.model.layers[0].mlp.gate

    def never_expert_3(module, args, output):
        logits, scores, indices = output
        return logits, scores, torch.where(indices == 3, (indices + 1) % 3, indices)

    handle = router.register_forward_hook(never_expert_3)
    ctl = QATController(policy="default", schedule="direct", forward_fn=_forward)
    ctl.prepare(model)
    ctl.calibrate(model, _batches())
    handle.remove()
    experts = model.model.layers[0].mlp.experts
    for proj in ("gate_up_proj", "down_proj"):
        quantizers = getattr(experts, f"{proj}_weight_quantizers")
        assert len(quantizers) == 4
        for i, q in enumerate(quantizers):
            assert q.amax is not None and torch.equal(q.amax.float(), getattr(experts, proj)[i].abs().amax().float())
        assert getattr(experts, f"{proj}_input_quantizer").amax is not None


def test_a_precision_switch_moves_every_expert_and_a_resume_restores_them_bit_for_bit():
    schedule = {"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "nvfp4"}], "ramp_steps": 1}
    model = build("Qwen3Moe")
    ctl = QATController(policy="aggressive_mlp", schedule=schedule, forward_fn=_forward)
    ctl.prepare(model)
    ctl.calibrate(model, _batches())
    experts = model.model.layers[0].mlp.experts
    assert experts.down_proj_weight_quantizers[3].num_bits == (4, 3)  # FP8
    events = [e for s in range(3) for e in ctl.step(model, s)]
    assert events == [{"step": 2, "group": "experts", "from": "fp8", "to": "nvfp4", "modules": 4}]
    assert all(q.num_bits == (2, 1) for q in experts.down_proj_weight_quantizers)  # every expert's: NVFP4
    assert experts.gate_up_proj_input_quantizer.num_bits == (2, 1)
    ramped = {q for q in ctl.ramps if ".experts." in q}
    assert len(ramped) == 2 * (4 + 4 + 2)  # each expert's weight quantizers and the shared input ones, 2 layers
    state, weights = ctl.state_dict(), model.state_dict()

    resumed = build("Qwen3Moe")
    ctl2 = QATController(policy="aggressive_mlp", schedule=schedule, forward_fn=_forward)
    ctl2.prepare(resumed)
    ctl2.sync_to_checkpoint(resumed, copy.deepcopy(state), weights)
    resumed.load_state_dict(weights, strict=True)
    assert ctl2.current == ctl.current and set(ctl2._hooks) == set(ctl.ramps)
    batch = _batches(seed=3)[0]
    with torch.no_grad():
        assert torch.equal(resumed(batch).logits, model(batch).logits)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_experts_behind_a_wrapper_calibrate_and_train_quantized_whatever_kernel_the_config_names(implementation):
    """transformers' grouped and batched experts kernels bypass modelopt's quantizers; a model quantized inside a
    wrapper (a LightningModule, as the callback quantizes by default) still runs its experts through them."""
    model = build("Mixtral")
    model.config._experts_implementation = implementation
    wrapper = torch.nn.Module()
    wrapper.net = model
    ctl = QATController(policy="default", forward_fn=lambda m, b: m.net(b), calibration=2)
    ctl.prepare(wrapper)
    ctl.calibrate(wrapper, _batches(2))
    experts = model.model.layers[0].mlp.experts
    assert model.config._experts_implementation == "eager"
    for q in (experts.gate_up_proj_input_quantizer, experts.down_proj_input_quantizer):
        assert q.is_enabled and q.amax is not None and q.amax.isfinite().all()
    # the experts compute in NVFP4: disabling their quantizers changes the model's output
    batch = _batches(1, seed=5)[0]
    with torch.no_grad():
        quantized = model(batch).logits
        for m in experts.modules():
            if m is not experts and type(m).__name__ == "TensorQuantizer":
                m.disable()
        assert not torch.allclose(model(batch).logits, quantized)


def test_weight_memory_counts_each_fused_expert_in_its_own_format():
    """bits/weight (the demo's and evaluation's column) stores each expert's slice of a fused weight in its format:
    NVFP4 (4.5 bits with its scales) where its quantizer is on, 16 bits where it is off."""
    from nemo_fp4qat.eval.evaluation import quantized_weight_memory

    model = build("Mixtral")
    QATController(policy="default").prepare(model)
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj_weight_quantizers[1].disable()
    mem = quantized_weight_memory(model)
    enabled = sum(
        m.gate_up_proj[i].numel() * m.gate_up_proj_weight_quantizers[i].is_enabled
        + m.down_proj[i].numel() * m.down_proj_weight_quantizers[i].is_enabled
        for m in (layer.mlp.experts for layer in model.model.layers)
        for i in range(m.num_experts)
    )
    assert (
        enabled
        == sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) - experts.gate_up_proj[1].numel()
    )
    for layer in model.model.layers:
        for q in layer.mlp.experts.modules():
            if type(q).__name__ == "TensorQuantizer":
                q.disable()
    unquantized_experts = quantized_weight_memory(model)
    assert unquantized_experts["bytes"] - mem["bytes"] == pytest.approx(enabled * (2 - 4.5 / 8))
    assert mem["bytes_bf16"] == unquantized_experts["bytes_bf16"]


@pytest.mark.parametrize("family", sorted(FUSED_MOE))
def test_the_monitor_counts_every_routed_token_per_expert_once_per_moe_layer(family):
    """One count per MoE layer however the family builds its router (a linear, a small MLP, a norm and projection,
    one with a skip class), each counting every token top-k times, after the policy wrapped the router's linears."""
    model = build(family)
    QATController(policy="default").prepare(model)
    load = ExpertLoad()
    load.attach(model)
    batch = _batches(1)[0]
    with torch.no_grad():
        model(batch)
    counts = load.snapshot()
    experts = fused_expert_containers(model)
    assert {f"{router.rpartition('.')[0]}.experts" for router in counts} == set(experts)
    cfg = model.config.get_text_config()
    names = ("num_experts_per_tok", "top_k_experts", "moe_topk", "moe_k")
    top_k = next(getattr(cfg, a) for a in names if hasattr(cfg, a))
    for router, per_expert in counts.items():
        assert len(per_expert) == experts[f"{router.rpartition('.')[0]}.experts"].num_experts
        if family == "Zaya":  # a token routed to the skip class reaches no expert
            assert 0 < sum(per_expert) <= batch.numel() * top_k
        else:
            assert sum(per_expert) == batch.numel() * top_k, router


@pytest.mark.parametrize("family", sorted(OTHER_LAYOUT_MOE))
def test_a_family_the_table_refuses_is_refused_by_name_with_its_reason(family):
    """DBRX, Aria, LongCat-Flash, DeepSeek-V4 and JetMoe build and run here but modelopt cannot quantize (or export)
    what they hold: ``prepare`` names the module, the family and the table's reason, before anything trains."""
    entry = next(f for f in FAMILIES if family in f.classes)
    model = build(family, OTHER_LAYOUT_MOE)
    assert model(torch.randint(0, 96, (1, 8))).logits.isfinite().all()
    with pytest.raises(ConfigError, match=re.escape(f"{entry.name} is not supported: {entry.refused}")) as refusal:
        QATController(policy="default").prepare(model)
    assert "silently train in 16 bits" in str(refusal.value) and any(
        c in str(refusal.value) for c in entry.expert_classes
    )


@pytest.mark.parametrize(
    "lever", [dict(calibration={"gptq": {}}), dict(calibration={"block_scale_search": True}),
              dict(learned_scales={"mode": "post"})],
)  # fmt: skip
def test_a_weight_scale_lever_with_fused_experts_is_refused_by_name(lever):
    with pytest.raises(ConfigError, match=r"with fused experts \(model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        QATController(policy="default", **lever).prepare(build("Qwen3Moe"))


def test_the_monitor_measures_every_expert_and_a_finding_about_one_names_its_group():
    from nemo_fp4qat.monitor.analysis import analyze_model

    model = build("Qwen3Moe")
    ctl = QATController(policy="default", schedule="direct", forward_fn=_forward)
    ctl.prepare(model)
    ctl.calibrate(model, _batches())
    records = analyze_model(model)
    for layer in (0, 1):
        for i in range(4):
            for proj in ("gate_up_proj", "down_proj"):
                rec = records[f"model.layers.{layer}.mlp.experts.{i}.{proj}"]
                assert rec["weight_rel_err"] > 0 and rec["input_amax"] is not None
    assert ctl.group_of("model.layers.0.mlp.experts.3") == "experts"  # a dead expert's finding
    assert ctl.group_of("model.layers.0.mlp.experts.3.down_proj") == "experts"  # a per-expert error finding
