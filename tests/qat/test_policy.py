"""Layer policies: resolution tables, presets, YAML, and errors that name the problem."""

from __future__ import annotations

import pytest

from nemo_fp4qat import LayerPolicy, PolicyRule
from nemo_fp4qat.numerics.formats import get_format

from paths import CONF
from tiny_models import MegatronStyleGPT, tiny_llama


def _fmt(table, module):
    row = next(r for r in table.rows if r.module == module)
    return row.weight, row.input, row.group


def test_default_policy_on_megatron_names():
    table = LayerPolicy.preset("default").resolve(MegatronStyleGPT())
    assert _fmt(table, "decoder.layers.0.self_attention.linear_qkv") == ("fp8", "fp8", "attention")
    assert _fmt(table, "decoder.layers.1.mlp.linear_fc2") == ("nvfp4", "nvfp4", "mlp")
    assert _fmt(table, "output_layer") == ("bf16", "bf16", "embedding_output_norm")
    assert _fmt(table, "embedding.word_embeddings")[0] == "bf16"
    text = table.format_table()
    assert "decoder.layers.0.mlp.linear_fc1" in text and "nvfp4" in text
    assign = table.assignment()
    assert set(assign) == {n for n, r in zip([r.module for r in table.rows], table.rows) if r.quantizable}
    assert "embedding.word_embeddings" not in assign  # not a linear layer


def test_default_policy_on_hf_llama_names():
    table = LayerPolicy.preset("default").resolve(tiny_llama())
    assert _fmt(table, "model.layers.0.self_attn.k_proj")[:2] == ("fp8", "fp8")
    assert _fmt(table, "model.layers.1.mlp.gate_proj")[:2] == ("nvfp4", "nvfp4")
    assert _fmt(table, "lm_head")[0] == "bf16"
    assert table.groups()["mlp"] == [
        f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")
    ]


def test_presets_differ_where_documented():
    m = tiny_llama()
    mlp_only = LayerPolicy.preset("aggressive_mlp").resolve(m)
    assert _fmt(mlp_only, "model.layers.0.self_attn.q_proj")[0] == "bf16"
    deploy = LayerPolicy.preset("trtllm_mixed").resolve(m)
    assert _fmt(deploy, "model.layers.0.self_attn.q_proj")[0] == "fp8"
    server = LayerPolicy.preset("conservative_attention")
    assert _fmt(server.resolve(m), "model.layers.0.self_attn.q_proj")[0] == "mxfp8" and server.runtime == "vllm"
    every = LayerPolicy.preset("fp_embeddings").resolve(m)
    assert _fmt(every, "model.layers.0.self_attn.q_proj")[0] == "nvfp4"
    assert LayerPolicy.preset("default").target_format.name == "nvfp4"


def test_first_matching_rule_wins_and_input_defaults_to_weight():
    p = LayerPolicy(
        rules=[
            {"patterns": ["*layers.0.mlp.*"], "weight": "fp8", "group": "first_mlp"},
            {"patterns": ["*mlp.*"], "weight": "nvfp4", "input": None, "group": "mlp"},
            {"patterns": ["*lm_head"], "weight": None, "group": "head"},
        ],
        default=None,
    )
    t = p.resolve(tiny_llama())
    assert _fmt(t, "model.layers.0.mlp.up_proj") == ("fp8", "fp8", "first_mlp")
    assert _fmt(t, "model.layers.1.mlp.up_proj") == ("nvfp4", "bf16", "mlp")
    assert _fmt(t, "model.layers.1.self_attn.q_proj")[0] == "bf16"  # default: full precision


def test_rule_matching_nothing_is_an_error_naming_the_rule():
    p = LayerPolicy(
        rules=[{"patterns": ["*mlp.*"], "group": "mlp"}, {"patterns": ["*no_such_layer*"], "group": "ghost"}]
    )
    with pytest.raises(ValueError, match=r"rule 1 \(group 'ghost'.*no_such_layer.*matches no module"):
        p.resolve(tiny_llama())
    # ... unless the rule says it is optional
    LayerPolicy(rules=[{"patterns": ["*no_such_layer*"], "group": "ghost", "optional": True}]).resolve(tiny_llama())


def test_policy_without_quantized_layer_is_an_error():
    with pytest.raises(ValueError, match="leaves no layer .* quantized"):
        LayerPolicy(rules=[], default=None).resolve(tiny_llama())


def test_unknown_format_suggests_the_closest_name():
    with pytest.raises(ValueError, match=r"Unknown quantization format 'nvfp5'.*Did you mean 'nvfp4'"):
        PolicyRule(patterns=["*"], weight="nvfp5")
    with pytest.raises(ValueError, match="Unknown policy preset"):
        LayerPolicy.preset("fastest")


def test_yaml_policies_instantiate_with_hydra_target():
    p = LayerPolicy.resolve_spec(str(CONF / "policy" / "default.yaml"))
    assert p.name == "default" and p.target_format == get_format("nvfp4")
    t = p.resolve(tiny_llama())
    assert _fmt(t, "model.layers.0.self_attn.o_proj")[0] == "fp8"
    assert _fmt(t, "model.layers.0.mlp.down_proj")[0] == "nvfp4"
    d = LayerPolicy.resolve_spec(str(CONF / "policy" / "trtllm_mixed.yaml"))
    assert _fmt(d.resolve(MegatronStyleGPT()), "decoder.layers.0.self_attention.linear_proj")[0] == "fp8"


def test_yaml_without_target_and_missing_file(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("default: fp8\nrules: []\n")
    assert LayerPolicy.from_yaml(f).default == "fp8"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LayerPolicy.from_yaml(tmp_path / "nope.yaml")


def test_w4a8_preset_keeps_fp4_weights_and_8_bit_inputs():
    for model, mlp, attn in [
        (tiny_llama(), "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"),
        (MegatronStyleGPT(), "decoder.layers.0.mlp.linear_fc2", "decoder.layers.0.self_attention.linear_qkv"),
    ]:
        for p in (LayerPolicy.preset("nvfp4_w4a8"), LayerPolicy.resolve_spec(str(CONF / "policy" / "nvfp4_w4a8.yaml"))):
            t = p.resolve(model)
            assert _fmt(t, mlp) == ("nvfp4", "fp8", "mlp") and _fmt(t, attn) == ("fp8", "fp8", "attention")
            assert p.target_format == get_format("nvfp4")


@pytest.mark.parametrize("path", sorted((CONF / "policy").glob("*.yaml")), ids=lambda p: p.stem)
def test_each_conf_policy_file_is_its_preset(path):
    """A user who switches from ``policy="<name>"`` to ``conf/policy/<name>.yaml`` gets the same run."""
    from nemo_fp4qat.qat.policy.rules import POLICY_PRESETS

    assert path.stem in POLICY_PRESETS, f"{path} has no preset of the same name"
    assert LayerPolicy.resolve_spec(str(path)).to_dict() == LayerPolicy.preset(path.stem).to_dict()


def test_default_deploys_to_tensorrt_llm_and_the_mxfp8_preset_says_it_does_not():
    from nemo_fp4qat.qat.policy.rules import TRTLLM_PRESETS

    assert "default" in TRTLLM_PRESETS and LayerPolicy.preset("default").runtime == "trtllm"
    assert "conservative_attention" not in TRTLLM_PRESETS
    with pytest.raises(ValueError, match="runtime='tensorrt'.*'trtllm'"):
        LayerPolicy(runtime="tensorrt")


def test_the_old_name_of_the_default_policy_warns_and_is_the_default():
    with pytest.warns(FutureWarning, match="'trtllm_mixed' is the 'default' policy under its older name"):
        old = LayerPolicy.resolve_spec("trtllm_mixed")
    assert old.rules == LayerPolicy.resolve_spec("default").rules
