"""QAD of a Hugging Face mixture-of-experts model through the Lightning callback: a progressive schedule, a resume,
the end-of-fit export validated code for code, and the refusals an MoE export meets."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file, save_file

from nemo_fp4qat import FP4QATCallback
from nemo_fp4qat.export import ExportConfig, ExportRefused, export_checkpoint, validate_export
from nemo_fp4qat.qat.experts.moe import expert_projections

from tiny_models import LitLM, loader, per_expert_linears, tiny_moe

pytestmark = pytest.mark.twice("the Lightning front end over modelopt 0.37's quantizers and transformers 4.57's models")

SCHED = {"stages": [{"start": 0, "format": "fp8"}, {"start": 4, "format": "target"}]}


def _trainer(callbacks, steps, tmp_path):
    return pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), callbacks=callbacks,
        default_root_dir=tmp_path,
    )  # fmt: skip


def _callback(export_dir=None):
    return FP4QATCallback(policy="default", schedule=SCHED, calibration=16, distillation="qad", export_dir=export_dir,
                          module_getter=lambda lit: lit.net)  # fmt: skip


def _expert_input_amax(model) -> dict[tuple[str, str], set[float]]:
    modules = dict(model.named_modules())
    linears = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear)]
    projections = expert_projections(linears)
    return {k: {float(modules[n].input_quantizer.amax) for n in names} for k, names in projections.items()}


@per_expert_linears
def test_moe_qad_switches_resumes_bit_for_bit_and_exports_validated(tmp_path):
    torch.manual_seed(0)
    full = LitLM(tiny_moe("qwen3", seed=3), lr=1e-3)
    ck = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    cb = _callback(export_dir=str(tmp_path / "export"))
    _trainer([cb, ck], 8, tmp_path).fit(full, loader(n=8, batch_size=8))
    assert [e["group"] for e in cb.controller.history if e["to"] == "nvfp4"] == ["experts"]  # fp8 -> nvfp4 at 4
    tied = _expert_input_amax(full.net)
    assert len(tied) == 6 and all(len(v) == 1 for v in tied.values()), tied
    # the run's export: every expert in NVFP4, codes equal to the trained model's, input scales shared
    report = json.loads((tmp_path / "export" / "validation.json").read_text())
    assert report["ok"] and report["numeric"]["fp4_codes_different"] == 0
    experts = {m: a for m, a in report["layers"].items() if ".experts." in m}
    assert len(experts) == 2 * 4 * 3 and set(experts.values()) == {"NVFP4"}
    assert report["layers"]["model.layers.0.mlp.gate"] is None  # the router, 16-bit

    # resumed from step 3 (before the switch) with a fresh teacher copy from the checkpoint: the same run
    torch.manual_seed(123)
    resumed = LitLM(tiny_moe("qwen3", seed=3), lr=1e-3)
    ckpt = sorted((tmp_path / "ckpt").glob("*step=3.ckpt"))[0]
    # the same configuration (an export at the end: its unquantized weights trained in float16, deploy_dtype="auto")
    again = _callback(export_dir=str(tmp_path / "export_resumed"))
    _trainer([again], 8, tmp_path).fit(resumed, loader(n=8, batch_size=8), ckpt_path=str(ckpt))
    assert resumed.losses == pytest.approx(full.losses[3:], rel=0, abs=0)
    for (n, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), n


@per_expert_linears
def test_untied_expert_input_scales_fail_validation_and_a_trtllm_checkpoint_is_refused(tmp_path):
    model = tiny_moe("mixtral")
    # a run that would end in a TensorRT-LLM checkpoint (asked for, or the default for a module that is not a Hugging
    # Face model) is refused before it trains
    for export in ({"kind": "trtllm"}, None):
        trt = FP4QATCallback(policy="default", export_dir=str(tmp_path / "trt"), export=export)
        lit = LitLM(tiny_moe("mixtral"))
        before = {k: v.clone() for k, v in lit.state_dict().items()}
        with pytest.raises(ExportRefused, match=r"mixture-of-experts model .*unified HF checkpoint \(kind='hf'\)"):
            _trainer([trt], 2, tmp_path).fit(lit, loader(n=16, batch_size=8))
        assert all(torch.equal(v, lit.state_dict()[k]) for k, v in before.items() if "quantizer" not in k)
    cb = FP4QATCallback(policy="default", schedule="direct", calibration=16)
    _trainer([cb], 2, tmp_path).fit(LitLM(model), loader(n=16, batch_size=8))
    with pytest.raises(ExportRefused, match=r"mixture-of-experts model .*Export a unified HF checkpoint \(kind='hf'\)"):
        export_checkpoint(model, tmp_path / "trt", ExportConfig(kind="trtllm"))
    assert not (tmp_path / "trt").exists()
    out = export_checkpoint(model, tmp_path / "hf", ExportConfig(kind="hf"))
    assert validate_export(out, model=model).ok
    # one expert's input scale moved: the engines' fused MoE GEMM could not run what was trained
    shard = next(out.glob("*.safetensors"))
    tensors = load_file(shard)
    key = "model.layers.1.block_sparse_moe.experts.2.w2.input_scale"
    tensors[key] = tensors[key] * 1.5
    save_file(tensors, shard, metadata={"format": "pt"})
    report = validate_export(out, model=model, require_manifest=False)
    assert not report.ok
    problems = {p.tensor: p.message for p in report.errors}
    assert "model.layers.1.block_sparse_moe.experts.*.w2.input_scale" in problems, problems
    assert "one input scale" in problems["model.layers.1.block_sparse_moe.experts.*.w2.input_scale"]
