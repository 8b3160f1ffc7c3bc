"""The demo on a real-weights mixture-of-experts model (``nemo-fp4qat demo --moe``): SmolLM2-135M upcycled into a
Mixtral, QAD, the unified HF export validated with every expert in NVFP4, and that export served over HTTP."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest
import torch

# core environment only: the demo's pipeline and serving run in the core environment only


def _expert_weights(layer) -> list[torch.Tensor]:
    """Each expert's first weight: transformers 4's per-expert ``w1``, 5's slice of the fused ``gate_up_proj``."""
    block = getattr(layer, "block_sparse_moe", None) or layer.mlp
    if isinstance(block.experts, torch.nn.ModuleList):
        return [e.w1.weight for e in block.experts]
    return list(block.experts.gate_up_proj)


def test_an_upcycled_smollm2_computes_what_the_dense_model_computes():
    from nemo_fp4qat.demo.model import load_smollm2
    from nemo_fp4qat.demo.upcycle import upcycle_llama_to_mixtral

    dense, tok = load_smollm2()
    ids = tok("It is a truth universally acknowledged, that a single man", return_tensors="pt").input_ids
    moe = upcycle_llama_to_mixtral(dense, num_experts=4, top_k=2)
    with torch.no_grad():
        want, got = dense(ids).logits, moe(ids).logits
    # identical experts, top-2 weights renormalized to one: the dense MLP, up to float32 summation order
    torch.testing.assert_close(got, want, rtol=0, atol=5e-4)
    assert type(moe).__name__ == "MixtralForCausalLM" and len(_expert_weights(moe.model.layers[0])) == 4
    noisy = upcycle_llama_to_mixtral(dense, num_experts=4, top_k=2, noise=0.01)
    w = _expert_weights(noisy.model.layers[3])
    assert not torch.equal(w[0], w[1])  # the experts differ, so the router's choice matters
    with pytest.raises(ValueError, match=r"top_k=5 must lie in \[1, num_experts=4\]"):
        upcycle_llama_to_mixtral(dense, num_experts=4, top_k=5)


@pytest.mark.slow_core  # about 5 minutes on 2 cores: make test-core-all
def test_the_moe_demo_exports_every_expert_in_nvfp4_validated_and_serves_it(tmp_path):
    from nemo_fp4qat.serve import PyTorchBackend, ServeSettings

    from serving import running_server

    out = tmp_path / "demo"
    res = subprocess.run(
        [sys.executable, "-m", "nemo_fp4qat.cli", "demo", "--quick", "--moe", "--steps", "2", "--qad-steps", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert [m.group(1) for m in re.finditer(r"^(\d)/5 ", res.stdout, re.M)] == ["1", "2", "3", "4", "5"]
    assert (
        "upcycled into a Mixtral of 4 experts" in res.stdout and "PTQ of the fine-tune (policy 'default')" in res.stdout
    )
    report = json.loads((out / "report.json").read_text())
    assert report["exports"].keys() == {"hf"} and not (out / "export_trtllm").exists()
    validation = json.loads((out / "export" / "validation.json").read_text())
    assert validation["ok"] and validation["numeric"]["fp4_codes_different"] == 0
    experts = {m: a for m, a in validation["layers"].items() if ".experts." in m}
    assert len(experts) == 30 * 4 * 3 and set(experts.values()) == {"NVFP4"}
    routers = [m for m in validation["layers"] if m.endswith("block_sparse_moe.gate")]
    assert len(routers) == 30 and all(validation["layers"][m] is None for m in routers)
    monitor = json.loads((out / "quant_quality" / "quant_report.json").read_text())
    tokens = [m["expert_tokens"] for m in monitor["measurements"] if "expert_tokens" in m]
    assert tokens and len(tokens[0]) == 30  # every layer's router counted

    backend = PyTorchBackend(out / "export")
    settings = ServeSettings(max_prompt_tokens=64, max_tokens=8, max_batch_size=2, timeout_s=120)
    with running_server(backend, settings) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": ["Emma Woodhouse, handsome"], "max_tokens": 6},
                       timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == backend.generate(["Emma Woodhouse, handsome"], 6)[0].text
