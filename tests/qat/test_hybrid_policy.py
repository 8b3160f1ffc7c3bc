"""Hybrid Mamba / linear-attention models under the layer policies: every preset files a sequence mixer's
projections in a group of its own (never the fall-through ``other``), keeps ``conv1d`` in 16 bits, and the Nemotron 3
Nano preset keeps the mixer feeding each attention layer in 16 bits, found from the model's own layers.

The models are tiny random ones built from transformers' own config classes, each family by name
(``tests/helpers/tiny_hybrids.py``): a family a later transformers adds is covered by adding its entry."""

from __future__ import annotations

import fnmatch

import pytest
import torch
from tiny_hybrids import HYBRIDS, build

from nemo_fp4qat import LayerPolicy, QATController
from nemo_fp4qat.qat.experts.fused import unsupported_fused_experts
from nemo_fp4qat.qat.policy.rules import LINEAR_ATTENTION, POLICY_PRESETS, SSM_MIXER
from nemo_fp4qat.specs import ConfigError

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")


def _mixers(model: torch.nn.Module) -> list[str]:
    patterns = (*SSM_MIXER, *LINEAR_ATTENTION)
    return [n for n, _ in model.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


# core only: policy resolution matches module names, without modelopt
@pytest.mark.core_only
@pytest.mark.parametrize("preset", [p for p in POLICY_PRESETS if p != "trtllm_mixed"])
@pytest.mark.parametrize("family", list(HYBRIDS))
def test_every_preset_files_a_hybrids_mixers_on_purpose_and_keeps_conv1d_16_bit(family, preset):
    model = build(family)
    policy = LayerPolicy.preset(preset)
    if unsupported_fused_experts(model):  # transformers 4's GraniteMoeHybrid: experts in one 3-D weight of its own
        with pytest.raises(ConfigError, match="holds its experts fused"):
            policy.resolve(model)
        return
    experts = any(".experts" in n for n, _ in model.named_modules())
    no_layer = ("aggressive_mlp", "mamba_moe_conservative") if family in ("Mamba", "Mamba2") else ()
    if preset in no_layer or (preset == "gpt_oss_mxfp4" and not experts):  # its experts alone are quantized
        with pytest.raises(ValueError, match="leaves no layer of .* quantized"):  # mixers 16-bit, and no MLP
            policy.resolve(model)
        return
    rows = {r.module: r for r in policy.resolve(model).rows}
    mixers = _mixers(model)
    assert mixers, f"{family}: no mixer projection found"
    groups = {"ssm_mixer", "linear_attention", "mixer_feeding_attention"}
    assert {rows[n].group for n in mixers} <= groups, {n: rows[n].group for n in mixers}
    convs = [n for n, _ in model.named_modules() if n.endswith("conv1d")]  # OLMo-Hybrid's q/k/v_conv1d: containers
    assert convs and all(n not in rows or rows[n].weight == rows[n].input == "bf16" for n in convs)


# core only: policy resolution matches module names, without modelopt
@pytest.mark.core_only
@pytest.mark.parametrize(("family", "feeding"), [("Jamba", {0: 1, 2: 3}), ("Bamba", {0: 1, 2: 3}),
                                                ("Qwen3Next", {0: 1, 2: 3}), ("FalconH1", {0: 1, 1: 2, 2: 3}),
                                                ("NemotronH", {0: 2})])  # fmt: skip
def test_the_nano_preset_keeps_the_mixer_feeding_each_attention_layer_in_16_bits(family, feeding):
    """Nemotron 3 Nano's recipe: the mixer nearest before each attention layer, and attention, in 16 bits (the
    table says which attention layer it feeds); the other mixers, experts and MLPs in NVFP4."""
    model = build(family)
    table = LayerPolicy.preset("nemotron3_nano").resolve(model)
    rows = {r.module: r for r in table.rows}
    for name in _mixers(model):
        layer = int(name.split(".layers.")[1].split(".")[0])
        r = rows[name]
        if layer in feeding:
            assert (r.group, r.weight, r.input) == ("mixer_feeding_attention", "bf16", "bf16"), (name, r)
            assert r.rule.endswith(f"feeds attention layer {feeding[layer]}"), r.rule
        else:
            assert r.weight == r.input == "nvfp4" and r.group in ("ssm_mixer", "linear_attention"), (name, r)
    attention = [r for r in table.rows if r.group == "attention"]
    assert attention and all(not r.quantized for r in attention)
    assert all(r.weight == "nvfp4" for r in table.rows if r.group in ("experts", "mlp", "shared_experts"))
    assert LayerPolicy.preset("nemotron3_nano").kv_cache == "fp8"


# core only: policy resolution matches module names, without modelopt
@pytest.mark.core_only
def test_a_rule_that_quantizes_conv1d_is_refused_by_name():
    model = build("Bamba")
    policy = LayerPolicy(rules=[{"patterns": ["*mamba*"], "weight": "nvfp4", "group": "mamba"}], default="nvfp4")
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mamba\.conv1d: .*conv1d stays in 16 bits.*'\*conv1d'"):
        policy.resolve(model)
    rules = [{"patterns": ["*conv1d"], "weight": None, "group": "conv1d"},
             {"patterns": ["*mamba*"], "weight": "nvfp4", "group": "mamba"}]  # fmt: skip
    keep = LayerPolicy(rules=rules, default="nvfp4")
    assert {r.group for r in keep.resolve(model).rows if r.module.endswith("in_proj")} == {"mamba"}


@pytest.mark.parametrize("family", ["Jamba", "Qwen3Next"])
def test_a_hybrid_calibrates_with_its_mixers_in_their_trained_formats(family):
    """prepare + calibrate under the Nano preset: the feeding mixers carry no enabled quantizer, the others NVFP4
    weights and inputs with a calibrated amax, and the quantized model still computes finite logits. modelopt 0.37
    cannot convert Jamba's attention: refused by name there."""
    import modelopt

    model = build(family)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    ctl = QATController(policy="nemotron3_nano", calibration={"num_samples": 2}, forward_fn=lambda m, b: m(b))
    if family == "Jamba" and modelopt.__version__.startswith("0.37"):  # the nemo environment's modelopt
        with pytest.raises(ConfigError, match="modelopt 0.37.0 cannot quantize JambaForCausalLM.*>=0.47"):
            ctl.prepare(model)
        return
    table = ctl.prepare(model)
    ctl.calibrate(model, [tokens])
    modules = dict(model.named_modules())
    for r in table.rows:
        if r.module not in _mixers(model):
            continue
        q = modules[r.module].weight_quantizer
        if r.group == "mixer_feeding_attention":
            assert not q.is_enabled, r.module
        else:
            assert q.is_enabled and q.amax is not None and modules[r.module].input_quantizer.amax is not None
    assert torch.isfinite(model(tokens).logits).all()
