"""``auto_policy``: modelopt's AutoQuantize search (real modelopt, on the CPU) turned into a deployable policy."""

from __future__ import annotations

import pytest
import torch

from nemo_fp4qat import LayerPolicy
from nemo_fp4qat.qat.policy.auto import auto_policy
from nemo_fp4qat.specs import ConfigError

from tiny_models import VOCAB, tiny_llama, tiny_moe

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")


def _cost() -> dict[tuple[str, str], float]:
    """modelopt's effective bits per weight of each format: NVFP4 counts its block scales from 0.4x on."""
    import modelopt

    nvfp4 = 4.0 if modelopt.__version__.startswith("0.37") else 4.5
    return {("nvfp4", "nvfp4"): nvfp4, ("fp8", "fp8"): 8.0, ("nvfp4", "fp8"): 4.0, ("bf16", "bf16"): 16.0}


def _batches(n: int = 4):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, VOCAB, (2, 32), generator=g)} for _ in range(n)]


def _formats():
    import modelopt.torch.quantization as mtq

    return ("nvfp4", "fp8", "nvfp4_w4a8") if hasattr(mtq, "W4A8_NVFP4_FP8_CFG") else ("nvfp4", "fp8")


def _bits(policy: LayerPolicy, model) -> float:
    """Effective bits over every linear weight (lm_head in 16 bits included), as modelopt counts them."""
    mods = dict(model.named_modules())
    rows = [r for r in policy.resolve(model).rows if r.quantizable]
    n = {r.module: mods[r.module].weight.numel() for r in rows}
    cost = _cost()
    return sum(cost[(r.weight, r.input)] * n[r.module] for r in rows) / sum(n.values())


def _by_layer(policy: LayerPolicy, model) -> dict[str, tuple[str, str]]:
    return {r.module: (r.weight, r.input) for r in policy.resolve(model).rows if r.quantizable}


def test_auto_policy_spends_the_budget_keeps_siblings_together_and_round_trips(tmp_path):
    model = tiny_llama(hidden=64, layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tight = auto_policy(model, _batches(), effective_bits=5.2, formats=_formats())
    loose = auto_policy(model, _batches(), effective_bits=7.0, formats=_formats())
    # the search ran on a copy: the model is as it was, without quantizers
    assert not any(hasattr(m, "weight_quantizer") for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # within each budget, and the larger budget buys more bits
    assert _bits(tight, model) <= 5.2 + 1e-6 and _bits(loose, model) <= 7.0 + 1e-6
    assert _bits(tight, model) < _bits(loose, model)
    for policy in (tight, loose):
        layers = _by_layer(policy, model)
        assert layers["lm_head"] == ("bf16", "bf16")  # embeddings / output / norms stay full precision
        for i in range(2):  # TensorRT-LLM fuses q/k/v and gate/up: one format each
            p = f"model.layers.{i}"
            assert len({layers[f"{p}.self_attn.{x}_proj"] for x in "qkv"}) == 1
            assert layers[f"{p}.mlp.gate_proj"] == layers[f"{p}.mlp.up_proj"]
        # the same formats when the model is wrapped (a LightningModule holding it as `net`)
        wrapper = torch.nn.Module()
        wrapper.net = model
        assert {k.removeprefix("net."): v for k, v in _by_layer(policy, wrapper).items()} == layers
        # written out and read back: the same policy, module by module
        path = policy.to_yaml(tmp_path / f"{policy.name}_{id(policy)}.yaml", header="auto_policy test")
        assert path.read_text().startswith("# auto_policy test\n")
        again = LayerPolicy.from_yaml(path)
        assert again.to_dict() == policy.to_dict() and _by_layer(again, model) == layers


def test_auto_policy_refuses_what_it_cannot_search():
    model = tiny_llama(hidden=64, layers=1)
    with pytest.raises(ConfigError, match="mxfp4"):
        auto_policy(model, _batches(1), effective_bits=6.0, formats=("nvfp4", "mxfp4"))
    with pytest.raises(ConfigError, match="between 4 and 16"):
        auto_policy(model, _batches(1), effective_bits=3.0)
    with pytest.raises(ConfigError, match="effective_bits=4.1"):
        auto_policy(model, _batches(1), effective_bits=4.1, formats=("nvfp4", "fp8"))
    with pytest.raises(ConfigError, match="at least one batch"):
        auto_policy(model, [], effective_bits=6.0)


# core only: modelopt 0.37's AutoQuantize scores (and picks formats for) each expert apart, which the MoE check
# refuses (one format per layer's experts); 0.47 searches a layer's experts as one group
@pytest.mark.core_only
def test_auto_policy_files_an_moes_routers_in_their_own_group():
    """Routers stay in 16 bits in a group of their own, as in the presets: a schedule offset or a monitor rollback
    names them apart from the embeddings."""
    model = tiny_moe("qwen3", seed=1)
    policy = auto_policy(model, _batches(), effective_bits=7.0, formats=_formats())
    table = policy.resolve(model)
    routers = sorted(r.module for r in table.rows if r.group == "router")  # transformers 5's are not linear layers
    assert routers == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert all(not r.quantized for r in table.rows if r.group == "router")
