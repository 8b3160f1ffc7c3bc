"""A real megatron-core GPTModel, NVFP4 QAT on the CPU (nemo env: modelopt 0.37's megatron plugin)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.nemo


@pytest.fixture(scope="module")
def cpu_mode():
    pytest.importorskip("megatron.core")
    from nemo_fp4qat.nemo import megatron_cpu_mode

    from megatron_utils import init_single_process_parallel

    init_single_process_parallel()
    with megatron_cpu_mode() as active:
        assert active
        yield


def test_megatron_gpt_nvfp4_qat_trains_on_cpu(cpu_mode):
    from nemo_fp4qat import QATController

    from megatron_utils import gpt_inputs, tiny_gpt
    from tiny_models import PatternTokens

    model = tiny_gpt()
    ctl = QATController(policy="fp_embeddings", schedule="direct", calibration=16, forward_fn=lambda m, b: m(*b))
    table = ctl.prepare(model)
    assign = table.assignment()
    assert assign["decoder.layers.0.mlp.linear_fc1"][0].name == "nvfp4"
    assert assign["output_layer"][0].is_full_precision
    assert type(model.decoder.layers[0].mlp.linear_fc1).__name__.startswith("Quant")

    data = PatternTokens(64, 24).data
    ctl.calibrate(model, [gpt_inputs(data[:16, :-1])])
    fc1 = model.decoder.layers[0].mlp.linear_fc1
    assert fc1.weight_quantizer.is_enabled and float(fc1.input_quantizer.amax) > 0

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(12):
        batch = data[(step * 8) % 64 : (step * 8) % 64 + 8]
        ctl.step(model, step)
        logits = model(*gpt_inputs(batch[:, :-1]))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        opt.step()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses


def test_the_gpu_runs_megatron_section_rehearses_on_the_cpu(tmp_path):
    """``benchmarks/gpu_check.py --only megatron`` (what the GPU acceptance run adds for megatron-core): QAD of a
    megatron-core GPT through modelopt's megatron plugin, its step timed against BF16, its TensorRT-LLM export
    validated code for code; rendered by ``render_gpu.py``."""
    pytest.importorskip("megatron.core")
    import json
    import subprocess
    import sys

    from paths import ROOT, worker_env

    run = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--only", "megatron", "--out",
           str(tmp_path)]  # fmt: skip
    proc = subprocess.run(run, capture_output=True, text=True, timeout=600, env=worker_env(PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    mg = json.loads((tmp_path / "gpu_check.json").read_text())["megatron"]
    assert mg["export"]["ok"] and mg["export"]["numeric"]["fp4_codes_different"] == 0
    assert mg["export"]["numeric"]["fp4_codes_compared"] > 0 and mg["qad_step_ms"] > 0 and mg["bf16_step_ms"] > 0
    assert 0 < mg["qad_losses"][-1] < 1  # the KL to the frozen copy: small, not zero (the student is quantized)
    render = [sys.executable, str(ROOT / "benchmarks" / "render_gpu.py"), "--src", str(tmp_path / "gpu_check.json"),
              "--dst", str(tmp_path / "gpu_check.md")]  # fmt: skip
    assert subprocess.run(render, capture_output=True, text=True, timeout=120).returncode == 0
    assert "### megatron-core QAD" in (tmp_path / "gpu_check.md").read_text()
