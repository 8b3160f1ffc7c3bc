"""gpt-oss as NVIDIA trains it: QAD to weight-only MXFP4 on its experts (policy ``gpt_oss_mxfp4``, modelopt's
``_QuantGptOssExperts``), exported in gpt-oss's own MXFP4 checkpoint layout, which transformers' own gpt-oss loader
reads back as the model that trained; attention sinks and the clamped SwiGLU untouched."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_moe import build

from nemo_fp4qat import QATController
from nemo_fp4qat.export import ExportConfig, ExportRefused, export_checkpoint
from nemo_fp4qat.export.validate import validate_export
from nemo_fp4qat.monitor.analysis import analyze_model

from tiny_models import qad_fit

pytestmark = [
    # modelopt 0.47's gpt-oss wrapper and transformers 5's MXFP4 loader (the core environment)
    pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="its MXFP4 loader: transformers 5"),
]
EXPERTS = [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")]


def _gpt_oss() -> torch.nn.Module:
    return build("GptOss", {"GptOss": {}})


def _batches(n: int = 2, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (2, 16), generator=g) for _ in range(n)]


def _trained_experts(model, proj_name: str) -> torch.Tensor:
    module = model.get_submodule(proj_name.rpartition(".")[0])
    proj = proj_name.rpartition(".")[2]
    q = getattr(module, f"{proj}_weight_quantizer")
    with torch.no_grad():
        return q(getattr(module, proj).detach().transpose(-1, -2)).transpose(-1, -2)


@pytest.fixture(scope="module")
def qad_export(tmp_path_factory):
    """A tiny gpt-oss after two QAD steps under ``gpt_oss_mxfp4`` (Lightning), and its export for vLLM."""
    model = _gpt_oss()
    sinks = [layer.self_attn.sinks.detach().clone() for layer in model.model.layers]
    qat, _ = qad_fit(model, "gpt_oss_mxfp4", steps=2)
    out = tmp_path_factory.mktemp("gpt_oss") / "export"
    export_checkpoint(model, out, ExportConfig(kind="hf", runtime="vllm"))
    return model, qat, out, sinks


def test_gpt_oss_trains_with_qad_to_mxfp4_experts_and_keeps_the_rest_16_bit(qad_export):
    model, qat, _, sinks = qad_export
    assert qat.distiller is not None and qat.distiller.last
    rows = {r.module: r for r in qat.controller.table.rows}
    for name in EXPERTS:
        assert (rows[name].group, rows[name].weight, rows[name].input) == ("experts", "mxfp4", "bf16")
    quantized = {n for n, r in rows.items() if r.quantized}
    assert quantized == set(EXPERTS)  # attention, router, lm_head: 16-bit
    experts = model.model.layers[0].mlp.experts
    weights = experts.gate_up_proj_weight_quantizer
    assert weights.is_enabled and weights.num_bits == (2, 1) and weights.block_sizes[-1] == 32
    assert not experts.gate_up_proj_input_quantizer.is_enabled  # weight-only, as OpenAI ships it
    # the attention sinks trained as ordinary 16-bit parameters (QAD moved them), untouched by any quantizer
    assert all(not torch.equal(layer.self_attn.sinks, s) for layer, s in zip(model.model.layers, sinks, strict=True))
    assert experts.limit == 7.0 and experts.alpha == 1.702  # the clamped SwiGLU as the model defines it


def test_the_export_is_gpt_oss_own_mxfp4_layout_validated_code_for_code(qad_export):
    model, _, out, _ = qad_export
    report = json.loads((out / "validation.json").read_text())
    assert report["ok"], report["errors"]
    num = report["numeric"]
    assert num["layers_compared"] == len(EXPERTS) and num["fp4_codes_different"] == 0
    assert num["fp4_codes_compared"] == sum(_trained_experts(model, n).numel() for n in EXPERTS)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert "model.layers.*.self_attn" in config["quantization_config"]["modules_to_not_convert"]
    tensors = load_file(str(out / "model.safetensors"))
    h, f, e = model.config.hidden_size, model.config.intermediate_size, 4
    blocks, scales = tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"], tensors[
        "model.layers.0.mlp.experts.gate_up_proj_scales"]  # fmt: skip
    assert blocks.dtype == scales.dtype == torch.uint8
    assert list(blocks.shape) == [e, 2 * f, h // 32, 16] and list(scales.shape) == [e, 2 * f, h // 32]
    assert list(tensors["model.layers.0.mlp.experts.down_proj_blocks"].shape) == [e, h, f // 32, 16]
    assert "model.layers.0.mlp.experts.gate_up_proj" not in tensors  # no 16-bit copy of the experts
    assert "model.layers.0.self_attn.sinks" in tensors
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_bias"].dtype == torch.float16


def test_transformers_loads_the_export_as_the_model_that_trained(qad_export):
    """transformers' own gpt-oss MXFP4 loader (dequantizing on the CPU) rebuilds every expert weight exactly as
    trained, and the rebuilt model computes what the trained one computes with its other weights as exported."""
    model, _, out, _ = qad_export
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.Mxfp4Config(dequantize=True)
    ).float()
    for name in EXPERTS:
        got = loaded.get_submodule(name.rpartition(".")[0])
        assert torch.equal(getattr(got, name.rpartition(".")[2]).detach(), _trained_experts(model, name))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in reference.named_parameters():
            if not n.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(p.half().float())  # the checkpoint holds them in float16 (for vLLM)
        batch = _batches(1, seed=5)[0]
        torch.testing.assert_close(loaded(batch).logits, reference(batch).logits, rtol=1e-5, atol=1e-5)


def test_the_validator_names_a_changed_code_or_scale(qad_export, tmp_path):
    model, _, out, _ = qad_export
    for suffix, tweak in (("_blocks", lambda t: t ^ 0x01), ("_scales", lambda t: t + 1)):
        broken = tmp_path / suffix
        broken.mkdir()
        for f in out.iterdir():
            (broken / f.name).write_bytes(f.read_bytes())
        tensors = load_file(str(broken / "model.safetensors"))
        key = f"model.layers.1.mlp.experts.down_proj{suffix}"
        t = tensors[key].clone()
        t.view(-1)[:1] = tweak(t.view(-1)[:1])
        tensors[key] = t
        save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
        report = validate_export(broken, model=model, runtime="vllm", require_manifest=False)
        assert not report.ok
        assert any(p.tensor == "model.layers.1.mlp.experts.down_proj" and "differ from the trained" in p.message
                   for p in report.errors), report.format()  # fmt: skip


def test_what_gpt_oss_layout_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    nvfp4 = {"rules": [{"patterns": ["*.experts.*"], "weight": "nvfp4", "group": "experts"}], "default": None}
    attention_too = {"rules": [{"patterns": ["*.experts.*"], "weight": "mxfp4", "input": None, "group": "experts"}],
                     "default": "fp8"}  # fmt: skip
    cases = [(nvfp4, "hf", r"experts\.gate_up_proj trained as weight nvfp4.*weight-only MXFP4"),
             (attention_too, "hf", r"self_attn\.q_proj .*quantized beside the gpt-oss experts"),
             ("gpt_oss_mxfp4", "trtllm", r"as a Hugging Face checkpoint in gpt-oss's own MXFP4 layout")]  # fmt: skip
    for policy, kind, match in cases:
        model = _gpt_oss()
        ctl = QATController(policy=policy, schedule="direct", forward_fn=lambda m, b: m(b))
        ctl.prepare(model)
        ctl.calibrate(model, _batches())
        with pytest.raises(ExportRefused, match=match):
            export_checkpoint(model, tmp_path / "ckpt", ExportConfig(kind=kind))
        assert not (tmp_path / "ckpt").exists()


def test_a_switch_to_mxfp4_moves_every_expert_a_resume_restores_it_and_the_monitor_sees_each_expert():
    schedule = {"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "mxfp4"}]}
    policy = {"rules": [{"patterns": ["*.experts.*"], "weight": "mxfp4", "input": None, "group": "experts"}],
              "default": None}  # fmt: skip
    model = _gpt_oss()
    ctl = QATController(policy=policy, schedule=schedule, forward_fn=lambda m, b: m(b))
    ctl.prepare(model)
    ctl.calibrate(model, _batches())
    experts = model.model.layers[0].mlp.experts
    assert experts.down_proj_weight_quantizer.num_bits == (4, 3)  # FP8 first
    events = [e for s in range(3) for e in ctl.step(model, s)]
    assert events == [{"step": 2, "group": "experts", "from": "fp8", "to": "mxfp4", "modules": 4}]
    down = experts.down_proj_weight_quantizer
    assert down.num_bits == (2, 1) and down.block_sizes[-1] == 32
    records = analyze_model(model)
    for i in range(4):
        assert records[f"model.layers.0.mlp.experts.{i}.down_proj"]["weight_rel_err"] > 0
    assert ctl.group_of("model.layers.1.mlp.experts.2.gate_up_proj") == "experts"

    resumed = _gpt_oss()
    ctl2 = QATController(policy=policy, schedule=schedule, forward_fn=lambda m, b: m(b))
    ctl2.prepare(resumed)
    ctl2.sync_to_checkpoint(resumed, copy.deepcopy(ctl.state_dict()), model.state_dict())
    resumed.load_state_dict(model.state_dict(), strict=True)
    assert ctl2.current == ctl.current
    batch = _batches(1, seed=3)[0]
    with torch.no_grad():
        assert torch.equal(resumed(batch).logits, model(batch).logits)
