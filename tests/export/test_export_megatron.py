"""qnemo (TensorRT-LLM checkpoint) export of a real megatron-core GPTModel, TP 1 and 2; NeMo's own
``is_qnemo_checkpoint`` accepts it and every exported code equals the trained one."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_fp4qat import QATController
from nemo_fp4qat.export import ExportConfig, export_checkpoint, validate_export

pytestmark = pytest.mark.nemo


@pytest.fixture(scope="module", params=["gpt", "llama"])
def trained_gpt(request):
    """GPT (plain MLP, one query group per head) and NeMo's Llama layout (gated MLP, grouped queries)."""
    pytest.importorskip("megatron.core")
    from nemo_fp4qat.nemo import megatron_cpu_mode

    from megatron_utils import gpt_inputs, init_single_process_parallel, tiny_gpt

    init_single_process_parallel()
    with megatron_cpu_mode():
        model = tiny_gpt(hidden=128, llama=request.param == "llama")
        ctl = QATController(policy="trtllm_mixed", schedule="direct", calibration=4,
                            forward_fn=lambda m, b: m(*gpt_inputs(b)))  # fmt: skip
        ctl.prepare(model)
        g = torch.Generator().manual_seed(0)
        ctl.calibrate(model, [torch.randint(0, 96, (2, 16), generator=g) for _ in range(4)])
        ctl.step(model, 0)
        yield model


@pytest.mark.parametrize("tp", [1, 2])
def test_qnemo_export_of_megatron_gpt(tmp_path, trained_gpt, tp):
    from megatron_utils import nemo_is_qnemo_checkpoint

    is_qnemo_checkpoint = nemo_is_qnemo_checkpoint()

    out = export_checkpoint(trained_gpt, tmp_path / "qnemo", ExportConfig(kind="trtllm", tensor_parallel=tp))
    assert is_qnemo_checkpoint(str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["mapping"]["tp_size"] == tp and config["quantization"]["quant_algo"] == "MIXED_PRECISION"
    assert all((out / f"rank{r}.safetensors").is_file() for r in range(tp))
    report = validate_export(out, model=trained_gpt)
    assert report.ok, report.format()
    # qkv (per-head-group interleave undone), proj, fc1 (gated: split into fc and gate), fc2 of both layers,
    # merged over the ranks
    gated = trained_gpt.config.gated_linear_unit
    assert config["architecture"] == ("LlamaForCausalLM" if gated else "GPTForCausalLM"), config["architecture"]
    assert report.numeric["layers_compared"] == (10 if gated else 8)
    assert report.numeric["fp4_codes_compared"] > 0 and report.numeric["fp4_codes_different"] == 0
