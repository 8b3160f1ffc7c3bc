"""Exported checkpoint size: NVFP4 linear weights vs their BF16 bytes, and the whole model.

SmolLM2-135M (the demo model), quantizers from the plugin's policies, calibrated on 16 windows of
the shipped corpus, exported as unified HF checkpoints in bf16 (the size a deployment ships).
Bytes are read back from the written safetensors files.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from common import RESULTS_DIR, machine

from nemo_fp4qat import QATController
from nemo_fp4qat.demo.model import load_corpus, load_smollm2
from nemo_fp4qat.export import ExportConfig, export_checkpoint, load_export

POLICIES = {
    "all linears NVFP4 (fp_embeddings)": "fp_embeddings",
    "trtllm_mixed (FP8 attention, NVFP4 MLP)": "trtllm_mixed",
}
NOTE = (
    "The NVFP4 linears meet the target exactly (4 bits + one E4M3 scale per 16 weights; per-tensor scales are "
    "negligible). The whole-checkpoint ratio is dominated by the unquantized 28.3 M-parameter embedding (tied with "
    "the output layer): modelopt's HF exporter keeps unquantized tensors in the model's dtype (float32 here, CPU "
    "training) even with dtype=bfloat16, so they count 4 bytes per parameter. Casting the model to BF16 before export "
    "halves them but changes ~0.3% of FP4 codes (packing re-rounds from BF16 weights), which `validate` rejects; "
    "train in the deployment dtype (BF16 on GPUs) instead."
)
QUANT_TENSORS = ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "k_scale", "v_scale")


def measure(policy: str) -> dict[str, float]:
    model, tok = load_smollm2()
    ids = tok(load_corpus("emma")[:60000], return_tensors="pt").input_ids[0]
    batches = [ids[i * 256 : (i + 1) * 256].unsqueeze(0) for i in range(16)]
    ctl = QATController(policy=policy, schedule="direct", calibration=16)
    ctl.prepare(model)
    ctl.calibrate(model, batches)
    ctl.step(model, 0)
    with tempfile.TemporaryDirectory() as d:
        out = export_checkpoint(model, Path(d) / "ckpt", ExportConfig(kind="hf", dtype="bfloat16", validate=False))
        _, qcfg, (tensors,) = load_export(out)
        file_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    mixed = qcfg.get("quantized_layers") or {}
    nvfp4_q = nvfp4_bf16 = 0
    for key, t in tensors.items():
        mod, _, attr = key.rpartition(".")
        algo = mixed.get(mod, {}).get("quant_algo") if mixed else qcfg["quant_algo"]
        if algo != "NVFP4" or f"{mod}.weight_scale_2" not in tensors or attr not in QUANT_TENSORS:
            continue
        nvfp4_q += t.numel() * t.element_size()
        if attr == "weight":
            nvfp4_bf16 += t.shape[0] * t.shape[1] * 2 * 2  # packed: two elements per byte, 2 bytes each in bf16
    bf16_model = sum(p.numel() for p in model.parameters()) * 2
    return {"nvfp4_linear_ratio": nvfp4_q / nvfp4_bf16, "model_ratio": file_bytes / bf16_model,
            "export_mib": file_bytes / 2**20, "bf16_mib": bf16_model / 2**20}  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    rows = {label: measure(p) for label, p in POLICIES.items()}
    lines = ["## Export size (SmolLM2-135M, unified HF checkpoint, bf16 for unquantized tensors)", "",
             f"Machine: {machine()}. Target: NVFP4 linear weights <= 0.2813x their BF16 bytes (4.5 bits/weight).", "",
             "| policy | NVFP4 linears / BF16 | whole checkpoint / BF16 model | export MiB | BF16 MiB |",
             "|---|---|---|---|---|"]  # fmt: skip
    for label, r in rows.items():
        lines.append(f"| {label} | {r['nvfp4_linear_ratio']:.4f}x | {r['model_ratio']:.3f}x | "
                     f"{r['export_mib']:.1f} | {r['bf16_mib']:.1f} |")  # fmt: skip
    lines += ["", NOTE, ""]
    (RESULTS_DIR / "export_size.md").write_text("\n".join(lines))
    (RESULTS_DIR / "export_size.json").write_text(json.dumps(rows, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
