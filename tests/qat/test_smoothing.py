"""Activation smoothing folded into the weights (#17): the factors, the fold, the unchanged function,
the one-time application in calibration, and clear refusals.

The factors are checked against SmoothQuant's formula computed here in float64 from activations
captured on an untouched copy of the model (plain forward pre-hooks, no plugin code), and the fold
against the original weights divided / multiplied by those factors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from nemo_fp4qat import QATController
from nemo_fp4qat.qat.calibration.calibrate import CalibrationConfig
from nemo_fp4qat.qat.calibration.smoothing import SmoothingConfig, find_smoothing_sites, smooth_model

from tiny_models import VOCAB, tiny_llama

pytestmark = pytest.mark.twice("policies become modelopt 0.37's quantizer configs (its dict form) and its calibration")


def FWD(m: nn.Module, b: torch.Tensor):
    return m(b)


def _batches(n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(n)]


def _reference_factors(model: nn.Module, layer: str, consumers: list[str], batches, alpha: float) -> torch.Tensor:
    """SmoothQuant's s = max|x|^alpha / max|W|^(1-alpha), float64, from an untouched model."""
    mods = dict(model.named_modules())
    seen: list[torch.Tensor] = []
    h = mods[consumers[0]].register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach().double()))
    with torch.no_grad():
        for b in batches:
            model(b)
    h.remove()
    act = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen]).abs().amax(0)
    w = torch.stack([mods[c].weight.detach().double().abs().amax(0) for c in consumers]).amax(0)
    return act.clamp(min=1e-5) ** alpha / w.clamp(min=1e-5) ** (1 - alpha)


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_factors_and_fold_match_smoothquant_and_keep_the_function(alpha):
    model = tiny_llama(seed=1)
    with torch.no_grad():  # an outlier channel, as real activations have
        model.model.layers[0].post_attention_layernorm.weight[5] = 20.0
    orig, batches = copy.deepcopy(model), _batches()
    x = batches[0]
    with torch.no_grad():
        before = orig(x).logits
    p = "model.layers.0."
    ref_mlp = _reference_factors(orig, p + "mlp", [p + "mlp.gate_proj", p + "mlp.up_proj"], batches, alpha)
    ref_attn = _reference_factors(orig, p + "attn", [p + f"self_attn.{c}_proj" for c in "qkv"], batches, alpha)
    sites = smooth_model(model, batches, SmoothingConfig(alpha=alpha, sites=("attn_in", "mlp_in")), FWD)
    by_name = {(s.kind, s.producer): s for s in sites}
    assert len(sites) == 4  # 2 layers x 2 sites
    s_mlp = by_name["mlp_in", p + "post_attention_layernorm"].factors.double()
    s_attn = by_name["attn_in", p + "input_layernorm"].factors.double()
    torch.testing.assert_close(s_mlp, ref_mlp, rtol=1e-5, atol=0)
    torch.testing.assert_close(s_attn, ref_attn, rtol=1e-5, atol=0)
    assert s_mlp[5] > 2 * s_mlp.median()  # the outlier channel is the one scaled down hardest
    o, n = orig.model.layers[0], model.model.layers[0]
    torch.testing.assert_close(n.post_attention_layernorm.weight.double(),
                               o.post_attention_layernorm.weight.double() / ref_mlp, rtol=1e-5, atol=0)  # fmt: skip
    for c in ("gate_proj", "up_proj"):
        torch.testing.assert_close(getattr(n.mlp, c).weight.double(), getattr(o.mlp, c).weight.double() * ref_mlp,
                                   rtol=1e-5, atol=0)  # fmt: skip
    torch.testing.assert_close(n.mlp.down_proj.weight, o.mlp.down_proj.weight, rtol=0, atol=0)  # not a site
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, before, rtol=1e-4, atol=1e-4)


def test_mlp_down_folds_into_up_proj_rows():
    model, batches = tiny_llama(seed=2), _batches()
    orig = copy.deepcopy(model)
    p = "model.layers.1."
    ref = _reference_factors(orig, p, [p + "mlp.down_proj"], batches, 0.5)
    smooth_model(model, batches, SmoothingConfig(sites=("mlp_down",)), FWD)
    o, n = orig.model.layers[1].mlp, model.model.layers[1].mlp
    torch.testing.assert_close(n.up_proj.weight.double(), o.up_proj.weight.double() / ref[:, None], rtol=1e-5, atol=0)
    torch.testing.assert_close(n.down_proj.weight.double(), o.down_proj.weight.double() * ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(n.gate_proj.weight, o.gate_proj.weight, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(batches[0]).logits, orig(batches[0]).logits, rtol=1e-4, atol=1e-4)


def test_calibration_smooths_once_with_the_quantizers_off():
    """The controller smooths before the first amax (activation ranges measured unquantized) and never
    again: a second calibrate (as after a resume or at a switch) leaves the weights alone."""
    model, batches = tiny_llama(seed=3), _batches()
    orig = copy.deepcopy(model)
    ref = _reference_factors(orig, "", ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"], batches, 0.5)
    ctl = QATController(policy="default", calibration={"num_samples": 6, "smoothing": True}, forward_fn=FWD)
    ctl.prepare(model)
    ctl.calibrate(model, batches)
    norm = model.model.layers[0].post_attention_layernorm.weight
    torch.testing.assert_close(norm.double(), orig.model.layers[0].post_attention_layernorm.weight.double() / ref,
                               rtol=1e-5, atol=0)  # fmt: skip
    assert sorted(s.kind for s in ctl.smoothed) == ["attn_in", "attn_in", "mlp_in", "mlp_in"]  # the defaults
    assert all(q.is_enabled for n, q in model.named_modules() if n.endswith("mlp.up_proj.input_quantizer"))
    snapshot = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("weight")}
    ctl.calibrate(model, batches)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in snapshot.items())


def test_smoothing_specs_resolve_and_bad_ones_name_the_fix():
    assert SmoothingConfig.resolve_spec(None) is None and SmoothingConfig.resolve_spec(False) is None
    assert SmoothingConfig.resolve_spec(True) == SmoothingConfig()
    assert SmoothingConfig.resolve_spec(0.7).alpha == 0.7
    assert SmoothingConfig.resolve_spec({"sites": "attn_in"}).sites == ("attn_in",)
    assert CalibrationConfig.resolve_spec({"num_samples": 128, "smoothing": 0.6}).smoothing.alpha == 0.6
    from omegaconf import OmegaConf  # as a YAML config (conf/callback/fp4qat.yaml) hands it over

    yaml = OmegaConf.create({"num_samples": 128, "smoothing": {"sites": ["attn_in"], "alpha": 0.4}})
    assert CalibrationConfig.resolve_spec(yaml).smoothing == SmoothingConfig(alpha=0.4, sites=("attn_in",))
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        SmoothingConfig(alpha=1.5)
    with pytest.raises(ValueError, match="choose from"):
        SmoothingConfig(sites=("mlp_out",))
    with pytest.raises(ValueError, match="Unknown smoothing field"):
        SmoothingConfig.resolve_spec({"strength": 0.5})
    with pytest.raises(ValueError, match="not understood"):
        SmoothingConfig.resolve_spec("yes")


def test_models_without_known_blocks_are_refused_by_name():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match="match no module of Sequential.*Turn smoothing off"):
        find_smoothing_sites(model, ("mlp_in",))


def test_zero_centred_norms_are_refused():
    model = tiny_llama(seed=4)
    model.model.layers[0].post_attention_layernorm.zero_centered_gamma = True
    with pytest.raises(ValueError, match="zero-centred"):
        find_smoothing_sites(model, ("mlp_in",))


def _gated_gpt():
    """A megatron-core GPT with SwiGLU and RMSNorm (Llama's layout) on the local spec."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
                            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                            bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
                            add_bias_linear=False)  # fmt: skip
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=96, max_sequence_length=64, position_embedding_type="rope")  # fmt: skip


@pytest.mark.nemo
def test_megatron_gpt_smoothing_keeps_the_function():
    """megatron-core's fused linear_qkv / linear_fc1 (gate|up halves) and its norms, on the CPU; a
    non-gated MLP (GeLU) has no linear path into linear_fc2 and is refused for mlp_down."""
    pytest.importorskip("megatron.core")
    from nemo_fp4qat.nemo import megatron_cpu_mode

    from megatron_utils import gpt_inputs, init_single_process_parallel, tiny_gpt

    init_single_process_parallel()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 96, (2, 16), generator=g) for _ in range(3)]
    fwd = lambda m, b: m(*gpt_inputs(b))  # noqa: E731
    with megatron_cpu_mode(), torch.no_grad():
        model = _gated_gpt().eval()
        before = fwd(model, batches[0]).clone()
        sites = smooth_model(model, batches, SmoothingConfig(sites=("attn_in", "mlp_in", "mlp_down")), fwd)
        assert sorted({s.kind for s in sites}) == ["attn_in", "mlp_down", "mlp_in"] and len(sites) == 6
        down = next(s for s in sites if s.kind == "mlp_down")
        rows = dict(model.named_modules())[down.producer].weight.shape[0]
        assert down.rows == slice(rows // 2, rows)  # the up half of megatron's gate|up
        torch.testing.assert_close(fwd(model, batches[0]), before, rtol=1e-4, atol=1e-4)
        gelu = tiny_gpt(hidden=64).eval()
        with pytest.raises(ValueError, match="Drop 'mlp_down'"):
            find_smoothing_sites(gelu, ("mlp_down",))
        before = fwd(gelu, batches[0]).clone()
        smooth_model(gelu, batches, SmoothingConfig(sites=("attn_in", "mlp_in")), fwd)  # LayerNorm: gamma and beta
        torch.testing.assert_close(fwd(gelu, batches[0]), before, rtol=1e-4, atol=1e-4)
