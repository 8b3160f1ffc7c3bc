"""Mixture-of-experts layers: routers, experts and shared experts as policy groups, and the experts' tied scales.

On real transformers MoE models (Qwen3-MoE, Mixtral, Qwen2-MoE with a shared expert), built tiny.
"""

from __future__ import annotations

import copy

import pytest
import torch

from nemo_fp4qat import LayerPolicy, QATController
from nemo_fp4qat.qat.experts.moe import expert_projections, split_expert_name, tie_expert_amax
from nemo_fp4qat.qat.policy.rules import POLICY_PRESETS
from nemo_fp4qat.specs import ConfigError

from tiny_models import FULL, VOCAB, per_expert_linears, tiny_moe

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")

KINDS = ["qwen3", "mixtral", "qwen2"]
FUSED = {"gate_proj": ("gate_proj", "up_proj"), "up_proj": ("gate_proj", "up_proj"), "w1": ("w1", "w3"),
         "w3": ("w1", "w3")}  # fmt: skip
ROUTER = {"qwen3": "mlp.gate", "mixtral": "block_sparse_moe.gate", "qwen2": "mlp.gate"}
EXPERT = {"qwen3": "mlp.experts.1.down_proj", "mixtral": "block_sparse_moe.experts.1.w2",
          "qwen2": "mlp.experts.1.down_proj"}  # fmt: skip


def _batches(n: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(n)]


def _rows(policy, model) -> dict[str, tuple[str, str, str]]:
    return {r.module: (r.group, r.weight, r.input) for r in LayerPolicy.resolve_spec(policy).resolve(model).rows}


@per_expert_linears
@pytest.mark.parametrize("preset", [p for p in POLICY_PRESETS if p != "trtllm_mixed"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_preset_files_routers_experts_and_shared_experts_as_groups_of_their_own(preset, kind):
    rows = _rows(preset, tiny_moe(kind))
    layer = "model.layers.1."
    assert rows[layer + ROUTER[kind]] == ("router", "bf16", "bf16")
    group, weight, _ = rows[layer + EXPERT[kind]]
    assert group == "experts" and weight == ("mxfp4" if preset == "gpt_oss_mxfp4" else "nvfp4")
    if kind == "qwen2":  # the shared expert and its gate
        # Nemotron 3 Super's recipe: FP8 shared experts; gpt-oss's: only the routed experts quantized
        shared = {"nemotron3_super": "fp8", "gpt_oss_mxfp4": "bf16"}.get(preset, "nvfp4")
        assert rows[layer + "mlp.shared_expert.up_proj"][:2] == ("shared_experts", shared)
        assert rows[layer + "mlp.shared_expert_gate"] == ("router", "bf16", "bf16")
    quantized_groups = {g for g, w, _ in rows.values() if w != "bf16"}
    assert "embedding_output_norm" not in quantized_groups and "router" not in quantized_groups


@per_expert_linears
def test_a_yaml_policy_gives_experts_shared_experts_and_mlp_formats_of_their_own(tmp_path):
    path = tmp_path / "moe.yaml"
    path.write_text(
        "_target_: nemo_fp4qat.LayerPolicy\nname: moe_custom\ndefault: null\nrules:\n"
        "- {group: router, weight: null, patterns: ['*mlp.gate', '*shared_expert_gate']}\n"
        "- {group: shared_experts, weight: fp8, patterns: ['*shared_expert.*']}\n"
        "- {group: experts, weight: nvfp4, input: fp8, patterns: ['*.experts.*']}\n"
    )
    rows = _rows(str(path), tiny_moe("qwen2"))
    assert rows["model.layers.0.mlp.shared_expert.gate_proj"] == ("shared_experts", "fp8", "fp8")
    assert rows["model.layers.0.mlp.experts.3.gate_proj"] == ("experts", "nvfp4", "fp8")
    assert rows["model.layers.0.mlp.gate"] == ("router", "bf16", "bf16")
    assert rows["model.layers.0.self_attn.q_proj"][1] == "bf16"  # default: null


@per_expert_linears
def test_a_policy_that_quantizes_a_router_is_refused_naming_it():
    model = tiny_moe("mixtral")
    bad = LayerPolicy(rules=[FULL, {"patterns": ["*gate", "*.experts.*"], "weight": "nvfp4", "group": "moe"}])
    with pytest.raises(ConfigError, match=r"quantizes the MoE router 'model.layers.0.block_sparse_moe.gate'.*null"):
        bad.resolve(model)
    # a default that names every linear does not reach the routers: they stay 16-bit in a group of their own
    rows = _rows(LayerPolicy(rules=[FULL], default="nvfp4"), model)
    assert rows["model.layers.0.block_sparse_moe.gate"] == ("router", "bf16", "bf16")
    assert rows["model.layers.0.block_sparse_moe.experts.0.w1"][1] == "nvfp4"


@per_expert_linears
def test_experts_of_one_layer_in_different_formats_are_refused_naming_the_layer():
    split = LayerPolicy(
        rules=[FULL, {"patterns": ["*.experts.0.*"], "weight": "fp8", "group": "expert0"},
               {"patterns": ["*.experts.*"], "weight": "nvfp4", "group": "experts"}],
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"experts of 'model.layers.0.mlp.experts' would train in different formats"):
        split.resolve(tiny_moe("qwen3"))
    # one projection apart is refused too (gate and up deploy fused, all experts in one GEMM)
    down = LayerPolicy(rules=[FULL, {"patterns": ["*.experts.*.down_proj"], "weight": "fp8", "group": "down"},
                              {"patterns": ["*.experts.*"], "weight": "nvfp4", "group": "experts"}])  # fmt: skip
    with pytest.raises(ConfigError, match="fused MoE GEMM in one format"):
        down.resolve(tiny_moe("qwen3"))


def test_fused_expert_containers_are_refused_unless_a_rule_keeps_them_in_16_bits():
    """Llama-4 holds each layer's experts as one transposed 3-D weight per projection (``Llama4TextExperts``), a
    layout the policies do not format, so a run would train them in 16 bits under a table that says FP4. Refused by
    name, unless a rule keeps them."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
                           tie_word_embeddings=False)  # fmt: skip
    model = Llama4ForCausalLM(cfg)
    for preset in ("default", "aggressive_mlp"):
        refusal = r"model.layers.0.feed_forward.experts \(Llama4TextExperts: Llama 4 is not supported: its transposed "
        with pytest.raises(ConfigError, match=refusal + r"experts .*\): .*silently train in 16 bits"):
            LayerPolicy.resolve_spec(preset).resolve(model)
    kept = LayerPolicy(rules=[FULL, {"patterns": ["*.feed_forward.experts"], "weight": None, "group": "experts"},
                              {"patterns": ["*self_attn.*"], "weight": "nvfp4", "group": "attention"}])  # fmt: skip
    rows = _rows(kept, model)
    assert rows["model.layers.0.self_attn.q_proj"] == ("attention", "nvfp4", "nvfp4")
    assert not [m for m, (_g, w, i) in rows.items() if ".experts" in m and (w, i) != ("bf16", "bf16")]


def test_expert_names_split_for_hugging_face_and_megatron_core():
    assert split_expert_name("model.layers.3.mlp.experts.12.up_proj") == ("model.layers.3.mlp.experts", 12, "up_proj")
    assert split_expert_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1") == (
        "decoder.layers.0.mlp.experts", 1, "linear_fc1")  # fmt: skip
    assert split_expert_name("model.layers.0.mlp.shared_expert.up_proj") is None
    assert split_expert_name("model.layers.0.mlp.down_proj") is None


@per_expert_linears
@pytest.mark.parametrize("kind", ["qwen3", "mixtral"])
def test_calibration_gives_every_expert_one_input_amax_the_max_of_the_moe_input(kind):
    """The gate/up input of every expert is the MoE block's input (each token reaches top-k experts): tied, their amax
    is that input's absolute max over the calibration batches, measured here on an unquantized copy."""
    model = tiny_moe(kind, experts=8)
    reference = copy.deepcopy(model)
    seen: dict[str, float] = {}

    def record(name):
        def hook(module, args):
            seen[name] = max(seen.get(name, 0.0), float(args[0].detach().abs().max()))

        return hook

    for name, m in reference.named_modules():
        if name.endswith((".mlp", ".block_sparse_moe")):
            m.register_forward_pre_hook(record(name))
    batches = _batches()
    with torch.no_grad():
        for b in batches:
            reference(b)
    ctl = QATController(policy="default", calibration=8)
    ctl.prepare(model)
    ctl.calibrate(model, batches)
    modules = dict(model.named_modules())
    projections = expert_projections(n for n, m in modules.items() if isinstance(m, torch.nn.Linear))
    assert len(projections) == 2 * 3  # two layers, three projections each
    for (layer, proj), names in projections.items():
        assert len(names) == 8
        amaxes = [float(modules[n].input_quantizer.amax) for n in names]
        assert len(set(amaxes)) == 1, (layer, proj, amaxes)
        if proj in ("gate_proj", "up_proj", "w1", "w3"):
            assert amaxes[0] == pytest.approx(seen[layer.rsplit(".", 1)[0]], rel=1e-6)
        for n in names:  # each expert keeps its own weight amax (gate and up, fused in deployment, their max)
            expert = n.rsplit(".", 1)[0]
            fused = [f"{expert}.{p}" for p in FUSED.get(proj, (proj,))]
            expect = max(float(modules[f].weight.detach().abs().max()) for f in fused)
            assert float(modules[n].weight_quantizer.amax) == pytest.approx(expect, rel=1e-6)


@per_expert_linears
def test_an_expert_calibration_never_reached_gets_its_amax_and_one_with_no_expert_reached_is_refused():
    model = tiny_moe("qwen3")
    ctl = QATController(policy="default", calibration=8)
    ctl.prepare(model)
    ctl.calibrate(model, _batches())
    modules = dict(model.named_modules())
    layer = "model.layers.0.mlp.experts"
    tied = float(modules[f"{layer}.0.gate_proj"].input_quantizer.amax)
    starved = modules[f"{layer}.3.gate_proj"]
    del starved.input_quantizer._amax, starved.weight_quantizer._amax  # what an expert no token reached holds
    assert starved.input_quantizer.amax is None
    tie_expert_amax(model)
    assert float(starved.input_quantizer.amax) == tied
    assert float(starved.weight_quantizer.amax) == float(starved.weight.abs().max())
    for i in range(4):
        del modules[f"{layer}.{i}.down_proj"].input_quantizer._amax
    with pytest.raises(RuntimeError, match=r"No expert of 'model.layers.0.mlp.experts' got an input amax for 'down"):
        tie_expert_amax(model)


def test_a_switch_recalibrates_and_keeps_the_experts_tied():
    model = tiny_moe("mixtral")
    sched = {"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "target"}]}
    ctl = QATController(policy="default", schedule=sched, calibration=8)
    ctl.total_steps = 4
    ctl.prepare(model)
    ctl.calibrate(model, _batches())
    with torch.no_grad():  # the experts move apart while training
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.mul_(1.0 + 0.5 * torch.rand(()))
    ctl.step(model, 2)
    modules = dict(model.named_modules())
    for names in expert_projections(n for n, m in modules.items() if isinstance(m, torch.nn.Linear)).values():
        q = [modules[n].input_quantizer for n in names]
        assert q[0].num_bits == (2, 1) and len({float(x.amax) for x in q}) == 1


def test_a_finding_about_an_expert_stands_for_a_module_it_holds():
    from nemo_fp4qat.qat.experts.moe import module_standing_for

    hf = ["model.layers.0.mlp.experts.3.gate_proj", "model.layers.0.mlp.experts.3.down_proj", "model.layers.0.mlp.gate"]
    assert module_standing_for("model.layers.0.mlp.gate", hf) == "model.layers.0.mlp.gate"
    assert module_standing_for("model.layers.0.mlp.experts.3", hf) == "model.layers.0.mlp.experts.3.down_proj"
    assert module_standing_for("model.layers.0.mlp.experts.5", hf) == "model.layers.0.mlp.experts.3.down_proj"
    assert module_standing_for("model.layers.1.mlp.experts.3", hf) is None
    # megatron-core: the expert by its global index, its linears under local_experts (maybe another rank's)
    mc = ["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1", "decoder.layers.0.self_attention.linear_qkv"]
    assert module_standing_for("decoder.layers.0.mlp.experts.7", mc) == mc[0]
    assert module_standing_for("decoder.layers.0.mlp.router", mc) is None
    assert module_standing_for("decoder.layers.0.self_attention.3", mc) is None  # not an expert
