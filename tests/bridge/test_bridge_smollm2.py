"""SmolLM2-135M through Megatron-Bridge: imported from its Hugging Face files by ``AutoBridge``, QAD with the
precision schedule in Bridge's ``pretrain`` loop, and a unified HF checkpoint at the end, validated code for code.
"""

from __future__ import annotations

import json

import pytest
from bridge_runs import run_bridge_worker as _run

pytestmark = pytest.mark.bridge


def test_smollm2_qad_through_bridge_exports_a_unified_hf_checkpoint_that_matches_training(tmp_path):
    run = _run(tmp_path, "smollm2", tmp_path / "ckpt", MODEL="smollm2", QAD=1, STEPS=3, SAVE_INTERVAL=100,
               SWITCH_AT=2, EXPORT_DIR=tmp_path / "export")  # fmt: skip
    assert run["formats"]["2"] == ["(4, 3)", False] and run["formats"]["3"] == ["(2, 1)", True]
    assert "calibrated on" in run["log"]
    # QAD from the model as Bridge loaded it: the first step's KL is small where the cross entropy of the random
    # tokens would be ~ln(49152) = 10.8; it cannot be zero (the student is FP8 already)
    assert 0 < run["losses"]["1"] < 0.5, run["losses"]
    export = run["export"]
    assert export["ok"], export["errors"]
    assert export["algo"] == "NVFP4"
    # 30 layers x (q, k, v, o, gate, up, down), split back out of megatron's fused linear_qkv and linear_fc1
    assert sum(a == "NVFP4" for a in export["layers"].values()) == 210
    assert export["layers"]["model.embed_tokens"] is None
    numeric = export["numeric"]
    assert numeric["layers_compared"] == 210 and numeric["fp4_codes_different"] == 0, numeric
    # embeddings and the 61 norms, written as trained
    assert numeric["unquantized_compared"] == 62 and not numeric.get("unquantized_different"), numeric
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30


@pytest.mark.slow_bridge
def test_smollm2_qad_through_bridge_resumes_exactly(tmp_path):
    common = dict(MODEL="smollm2", QAD=1, STEPS=4, SWITCH_AT=2)
    full = _run(tmp_path, "full", tmp_path / "full_ckpt", SAVE_INTERVAL=100, **common)
    ckpt = tmp_path / "ckpt"
    first = _run(tmp_path, "first", ckpt, SAVE_INTERVAL=2, EXIT_AT=2, **common)
    resumed = _run(tmp_path, "resumed", ckpt, SAVE_INTERVAL=100, **common)
    assert sorted(first["losses"]) == ["1", "2"] and sorted(resumed["losses"]) == ["3", "4"]
    assert "QAD teacher (restored from" in resumed["log"]
    for step in ("3", "4"):  # NVFP4 from step 3: the switch, the teacher and the data order all resumed
        assert resumed["losses"][step] == full["losses"][step], (step, resumed["losses"], full["losses"])
        assert resumed["formats"][step] == full["formats"][step] == ["(2, 1)", True]
    for key in ("fc1_weight_amax", "fc1_input_amax", "fc1_weight_sum"):
        assert resumed[key] == full[key], key
