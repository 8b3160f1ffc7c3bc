"""What the serving engines' loaders read from a unified HF checkpoint beyond modelopt's own fields: the 16-bit
linear layers named (``exclude_modules`` / ``ignore``), ``quant_method`` in ``hf_quant_config.json`` and
``kv_cache_quant_algo`` in ``config.json`` (null when the KV cache is not quantized); and the validator's check."""

from __future__ import annotations

import json
import shutil

import pytest

from nemo_fp4qat import LayerPolicy
from nemo_fp4qat.export import ExportConfig, export_checkpoint, validate_export

from tiny_models import calibrated_tiny_llama

pytestmark = pytest.mark.twice("modelopt 0.37's exporters write what NeMo's export path deploys")


def _fields(out):
    hq = json.loads((out / "hf_quant_config.json").read_text())
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    return hq, qc


@pytest.mark.parametrize("kv_cache", [None, "fp8"])
def test_mixed_precision_export_names_its_16_bit_linears_and_kv_cache_for_the_engines(tmp_path, kv_cache):
    # attention FP8, MLP NVFP4, but layer 1's o_proj left in 16 bits, as a policy override would
    policy = LayerPolicy.preset("default")
    policy.rules.insert(0, type(policy.rules[0])(patterns=["*layers.1.self_attn.o_proj"], weight="bf16", group="full"))
    policy.kv_cache = kv_cache
    out = export_checkpoint(calibrated_tiny_llama(policy), tmp_path / "hf", ExportConfig(kind="hf"))
    hq, qc = _fields(out)
    assert hq["quant_method"] == qc["quant_method"] == "modelopt"
    assert hq["quantization"]["quant_algo"] == "MIXED_PRECISION"
    unquantized = ["lm_head", "model.layers.1.self_attn.o_proj"]  # not the input embedding: not a linear layer
    assert hq["quantization"]["exclude_modules"] == qc["ignore"] == unquantized
    assert "model.layers.1.self_attn.o_proj" not in hq["quantization"]["quantized_layers"]
    want_kv = "FP8" if kv_cache else None
    assert (
        "kv_cache_quant_algo" in qc
        and qc["kv_cache_quant_algo"] == hq["quantization"]["kv_cache_quant_algo"] == want_kv
    )
    # the engines' fused layers, by name, in the format their shards share; the same table in both files
    layers = hq["quantization"]["quantized_layers"]
    for i in (0, 1):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        assert layers[f"{attn}.qkv_proj"] == layers[f"{attn}.q_proj"] == {"quant_algo": "FP8"}
        assert layers[f"{mlp}.gate_up_proj"] == layers[f"{mlp}.gate_proj"]
        assert layers[f"{mlp}.gate_up_proj"]["quant_algo"] == "NVFP4"
    assert qc["quantized_layers"] == layers
    assert validate_export(out).ok


def test_single_format_export_keeps_modelopts_exclusions_and_adds_them_to_ignore(tmp_path):
    out = export_checkpoint(calibrated_tiny_llama("nvfp4"), tmp_path / "hf", ExportConfig(kind="hf"))
    hq, qc = _fields(out)
    assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["quant_method"] == "modelopt"
    assert "lm_head" in hq["quantization"]["exclude_modules"]
    assert set(hq["quantization"]["exclude_modules"]) <= set(qc["ignore"]) and qc["kv_cache_quant_algo"] is None


@pytest.mark.parametrize(
    ("edit", "where", "message"),
    [
        (lambda hq, qc: hq["quantization"].update(exclude_modules=[]), "hf_quant_config.json", "16-bit linear layers"),
        (lambda hq, qc: hq.pop("quant_method"), "hf_quant_config.json", "no quant_method"),
        (lambda hq, qc: qc.pop("kv_cache_quant_algo"), "config.json", "kv_cache_quant_algo"),
        (lambda hq, qc: qc.update(ignore=[]), "config.json", "ignore lacks ['lm_head']"),
        (
            lambda hq, qc: [
                d["quantized_layers"].pop("model.layers.0.self_attn.qkv_proj") for d in (hq["quantization"], qc)
            ],
            "hf_quant_config.json",
            "does not name the fused layers ['model.layers.0.self_attn.qkv_proj']",
        ),
        (lambda hq, qc: qc.pop("quantized_layers"), "config.json", "quantization_config.quantized_layers"),
    ],
    ids=["exclude_modules", "quant_method", "kv_cache_quant_algo", "ignore", "fused_names", "config_layers"],
)
def test_validator_reports_an_engine_field_the_checkpoint_lacks(tmp_path, edit, where, message):
    src = export_checkpoint(calibrated_tiny_llama("default"), tmp_path / "hf", ExportConfig(kind="hf"))
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    hq, qc = _fields(bad)
    edit(hq, qc)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = qc
    (bad / "hf_quant_config.json").write_text(json.dumps(hq))
    (bad / "config.json").write_text(json.dumps(config))
    errors = [p for p in validate_export(bad, require_manifest=False).errors if p.tensor == where]
    assert any(message in p.message for p in errors), [str(p) for p in errors]


@pytest.mark.parametrize(("policy", "gemm"), [("nvfp4", "nvfp4"), ("fp8", "auto")])
def test_engine_script_builds_nvfp4_layers_with_tensorrt_llms_fp4_gemm_plugin(tmp_path, policy, gemm):
    out = export_checkpoint(calibrated_tiny_llama(policy), tmp_path / "ckpt", ExportConfig(kind="trtllm"))
    build = (out / "build_engine.sh").read_text().splitlines()
    assert next(line for line in build if line.startswith("trtllm-build")).count(f"--gemm_plugin {gemm} ") == 1
    plan = json.loads((out / "engine_plan.json").read_text())
    assert plan["plugins"]["gemm_plugin"] == "auto" and f"--gemm_plugin {gemm} " in plan["commands"][0]


def test_hf_engine_script_gives_the_lm_eval_command_for_the_served_checkpoint(tmp_path):
    out = export_checkpoint(calibrated_tiny_llama("nvfp4"), tmp_path / "hf", ExportConfig(kind="hf"))
    script = (out / "build_engine.sh").read_text()
    assert f"# lm_eval --model vllm --model_args pretrained={out.resolve()},tensor_parallel_size=1" in script


def test_fused_siblings_in_different_formats_are_refused_before_anything_is_written(tmp_path):
    from nemo_fp4qat.export import ExportRefused

    policy = LayerPolicy.preset("default")  # attention FP8; q_proj alone moved to NVFP4
    policy.rules.insert(0, type(policy.rules[0])(patterns=["*.q_proj"], weight="nvfp4", group="q"))
    model = calibrated_tiny_llama(policy)
    with pytest.raises(ExportRefused, match=r"self_attn: fused siblings in different formats \(q_proj=nvfp4/nvfp4, "
                       r"k_proj=fp8/fp8, v_proj=fp8/fp8, weight/input\)"):  # fmt: skip
        export_checkpoint(model, tmp_path / "hf", ExportConfig(kind="hf"))
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(("policy", "nvfp4"), [("default", True), ("fp8", False)])
def test_the_plan_says_where_nvfp4_runs_as_trained(tmp_path, policy, nvfp4, caplog):
    """NVFP4 checkpoints say, in the plan, the engine script and the export's log, that they run as trained on
    Blackwell only (weight-only in vLLM / SGLang before it, nowhere on a CPU); an FP8 checkpoint says nothing."""
    with caplog.at_level("WARNING", logger="nemo_fp4qat"):
        out = export_checkpoint(calibrated_tiny_llama(policy), tmp_path / "hf", ExportConfig(kind="hf"))
    notes = json.loads((out / "engine_plan.json").read_text())["deployment"]
    script = (out / "build_engine.sh").read_text()
    logged = [r.getMessage() for r in caplog.records if "Blackwell" in r.getMessage()]
    if not nvfp4:
        assert notes == [] and "Blackwell" not in script and not logged
        return
    assert len(notes) == 1 and "Blackwell GPUs only" in notes[0] and "weight-only on Hopper / Ada" in notes[0]
    assert f"# {notes[0]}" in script.splitlines() and logged == notes
