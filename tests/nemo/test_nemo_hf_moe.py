"""A Hugging Face Qwen3-MoE through NeMo 2.7.3 as a NeMo user runs one: imported into NeMo (local layer spec, logits
equal to the Hugging Face model's), QAD under NeMo's trainer with the default policy (attention FP8, routed experts
NVFP4, routers 16-bit), and the end-of-fit unified HF checkpoint in the Hugging Face model's layout, validated code
for code. At expert-parallel size 2, rank 0 gathers every rank's experts and writes the one-rank checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from nemo_tiny import ADAM_LR
from nemo_worker_run import run_worker
from safetensors.torch import load_file

pytestmark = pytest.mark.nemo

_QAD = {"NVFP4_FROM_START": 1, "BLOCK_SEARCH": 0, "POLICY": "default"}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(HF folder, its NeMo import, the EP 1 QAD run, its export): a tiny Qwen3-MoE (4 experts, top 2) with the demo
    model's tokenizer."""
    pytest.importorskip("nemo.collections.llm")
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from nemo_fp4qat.demo.model import smollm2_hf_dir

    root = tmp_path_factory.mktemp("nemo_hf_moe")
    hf_dir = root / "qwen3_moe"
    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir())
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                         num_experts_per_tok=2, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                         decoder_sparse_step=1, mlp_only_layers=[], head_dim=16, norm_topk_prob=True)  # fmt: skip
    Qwen3MoeForCausalLM(cfg).save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    base = root / "nemo"
    logits = run_worker(root, "import", "import", str(base), HF_DIR=hf_dir)
    export = root / "export_ep1"
    one = run_worker(root, "qad_ep1", "qad", str(base), export_dir=export, EP=1, HF_DIR=hf_dir, **_QAD)
    return hf_dir, base, {**one, **logits}, export


def _tensors(export) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(export.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_imported_moe_trains_and_exports_a_validated_mixed_precision_hf_checkpoint(imported):
    _hf_dir, _base, one, export = imported
    # the import: experts, router (top 2 of a softmax, renormalised), q/k norms and head size as the HF model's
    assert one["logits_max_abs_diff"] < 1e-5 * max(1.0, one["logits_max"]), one
    assert all(0 < loss < 1 for loss in one["losses"].values()), one["losses"]  # the KL to the imported teacher
    report = json.loads((export / "validation.json").read_text())
    assert report["ok"], report
    assert report["numeric"]["fp4_codes_different"] == 0 and report["numeric"]["fp4_codes_compared"] > 0
    # the checkpoint declares each layer's trained format (modelopt 0.37's exporter writes one for the whole model)
    declared = json.loads((export / "hf_quant_config.json").read_text())["quantization"]
    assert declared["quant_algo"] == "MIXED_PRECISION"
    layers = declared["quantized_layers"]
    for layer in (0, 1):
        for e in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert layers[f"model.layers.{layer}.mlp.experts.{e}.{proj}"]["quant_algo"] == "NVFP4"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert layers[f"model.layers.{layer}.self_attn.{proj}"]["quant_algo"] == "FP8"
        assert f"model.layers.{layer}.mlp.gate" not in layers
        assert f"model.layers.{layer}.mlp.gate" in declared["exclude_modules"]  # the router stays 16-bit
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 4
    assert config["quantization_config"]["quantized_layers"] == layers
    assert (export / "tokenizer.json").exists()
    assert _tensors(export)["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.uint8  # packed FP4


def test_expert_parallel_2_trains_as_one_rank_and_exports_the_same_checkpoint(imported, tmp_path):
    hf_dir, base, one, export = imported
    # each EP 2 rank calibrates on its half of the samples the one-rank run calibrates on
    r0, r1 = run_worker(tmp_path, "qad_ep2", "qad", str(base), export_dir=tmp_path / "export", devices=2, EP=2,
                        CALIB_SAMPLES=2, HF_DIR=hf_dir, **_QAD)  # fmt: skip
    assert r0["losses"] == r1["losses"]
    for step, loss in one["losses"].items():
        assert r0["losses"][step] == pytest.approx(loss, abs=1e-6), (step, one["losses"], r0["losses"])
    assert json.loads((tmp_path / "export" / "validation.json").read_text())["ok"]
    a, b = _tensors(export), _tensors(tmp_path / "export")
    assert a.keys() == b.keys()
    steps = len(one["losses"])
    for key in a:
        if ".experts." in key:  # every expert's codes and scales, gathered from both ranks
            assert torch.equal(a[key].reshape(-1).view(torch.uint8), b[key].reshape(-1).view(torch.uint8)), key
        else:  # the replicated layers, trained on other shapes: their gradients differ in rounding only, which Adam
            # can turn into whole steps where a gradient is near zero (its update is about lr in size whatever the
            # gradient's); two runs part by at most one step each way per step, and the 16-bit export rounds
            torch.testing.assert_close(a[key].float(), b[key].float(), rtol=2**-10, atol=2 * ADAM_LR * steps)
