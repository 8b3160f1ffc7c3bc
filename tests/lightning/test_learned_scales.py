"""Learned NVFP4 block scales (modelopt's LSQ) through the Lightning callback: the amax parameters train in their own
optimizer group, QAD with them exports a unified HF checkpoint that holds what was trained, and a killed run resumes
bit for bit (weights, learned amax and their optimizer state)."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from nemo_fp4qat import FP4QATCallback
from nemo_fp4qat.export import export_checkpoint
from nemo_fp4qat.qat.calibration.scale_levers import learned_scale_parameters
from nemo_fp4qat.qat.modelopt_compat import uses_list_config

from tiny_models import LitLM, loader, tiny_llama

pytestmark = [
    pytest.mark.twice("the Lightning front end over modelopt 0.37's quantizers and transformers 4.57's models"),
    pytest.mark.skipif(not uses_list_config(), reason="LSQ needs modelopt >= 0.46"),
]


def _trainer(callbacks, steps, tmp_path=None):
    return pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks,
                      enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))  # fmt: skip


def _callback(mode: str | None, weight_scale: str = "mse", lr: float = 1e-3) -> FP4QATCallback:
    return FP4QATCallback(policy="fp_embeddings", calibration={"num_samples": 16, "weight_scale": weight_scale},
                          distillation="qad", learned_scales=mode and {"mode": mode, "lr": lr})  # fmt: skip


@pytest.mark.parametrize("mode", ["post", "dual", "scale_only"])
def test_learned_scales_train_and_export_as_trained(tmp_path, mode):
    torch.manual_seed(0)
    model = tiny_llama(hidden=64)
    lit = LitLM(model)
    weights_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = _trainer([_callback(mode)], 4)
    trainer.fit(lit, loader(n=32))
    q = model.model.layers[0].mlp.up_proj.weight_quantizer
    assert q._lsq and sorted(q._learnable_amax) == (["post", "pre"] if mode == "dual" else ["post"])
    groups = trainer.optimizers[0].param_groups
    learned = learned_scale_parameters(model)
    assert len(groups) == 2 and groups[1]["lr"] == 1e-3 and groups[1]["weight_decay"] == 0.0
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in learned}
    assert len(learned) == 14 * (2 if mode == "dual" else 1)  # every NVFP4 linear of the two layers
    assert not torch.equal(q._amax_post, q._amax_pre), "the learned dequantization amax moved"
    moved = [n for n, p in model.named_parameters() if n in weights_before and not torch.equal(p, weights_before[n])]
    if mode == "scale_only":
        assert moved == [], "scale_only trains the block scales alone"
    else:
        assert "model.layers.0.mlp.up_proj.weight" in moved
    x = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        trained = model(x).logits
    out = export_checkpoint(model, tmp_path / "hf", {"kind": "hf"})
    report = json.loads((out / "validation.json").read_text())
    assert report["ok"] and report["numeric"]["layers_compared"] == 14
    assert report["numeric"]["fp4_codes_compared"] > 0 and report["numeric"]["fp4_codes_different"] == 0
    assert not q._lsq  # folded into a plain static quantizer with the same forward
    with torch.no_grad():
        assert torch.equal(model(x).logits, trained)


def test_learned_scales_driven_below_the_smallest_scale_still_export_as_trained(tmp_path):
    """At a large amax learning rate some learned amax go negative (LSQ clamps the scale to E4M3's smallest) and
    others land next to an E4M3 boundary: the fold stores the scale as quantized, so the export holds the codes
    and scales that trained."""
    torch.manual_seed(0)
    model = tiny_llama(hidden=64)
    cb = FP4QATCallback(policy="fp_embeddings", calibration={"num_samples": 16, "smoothing": {"sites": ["mlp_in"]}},
                        distillation="qad", learned_scales={"mode": "post", "lr": 3e-2})  # fmt: skip
    _trainer([cb], 10).fit(LitLM(model), loader(n=64))
    assert min(float(p.min()) for p in learned_scale_parameters(model)) < 0
    out = export_checkpoint(model, tmp_path / "hf", {"kind": "hf"})
    numeric = json.loads((out / "validation.json").read_text())["numeric"]
    assert numeric["fp4_codes_different"] == 0 and numeric["layers_compared"] == 14


def test_trtllm_checkpoint_of_calibrated_attention_scales_is_refused(tmp_path):
    from nemo_fp4qat.export import ExportRefused

    model = tiny_llama(hidden=64)
    _trainer([_callback("post", "max")], 1).fit(LitLM(model), loader(n=16))
    with pytest.raises(ExportRefused, match="kind='hf'"):
        export_checkpoint(model, tmp_path / "trt", {"kind": "trtllm"})
    assert not (tmp_path / "trt").exists()


@pytest.mark.parametrize(("mode", "weight_scale"), [("dual", "mse"), (None, "four_over_six")])
def test_resume_with_learned_or_static_scales_is_exact(tmp_path, mode, weight_scale):
    """A run killed at step 4 and resumed equals the uninterrupted run: losses, weights, static and learned amax,
    and the amax parameters' optimizer state (one batch per epoch, as in test_qat_callback's resume tests)."""
    torch.manual_seed(0)
    full = LitLM(tiny_llama(seed=1, hidden=64))
    ck = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    t_full = _trainer([_callback(mode, weight_scale), ck], 8, tmp_path)
    t_full.fit(full, loader(n=8, batch_size=8))
    ckpt = sorted((tmp_path / "ckpt").glob("*step=4.ckpt"))[0]
    torch.manual_seed(123)
    resumed = LitLM(tiny_llama(seed=1, hidden=64))
    t_res = _trainer([_callback(mode, weight_scale)], 8, tmp_path)
    t_res.fit(resumed, loader(n=8, batch_size=8), ckpt_path=str(ckpt))
    assert resumed.losses == pytest.approx(full.losses[4:], rel=0, abs=0)
    a, b = full.state_dict(), resumed.state_dict()
    assert set(a) == set(b) and any(k.endswith("_amax_post" if mode else "_global_amax") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    q = resumed.net.model.layers[0].mlp.up_proj.weight_quantizer
    assert type(q).__name__ == "StaticBlockScaleQuantizer" and q.block_sizes.get("four_over_six", False) == (
        weight_scale == "four_over_six")  # fmt: skip
    opt_a, opt_b = t_full.optimizers[0], t_res.optimizers[0]
    assert len(opt_b.param_groups) == (2 if mode else 1)
    for ga, gb in zip(opt_a.param_groups, opt_b.param_groups, strict=True):
        for pa, pb in zip(ga["params"], gb["params"], strict=True):
            assert torch.equal(opt_a.state[pa]["exp_avg"], opt_b.state[pb]["exp_avg"])
