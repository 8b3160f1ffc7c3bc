"""The demo model through NeMo (#4): SmolLM2-135M imported from its local files into a NeMo Llama
checkpoint (NeMo's HF importer, megatron CPU mode), cached; logits match Hugging Face's; the same
policy quantizes NeMo's fused layers exactly like the HF siblings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_utils import free_port
from paths import WORKERS, worker_env

pytestmark = pytest.mark.nemo


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    pytest.importorskip("nemo")
    cache = os.environ.get("NEMO_FP4QAT_CACHE") or str(Path.home() / ".cache" / "nemo_fp4qat")
    worker = [sys.executable, str(WORKERS / "nemo_import_worker.py"), cache]
    env = worker_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # NeMo's importer inits dist
    proc = subprocess.run(worker, capture_output=True, text=True, timeout=1800, cwd=tmp_path_factory.mktemp("import"),
                          env=env)  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(line[len("RESULT ") :])


def test_imported_logits_match_hugging_face(result):
    assert result["rel_err"] < 1e-3  # fp32, same tokens
    assert result["norm_weights_not_one"]  # the local-spec RMSNorm weights were imported, not left at 1.0


def test_quantized_nemo_model_exports_a_validated_hf_checkpoint_in_the_models_layout(result):
    export = result["hf_export"]
    assert export["ok"] and export["numeric"]["fp4_codes_different"] == 0 and export["numeric"]["fp4_codes_compared"]
    # each layer in its trained format under SmolLM2's names: attention FP8, MLP NVFP4 (q/k/v and gate/up split out
    # of NeMo's fused layers), lm_head 16-bit
    assert export["quant_algo"] == "MIXED_PRECISION"
    assert {v for k, v in export["layers"].items() if ".self_attn." in k} == {"FP8"}
    assert {v for k, v in export["layers"].items() if ".mlp." in k} == {"NVFP4"}
    assert len([k for k in export["layers"] if k.endswith((".q_proj", ".gate_proj", ".down_proj"))]) == 3 * 30
    assert "lm_head" not in export["layers"]


def test_import_is_cached(result):
    assert not result["rewritten"]
    assert result["cached_s"] < result["import_s"] or result["import_s"] < 1.0  # second call: no conversion


def test_policy_quantizes_nemo_and_hf_alike(result):
    # NeMo fuses q/k/v and gate/up: fewer modules, same formats per group
    assert set(result["nemo_table"]) == set(result["hf_table"]) == {"attention:fp8/fp8", "mlp:nvfp4/nvfp4"}
    assert result["layer0_fc1_changed"] > 0  # the quantizer does change the weights...
    assert result["layer0_fc1_max_diff"] == 0.0 and result["layer0_fc2_max_diff"] == 0.0  # ...identically
    # every quantizer of every layer calibrated to the same amax, up to fp32 op-order noise that the quantized
    # layers amplify with depth (measured: below 1e-5 on an AMD EPYC, 1.7e-4 on an Intel Xeon; a calibration that
    # differs in kind is off by percents), and layer 0, whose inputs are the same in both, quantizes its
    # activations to the same values, but for an FP8 rounding of a small element that the norms' op order can flip
    # (measured: 0 on AMD, 1.7e-4 on Intel)
    assert result["amax_compared"] == 30 * 4 * 2 and result["amax_max_rel_diff"] < 1e-3
    assert result["layer0_quantized_input_max_diff"] < 1e-3
    loss = result["loss"]
    cost = loss["hf_quant"] - loss["hf"]
    assert cost > 0.05  # FP4 costs this model something measurable
    # Beyond layer 0 the two models are two noise realisations of one quantized model: their fp32 activations differ
    # by ~1e-6 from layer 1 on (different op order in fused vs separate GEMMs), which flips FP8 / FP4 roundings by
    # layer 2 and grows from there (measured: layer 2's down_proj input 0.02 apart, layer 29's 28). The
    # quantized losses then differ by up to a quarter of the FP4 cost (0.118 of 0.433 measured on one machine,
    # under 0.1 of it on another), so the end-to-end check only asks for the same damage, not the same logits.
    assert abs(loss["nemo_quant"] - loss["hf_quant"]) < 0.5 * cost
