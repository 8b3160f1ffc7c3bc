"""The one table of model families (``nemo_fp4qat/architectures.py``): the README's supported-models table is rendered
from it, the policies file every module name it lists in that name's group, every entry names tests that exist and a
preset, and the tiny-model helpers the chain's tests loop over cover exactly the families it lists."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from tiny_hybrids import HYBRIDS
from tiny_moe import FUSED_MOE

from nemo_fp4qat import LayerPolicy
from nemo_fp4qat.architectures import FAMILIES, expert_classes, fused_sibling_sets, module_patterns
from nemo_fp4qat.cli import main, supported_models_markdown
from nemo_fp4qat.qat.policy.fused_siblings import FUSED_SIBLING_SETS
from nemo_fp4qat.qat.policy.rules import POLICY_PRESETS

ROOT = Path(__file__).resolve().parents[1]
START = "<!-- supported-models: rendered by `nemo-fp4qat models --markdown` from nemo_fp4qat/architectures.py -->"
END = "<!-- /supported-models -->"


def _families_tested_by(test: str) -> set[str]:
    return {c for f in FAMILIES if test in f.tests and not f.refused for c in f.classes}


def test_the_readme_table_is_the_table_the_families_render(capsys):
    readme = (ROOT / "README.md").read_text()
    assert START in readme and END in readme, "the README's supported-models table lost its markers"
    block = readme.split(START, 1)[1].split(END, 1)[0]
    assert block.strip() == supported_models_markdown().strip(), "re-render it: nemo-fp4qat models --markdown"
    assert main(["models", "--markdown"]) == 0
    assert capsys.readouterr().out == supported_models_markdown()


def test_every_family_names_tests_that_exist_and_a_preset():
    for family in FAMILIES:
        assert family.tests and all((ROOT / t).is_file() for t in family.tests), family.name
        assert family.preset in POLICY_PRESETS, family.name
        assert family.refused or family.export or "tests/test_architectures.py" in family.tests, family.name


def test_the_default_preset_files_every_module_name_of_the_table_in_its_group():
    """A module named after each of a family's patterns falls under the default preset's rule of that group: the
    policies read their names from the table (a name added there is filed without another edit)."""
    policy = LayerPolicy.preset("default")
    for family in FAMILIES:
        for group, patterns in family.modules.items():
            for pattern in patterns:
                name = pattern.replace("*", "0") if not pattern.startswith("*") else "model.layers.0." + pattern.lstrip(
                    "*").lstrip(".").replace("*", "0")  # fmt: skip
                rule = next(r for r in policy.rules if r.matches(name))
                assert rule.group == group, (family.name, pattern, name, rule.group)


def test_the_derived_names_are_every_familys_once():
    for group in ("attention", "router", "ssm_mixer"):
        want = [p for f in FAMILIES for p in f.modules.get(group, ())]
        assert sorted(module_patterns(group)) == sorted(set(want))
    assert FUSED_SIBLING_SETS == fused_sibling_sets() and ("q_proj", "k_proj", "v_proj") in FUSED_SIBLING_SETS
    assert expert_classes("transposed", refused=False) == ("GptOssExperts",)
    assert "Llama4TextExperts" in expert_classes("transposed", refused=True)


def test_the_tiny_model_helpers_build_exactly_the_families_the_table_lists():
    assert len(FUSED_MOE) == 33 and {"Qwen3Moe", "Mixtral", "DeepseekV3", "Gemma4", "Zaya"} <= set(FUSED_MOE)
    hybrids = _families_tested_by("tests/lightning/test_hybrid_qad.py") | _families_tested_by(
        "tests/qat/test_hybrid_policy.py")  # fmt: skip
    assert set(HYBRIDS) == hybrids - {"RecurrentGemma"}  # RecurrentGemma's config is built in its own test


def _transformers_moe_causal_lms() -> dict[str, list[str]]:
    """Every causal LM prefix the installed transformers ships whose modeling file defines an experts class (read
    from the source, nothing imported): prefix -> those classes."""
    found: dict[str, list[str]] = {}
    for path in sorted((Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        source = path.read_text()
        experts = re.findall(r"^class (\w+Experts)\(", source, re.M)
        for prefix in re.findall(r"^class (\w+)ForCausalLM\(", source, re.M):
            if experts:
                found[prefix] = experts
    return found


def test_every_mixture_of_experts_causal_lm_transformers_ships_is_in_the_table():
    """A family a later transformers adds fails here until the table lists it: supported (and then carried through
    the chain by the tests it names) or refused by name with its reason."""
    listed = {c for f in FAMILIES for c in f.classes}
    shipped = _transformers_moe_causal_lms()
    assert len(shipped) > (30 if int(transformers.__version__.split(".")[0]) >= 5 else 5), "the scan found too few"
    assert {p: e for p, e in shipped.items() if p not in listed} == {}


# tiny configs of the families the table lists by module names only (its "other decoder layouts")
_OTHER_LAYOUTS = {
    "Phi3": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2),
    "Phi": dict(hidden_size=64, num_attention_heads=4, intermediate_size=128),
    "GPTNeoX": dict(hidden_size=64, num_attention_heads=4, intermediate_size=128),
    "OPT": dict(hidden_size=64, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(_OTHER_LAYOUTS))
def test_an_other_decoder_layout_files_every_linear_in_a_named_group(family):
    assert family in _families_tested_by("tests/test_architectures.py")
    config = getattr(transformers, f"{family}Config")(vocab_size=128, num_hidden_layers=2, **_OTHER_LAYOUTS[family])
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, f"{family}ForCausalLM")(config)
    rows = [r for r in LayerPolicy.preset("default").resolve(model).rows if r.quantizable]
    groups = {r.module.rpartition(".")[2]: r.group for r in rows}
    assert set(groups.values()) == {"attention", "mlp", "embedding_output_norm"}, groups
