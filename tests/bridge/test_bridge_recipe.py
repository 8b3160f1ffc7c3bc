"""The Llama-3 NVFP4 QAD example builds as a Megatron-Bridge config at each recipe's shape (Bridge's own recipes,
offline), and its policy gives every layer of the model the format it names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from paths import ROOT, worker_env

pytestmark = pytest.mark.bridge

# meta-llama/Meta-Llama-3-8B's config.json: all Bridge's recipe reads from the Hub (load_weights=False)
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip


# meta-llama/Meta-Llama-3-70B's
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
              "num_hidden_layers": 80}  # fmt: skip


def _offline_hub(home, name, config):
    """An offline Hugging Face cache holding the model's config, as a first download leaves it."""
    repo = home / "hub" / f"models--meta-llama--{name}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("size", "name", "config", "shape"),
    [("8b", "Meta-Llama-3-8B", LLAMA3_8B, "layers=32 hidden=4096 TP=2 PP=1 CP=1 seq=4096"),
     ("70b", "Meta-Llama-3-70B", LLAMA3_70B, "layers=80 hidden=8192 TP=8 PP=4 CP=1 seq=4096")],
)  # fmt: skip
def test_llama3_nvfp4_qad_example_builds_from_bridges_recipe_at_its_shape(tmp_path, size, name, config, shape):
    _offline_hub(tmp_path / "hf", name, config)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "bridge_llama3_nvfp4_qad.py"), "--dryrun", "--size", size,
         "--base", f"/ckpts/llama3_{size}", "--export-dir", str(tmp_path / "export")],
        env=worker_env(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1"), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert shape in out, out
    assert f"start from: /ckpts/llama3_{size}" in out
    assert "policy='default'" in out and "distillation='qad'" in out
    assert f"'hf_model': 'meta-llama/{name}'" in out
    # the policy against the recipe's module names: attention FP8, MLP NVFP4, embeddings, norms and output 16-bit
    rows = {line.split()[0]: line.split()[1:4] for line in out.splitlines() if line.startswith(("decoder.", "embed",
                                                                                               "output"))}  # fmt: skip
    for layer in (0, 1):
        for m in ("self_attention.linear_qkv", "self_attention.linear_proj"):
            assert rows[f"decoder.layers.{layer}.{m}"] == ["attention", "fp8", "fp8"], rows
        for m in ("mlp.linear_fc1", "mlp.linear_fc2"):
            assert rows[f"decoder.layers.{layer}.{m}"] == ["mlp", "nvfp4", "nvfp4"], rows
    for m in ("embedding.word_embeddings", "output_layer", "decoder.final_layernorm"):
        assert rows[m] == ["embedding_output_norm", "bf16", "bf16"], rows


def test_calibrated_and_learned_weight_scales_are_refused_on_bridge_by_name():
    from nemo_fp4qat import QATConfig
    from nemo_fp4qat.bridge import FP4QATBridgeCallback
    from nemo_fp4qat.specs import ConfigError

    for cfg in (QATConfig(learned_scales="post"), QATConfig(calibration={"weight_scale": "mse"})):
        with pytest.raises(ConfigError, match="not supported on the Megatron-Bridge front end yet.*weight_scale='max'"):
            FP4QATBridgeCallback(cfg)
    FP4QATBridgeCallback(QATConfig(calibration={"weight_scale": "search"}))  # the plugin's own search stays
