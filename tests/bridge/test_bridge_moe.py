"""Mixture-of-experts QAD with Megatron-Bridge on the CPU: a tiny Hugging Face Qwen3-MoE imported through AutoBridge,
experts in NVFP4 and routers in 16 bits, at expert-parallel size 1 and 2 (gloo). EP 2 trains as EP 1 does, resumes
bit for bit, and its end-of-training export (rank 0 gathers every rank's experts) equals the one-rank export."""

from __future__ import annotations

import pytest
import torch
from bridge_runs import run_bridge_worker
from safetensors.torch import load_file

pytestmark = pytest.mark.bridge


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """The tests' tiny Qwen3-MoE (4 experts, top 2) with a 256-token vocabulary, saved as Hugging Face files."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = tmp_path_factory.mktemp("hf_moe") / "qwen3_moe"
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                         num_experts_per_tok=2, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                         decoder_sparse_step=1, mlp_only_layers=[], head_dim=16)  # fmt: skip
    Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    return out


def _tensors(export) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(export.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_expert_parallel_qad_trains_as_one_rank_and_exports_the_same_checkpoint(tmp_path, hf_moe):
    runs = {}
    for ep in (1, 2):
        runs[ep] = run_bridge_worker(tmp_path, f"ep{ep}", tmp_path / f"ckpt{ep}", nproc=ep, MODEL="moe", EP=ep,
                                     HF_DIR=hf_moe, QAD=1, STEPS=5, SAVE_INTERVAL=100, SWITCH_AT=2, MONITOR=1.0,
                                     EXPORT_DIR=tmp_path / f"export{ep}")  # fmt: skip
    one, two = runs[1], runs[2]
    # the same switch at the same step (each rank switches the experts it holds: 16 linears at EP 1, 8 per EP 2 rank)
    assert [(e["step"], e["group"], e["to"], e["modules"]) for e in one["history"]] == [(2, "experts", "nvfp4", 16)]
    assert [(e["step"], e["group"], e["to"], e["modules"]) for e in two["history"]] == [(2, "experts", "nvfp4", 8)]
    assert sorted(one["losses"]) == sorted(two["losses"]) == [str(s) for s in range(1, 6)]
    for step, loss in one["losses"].items():
        assert two["losses"][step] == pytest.approx(loss, abs=1e-5), step
    # every expert calibrated, one input amax per projection across all four (both EP ranks)
    ep2_amax = {**two["ranks"][0]["expert_input_amax"], **two["ranks"][1]["expert_input_amax"]}
    assert ep2_amax.keys() == one["expert_input_amax"].keys() and len(ep2_amax) == 2 * 4
    for name, value in one["expert_input_amax"].items():
        assert ep2_amax[name] == pytest.approx(value, rel=1e-6), name
    # the monitor's tokens per expert: EP 2's routers, summed over its ranks, routed what EP 1's did, window by window
    # (every window's total exactly; per expert within 2 tokens, for a router score tied to float rounding)
    windows = one["monitor"]["expert_tokens"]
    assert len(windows) == len(two["monitor"]["expert_tokens"]) and len([w for w in windows if w]) >= 3
    for w1, w2 in zip(windows, two["monitor"]["expert_tokens"], strict=True):
        assert (w1 or {}).keys() == (w2 or {}).keys()
        for router in w1 or {}:
            assert sum(w1[router]) == sum(w2[router]), router
            assert max(abs(a - b) for a, b in zip(w1[router], w2[router], strict=True)) <= 2, (w1, w2)
    total = [sum(w["decoder.layers.0.mlp.router"][e] for w in windows if w) for e in range(4)]
    assert all(t > 0 for t in total) and sum(total) % 2 == 0  # top 2: every token reaches two experts
    # the exports: validated code for code against the trained model, every expert NVFP4, routers 16-bit
    for run in (one, two):
        export = run["export"]
        assert export["ok"], export["errors"]
        experts = {m: a for m, a in export["layers"].items() if ".experts." in m}
        assert len(experts) == 2 * 4 * 3 and set(experts.values()) == {"NVFP4"}
        assert export["layers"]["model.layers.0.mlp.gate"] is None
        assert export["numeric"]["fp4_codes_different"] == 0 and export["numeric"]["fp4_codes_compared"] > 0
        assert "layers_skipped" not in export["numeric"], export["numeric"]
    a, b = _tensors(tmp_path / "export1"), _tensors(tmp_path / "export2")
    assert a.keys() == b.keys()
    for key in a:
        if ".experts." in key and not key.endswith("input_scale"):  # the experts' codes and block scales
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(b[key].float(), a[key].float(), rtol=1e-3, atol=1e-4, msg=key)


def test_expert_parallel_qad_resumes_bit_for_bit_with_each_ranks_teacher_and_calibration(tmp_path, hf_moe):
    """Killed at step 3, before the switch at 4 recalibrates: each EP rank resumes its own experts' teacher and its
    own calibration samples (a rank given another's would recalibrate, or distil, differently)."""
    common = dict(MODEL="moe", EP=2, HF_DIR=hf_moe, QAD=1, STEPS=6, SWITCH_AT=4, nproc=2)
    straight = run_bridge_worker(tmp_path, "straight", tmp_path / "straight", SAVE_INTERVAL=100, **common)
    run_bridge_worker(tmp_path, "killed", tmp_path / "ckpt", SAVE_INTERVAL=3, EXIT_AT=3, **common)
    resumed = run_bridge_worker(tmp_path, "resumed", tmp_path / "ckpt", SAVE_INTERVAL=100, **common)
    assert resumed["resumed"] and sorted(resumed["losses"]) == ["4", "5", "6"]
    for step in ("4", "5", "6"):
        assert resumed["losses"][step] == straight["losses"][step], step
    for r in (0, 1):
        assert resumed["ranks"][r]["expert_input_amax"] == straight["ranks"][r]["expert_input_amax"]


def test_expert_parallel_with_pipeline_parallel_trains_as_one_rank_and_exports_the_same_checkpoint(tmp_path, hf_moe):
    """PP 2 x EP 2 on four ranks (data parallel 2): rank 0 gathers each stage's layers and each expert rank's experts
    into the one-rank model, and its export equals the EP 1 export code for code."""
    common = dict(MODEL="moe", HF_DIR=hf_moe, QAD=1, STEPS=5, SAVE_INTERVAL=100, SWITCH_AT=2)
    one = run_bridge_worker(tmp_path, "one", tmp_path / "ckpt1", EXPORT_DIR=tmp_path / "export1", **common)
    four = run_bridge_worker(tmp_path, "ppep", tmp_path / "ckpt4", nproc=4, EP=2, PP=2,
                             EXPORT_DIR=tmp_path / "export4", **common)  # fmt: skip
    last = four["ranks"][3]  # a rank of the last stage, which computes the loss
    assert sorted(last["losses"]) == sorted(one["losses"]) == [str(s) for s in range(1, 6)]
    for step, loss in one["losses"].items():
        assert last["losses"][step] == pytest.approx(loss, abs=1e-6), step
    assert four["export"]["ok"], four["export"]["errors"]
    assert four["export"]["numeric"]["fp4_codes_different"] == 0
    a, b = _tensors(tmp_path / "export1"), _tensors(tmp_path / "export4")
    assert a.keys() == b.keys() and sum(".experts." in k for k in a) == 2 * 4 * 3 * 4  # weight and its 3 scales
    for key in a:
        if ".experts." in key and not key.endswith("input_scale"):  # the experts' codes and block scales
            assert torch.equal(a[key], b[key]), key
        else:  # calibrated on other shapes: amax one float32 ulp apart
            torch.testing.assert_close(b[key].float(), a[key].float(), rtol=1e-3, atol=1e-4, msg=key)
