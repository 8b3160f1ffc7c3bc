"""The exports read the way TensorRT-LLM 1.2 reads them (its Python does not install on CPU machines, so its field
names and matching rules are written down here from its source, 1.2 development line):

* ``tensorrt_llm/models/modeling_utils.py``: a TensorRT-LLM checkpoint's ``config.json`` ``"quantization"`` block
  becomes ``QuantConfig(**block)`` (an unknown key is a ``TypeError``); ``MIXED_PRECISION`` reads
  ``quant_cfg.json`` into ``LayerQuantConfig`` (``quant_algo``, ``kv_cache_quant_algo``, ``quantized_layers`` of
  ``QuantConfig`` fields).
* ``tensorrt_llm/quantization/mode.py``: the ``QuantAlgo`` names; ``KV_CACHE_QUANT_ALGO_LIST``.
* ``tensorrt_llm/_torch/model_config.py`` (the PyTorch backend, which serves unified HF checkpoints): reads
  ``hf_quant_config.json["quantization"]``'s ``quant_algo``, ``kv_cache_quant_algo``, ``group_size``,
  ``exclude_modules``, and for ``MIXED_PRECISION`` its ``quantized_layers`` (``quant_algo``, ``group_size`` each);
  it has no ``quant_method == "modelopt"`` branch for ``config.json``, so ``hf_quant_config.json`` must be there.
  ``QuantConfig.is_module_excluded_from_quantization`` matches ``exclude_modules`` with ``fnmatchcase``, a fused
  module (``qkv_proj``, ``gate_up_proj``) also under its shards' names; ``apply_layerwise_quant_config`` finds a
  fused layer's format under its first shard (``q_proj``, ``gate_proj``) or its fused name.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase

import pytest

from nemo_fp4qat import LayerPolicy
from nemo_fp4qat.export import ExportConfig, export_checkpoint

from tiny_models import calibrated_tiny_llama

pytestmark = pytest.mark.twice("modelopt 0.37's exporters write what NeMo's export path deploys")

QUANT_CONFIG_FIELDS = {
    "quant_algo", "kv_cache_quant_algo", "group_size", "smoothquant_val", "clamp_val", "use_meta_recipe",
    "has_zero_point", "pre_quant_scale", "exclude_modules", "mamba_ssm_cache_dtype",
}  # fmt: skip
LAYER_QUANT_CONFIG_FIELDS = {"quant_algo", "kv_cache_quant_algo", "quantized_layers"}
QUANT_ALGOS = {
    "W8A16", "W4A16", "W4A16_AWQ", "W4A8_AWQ", "W8A16_GPTQ", "W4A16_GPTQ", "W8A8_SQ_PER_CHANNEL",
    "W8A8_SQ_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN",
    "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN", "W4A8_QSERVE_PER_GROUP", "W4A8_QSERVE_PER_CHANNEL", "FP8",
    "FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES", "INT8", "MIXED_PRECISION", "NVFP4", "W4A8_NVFP4_FP8",
    "W4A8_MXFP4_FP8", "W4A8_MXFP4_MXFP8", "W4A16_MXFP4", "NO_QUANT",
}  # fmt: skip
KV_CACHE_QUANT_ALGOS = {"FP8", "INT8", "NVFP4"}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _policy(kv_cache):
    """Attention FP8, MLP NVFP4, layer 1's o_proj left in 16 bits (a user's override)."""
    policy = LayerPolicy.preset("default")
    policy.rules.insert(0, type(policy.rules[0])(patterns=["*layers.1.self_attn.o_proj"], weight="bf16", group="full"))
    policy.kv_cache = kv_cache
    return policy


# the module TensorRT-LLM's Llama builds -> the format the policy trained it in (None: 16-bit)
TRAINED = {
    **{f"model.layers.{i}.self_attn.qkv_proj": "FP8" for i in (0, 1)},
    "model.layers.0.self_attn.o_proj": "FP8",
    "model.layers.1.self_attn.o_proj": None,
    **{f"model.layers.{i}.mlp.{m}": "NVFP4" for i in (0, 1) for m in ("gate_up_proj", "down_proj")},
    "lm_head": None,
}


def _excluded(name, patterns):
    """``QuantConfig.is_module_excluded_from_quantization``: the name, or a fused module's shard names."""
    head, _, last = name.rpartition(".")
    names = [name] + [f"{head}.{shard}" for shard in FUSED.get(last, ())]
    return any(fnmatchcase(n, p) for n in names for p in patterns or [])


def _layer_format(name, layers):
    """``apply_layerwise_quant_config``: a layer's own entry, a fused one's under its fused or first shard's name."""
    head, _, last = name.rpartition(".")
    for candidate in (name, *(f"{head}.{shard}" for shard in FUSED.get(last, ())[:1])):
        if candidate in layers:
            return layers[candidate]["quant_algo"]
    return None


@pytest.mark.parametrize("kv_cache", [None, "fp8"])
def test_trtllm_checkpoint_holds_only_fields_tensorrt_llm_1_2_constructs_its_configs_from(tmp_path, kv_cache):
    out = export_checkpoint(calibrated_tiny_llama(_policy(kv_cache)), tmp_path / "ckpt", ExportConfig(kind="trtllm"))
    block = json.loads((out / "config.json").read_text())["quantization"]
    assert set(block) <= QUANT_CONFIG_FIELDS, set(block) - QUANT_CONFIG_FIELDS  # QuantConfig(**block)
    assert block["quant_algo"] == "MIXED_PRECISION"
    assert block.get("kv_cache_quant_algo") == ("FP8" if kv_cache else None)
    layered = json.loads((out / "quant_cfg.json").read_text())  # LayerQuantConfig.from_dict
    assert set(layered) <= LAYER_QUANT_CONFIG_FIELDS, set(layered) - LAYER_QUANT_CONFIG_FIELDS
    assert layered["quantized_layers"]
    for name, cfg in layered["quantized_layers"].items():
        assert set(cfg) <= QUANT_CONFIG_FIELDS and cfg["quant_algo"] in QUANT_ALGOS, (name, cfg)
    formats = {cfg["quant_algo"] for cfg in layered["quantized_layers"].values()}
    assert formats == {"FP8", "NVFP4"}
    if kv_cache:
        assert layered["kv_cache_quant_algo"] in KV_CACHE_QUANT_ALGOS


@pytest.mark.parametrize("kv_cache", [None, "fp8"])
def test_unified_hf_checkpoint_gives_every_layer_its_trained_format_as_tensorrt_llm_1_2_reads_it(tmp_path, kv_cache):
    out = export_checkpoint(calibrated_tiny_llama(_policy(kv_cache)), tmp_path / "hf", ExportConfig(kind="hf"))
    q = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION" and q.get("kv_cache_quant_algo") == ("FP8" if kv_cache else None)
    layers = q["quantized_layers"]
    for cfg in layers.values():
        assert cfg["quant_algo"] in QUANT_ALGOS and set(cfg) <= QUANT_CONFIG_FIELDS, cfg
    served = {name: None if _excluded(name, q.get("exclude_modules")) else _layer_format(name, layers)
              for name in TRAINED}  # fmt: skip
    assert served == TRAINED
    # a 16-bit layer is excluded by name, not merely absent: TensorRT-LLM would otherwise apply a global algo
    assert all(_excluded(name, q["exclude_modules"]) for name, fmt in TRAINED.items() if fmt is None)
    assert not any(_excluded(name, q["exclude_modules"]) for name, fmt in TRAINED.items() if fmt is not None)


def test_single_format_hf_checkpoint_is_one_algo_with_its_16_bit_layers_excluded(tmp_path):
    out = export_checkpoint(calibrated_tiny_llama("nvfp4"), tmp_path / "hf", ExportConfig(kind="hf"))
    q = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16
    assert _excluded("lm_head", q["exclude_modules"])
    assert not _excluded("model.layers.0.mlp.gate_up_proj", q["exclude_modules"])
