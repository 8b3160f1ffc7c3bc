"""The independent consumer: an NVFP4 export converted to compressed-tensors nvfp4-pack-quantized and
loaded by transformers + compressed-tensors (no modelopt, no nemo_fp4qat code in the load path) on
the CPU: its weights equal the trained fake-quant weights and its logits match on the weight path."""

from __future__ import annotations

import copy

import pytest
import torch

from nemo_fp4qat.export import ExportConfig, export_checkpoint, to_compressed_tensors

from tiny_models import VOCAB, calibrated_tiny_llama

pytestmark = pytest.mark.twice("modelopt 0.37's exporters write what NeMo's export path deploys")

pytest.importorskip("compressed_tensors")


def test_compressed_tensors_loads_our_nvfp4_export_with_matching_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model = calibrated_tiny_llama("nvfp4", seed=1)
    out = export_checkpoint(model, tmp_path / "export", ExportConfig(kind="hf"))
    ct_dir = to_compressed_tensors(out, tmp_path / "ct", activations=False)
    from transformers.utils.quantization_config import CompressedTensorsConfig

    consumer = AutoModelForCausalLM.from_pretrained(
        ct_dir, quantization_config=CompressedTensorsConfig(run_compressed=False), dtype=torch.float32
    ).eval()
    # the consumer's dequantized weights are the trained fake-quant weights (it decompresses to bf16)
    layer = consumer.model.layers[1].mlp.down_proj
    with torch.no_grad():
        trained = model.model.layers[1].mlp.down_proj
        want = trained.weight_quantizer(trained.weight)
        assert torch.equal(layer.weight, want.to(layer.weight.dtype))
    # compressed-tensors decompresses into bf16: run the consumer's linears in fp32 on those exact
    # weights, and give the reference (our model, weight path only) the same weights
    ref_model = copy.deepcopy(model)
    for name, mod in consumer.named_modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.dtype == torch.bfloat16:
            mod.weight.data = mod.weight.data.float()
            ours = ref_model.get_submodule(name)
            with torch.no_grad():
                ours.weight.copy_(ours.weight_quantizer(ours.weight).to(torch.bfloat16).float())
            ours.weight_quantizer.disable()
            ours.input_quantizer.disable()
    x = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(x).logits.double()
        got = consumer(x).logits.double()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 5e-3, rel


def test_compressed_tensors_w4a4_scheme_loads_with_exact_weights(tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = calibrated_tiny_llama("nvfp4", seed=2)
    out = export_checkpoint(model, tmp_path / "export", ExportConfig(kind="hf"))
    ct_dir = to_compressed_tensors(out, tmp_path / "ct")  # NVFP4 weights and activations declared
    consumer = AutoModelForCausalLM.from_pretrained(
        ct_dir, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.gate_proj"):
        ours = model.get_submodule(name)
        with torch.no_grad():
            want = ours.weight_quantizer(ours.weight)
        got = consumer.get_submodule(name).weight
        assert torch.equal(got, want.to(got.dtype))
