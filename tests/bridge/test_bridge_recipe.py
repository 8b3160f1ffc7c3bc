"""The Llama-3-8B NVFP4 QAD example builds as a Megatron-Bridge config (Bridge's own recipe, offline)."""

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


def _offline_hub(home):
    """An offline Hugging Face cache holding the model's config, as a first download leaves it."""
    repo = home / "hub" / "models--meta-llama--Meta-Llama-3-8B"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(LLAMA3_8B))


def test_llama3_8b_nvfp4_qad_example_builds_from_bridges_recipe(tmp_path):
    _offline_hub(tmp_path / "hf")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "bridge_llama3_8b_nvfp4_qad.py"), "--dryrun",
         "--base", "/ckpts/llama3_8b", "--export-dir", str(tmp_path / "export")],
        env=worker_env(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1"), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "layers=32 hidden=4096 TP=2 PP=1 CP=1 seq=4096" in out, out
    assert "start from: /ckpts/llama3_8b" in out
    assert "policy='default'" in out and "distillation='qad'" in out
    assert "'hf_model': 'meta-llama/Meta-Llama-3-8B'" in out


def test_calibrated_and_learned_weight_scales_are_refused_on_bridge_by_name():
    from nemo_fp4qat import QATConfig
    from nemo_fp4qat.bridge import FP4QATBridgeCallback
    from nemo_fp4qat.specs import ConfigError

    for cfg in (QATConfig(learned_scales="post"), QATConfig(calibration={"weight_scale": "mse"})):
        with pytest.raises(ConfigError, match="not supported on the Megatron-Bridge front end yet.*weight_scale='max'"):
            FP4QATBridgeCallback(cfg)
    FP4QATBridgeCallback(QATConfig(calibration={"weight_scale": "search"}))  # the plugin's own search stays
