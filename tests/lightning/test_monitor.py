"""QuantizationMonitor: metric values against independent computations; planted problems are
detected and acted on; a healthy run reports nothing; reports and plots are written."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn as nn

from nemo_fp4qat import FP4QATCallback, QuantizationMonitor, analyze_model
from nemo_fp4qat.numerics.metrics import quantization_error, weight_statistics

from reference_numerics import mx_ref, nvfp4_ref
from tiny_models import LitLM, MegatronStyleGPT, loader

pytestmark = pytest.mark.twice("the Lightning front end over modelopt 0.37's quantizers and transformers 4.57's models")

mtq = pytest.importorskip("modelopt.torch.quantization")
LAYER = "net.decoder.layers.0.mlp.linear_fc1"


def test_metrics_match_float64_reference():
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(64, 48))
    mtq.quantize(lin, mtq.NVFP4_DEFAULT_CFG, lambda m: m(torch.randn(4, 64)))
    w = lin[0].weight.detach()
    amax = float(lin[0].weight_quantizer.amax)
    rec = analyze_model(lin)["0"]
    q = nvfp4_ref(w.numpy(), amax).astype(np.float64)
    wd = w.numpy().astype(np.float64)
    rel = np.linalg.norm(q - wd) / np.linalg.norm(wd)
    assert rec["weight_rel_err"] == pytest.approx(rel, rel=1e-12)
    assert rec["weight_sqnr_db"] == pytest.approx(20 * np.log10(1 / rel), rel=1e-12)
    assert rec["weight_std"] == pytest.approx(wd.std(), rel=1e-12)
    assert rec["weight_kurtosis"] == pytest.approx(((wd - wd.mean()) ** 4).mean() / wd.var() ** 2, rel=1e-10)
    nz = wd != 0
    assert rec["weight_flushed_frac"] == pytest.approx(((q == 0) & nz).sum() / nz.sum())


def test_metrics_leave_out_nonfinite_elements_as_the_float64_reference_does():
    """The metrics' fast path (a finite float64 sum) must not hide NaN/Inf: they are counted and excluded."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 64, generator=g) * 0.1
    w[3, 7], w[10, 0], w[20, 63] = float("nan"), float("inf"), -float("inf")
    q = torch.from_numpy(nvfp4_ref(w.numpy(), 0.5)).float()
    wd, qd = w.numpy().astype(np.float64), q.numpy().astype(np.float64)
    ok = np.isfinite(wd) & np.isfinite(qd)
    err = quantization_error(w, q)
    rel = np.linalg.norm(qd[ok] - wd[ok]) / np.linalg.norm(wd[ok])
    assert err["rel_err"] == pytest.approx(rel, rel=1e-12)
    st = weight_statistics(w, q)
    f = wd[np.isfinite(wd)]
    assert st["nonfinite"] == 3
    assert st["mean"] == pytest.approx(f.mean(), rel=1e-12) and st["std"] == pytest.approx(f.std(), rel=1e-12)
    assert st["absmax"] == np.abs(f).max()
    assert st["kurtosis"] == pytest.approx(((f - f.mean()) ** 4).mean() / f.var() ** 2, rel=1e-10)
    clean = weight_statistics(w.nan_to_num(0.0, 0.0, 0.0), q.nan_to_num(0.0, 0.0, 0.0))
    assert clean["nonfinite"] == 0 and clean["absmax"] == pytest.approx(np.abs(f).max())


def test_saturation_and_block_underflow_definitions():
    w = torch.tensor([[0.5, -3.0, 0.0, 1e-9] * 8, [0.1] * 32])
    q = torch.from_numpy(mx_ref(w.numpy(), (2, 1), 32)).float()
    st = weight_statistics(w, q, amax=1.0, block=32)
    assert st["saturated_frac"] == pytest.approx(8 / 64)  # |w| > amax
    assert st["flushed_frac"] == pytest.approx(8 / 56)  # the 1e-9 values (zeros excluded)
    assert st["block_underflow_frac"] == 0.0
    st2 = weight_statistics(torch.full((1, 16), 1e-3), torch.zeros(1, 16), block=16)
    assert st2["block_underflow_frac"] == 1.0 and st2["flushed_frac"] == 1.0


class Plant(pl.Callback):
    """Damages one layer right after calibration (runs after FP4QATCallback.on_train_start)."""

    def __init__(self, how):
        self.how = how

    def on_train_start(self, trainer, pl_module):
        w = dict(pl_module.named_modules())[LAYER].weight
        with torch.no_grad():
            if self.how == "outliers":
                w[0, :4] = 1e6  # one huge outlier sets the per-tensor scale: other blocks underflow
                dict(pl_module.named_modules())[LAYER].weight_quantizer.amax = w.abs().amax()
            elif self.how == "zero":
                w.zero_()
                w.requires_grad_(False)  # a dead layer: stays collapsed
            elif self.how == "tiny_amax":  # mis-calibrated per-tensor scale: everything clips
                q = dict(pl_module.named_modules())[LAYER].weight_quantizer
                q.amax = q.amax * 1e-3
            elif self.how == "nan":
                w[3, 5] = float("nan")
            elif self.how == "heavy_tail":  # MXFP4 on a heavy-tailed layer: small weights vanish
                w.copy_(torch.randn_like(w) * torch.exp(3 * torch.randn_like(w)))


def _run(tmp_path, plant=None, action="warn", policy="fp_embeddings", steps=6, sched="direct"):
    lit = LitLM(MegatronStyleGPT(seed=5), lr=1e-4)
    qat = FP4QATCallback(policy=policy, schedule=sched, calibration=16)
    mon = QuantizationMonitor(every_n_steps=2, action=action, out_dir=str(tmp_path))
    cbs = [qat, mon] + ([Plant(plant)] if plant else [])
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)  # fmt: skip
    trainer.fit(lit, loader())
    return mon, qat, trainer


def test_healthy_run_reports_no_findings_and_writes_report(tmp_path):
    mon, _, _ = _run(tmp_path)
    assert mon.findings == []
    report = json.loads((tmp_path / "quant_report.json").read_text())
    assert report["findings"] == [] and len(report["measurements"]) >= 3
    layer = report["measurements"][-1]["layers"][LAYER]
    assert 0 < layer["weight_rel_err"] < 0.25 and "input_rel_err" in report["measurements"][0]["layers"][LAYER]
    assert (tmp_path / "quant_error_by_stage.png").stat().st_size > 1000
    assert (tmp_path / "weight_stats_heatmap.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "plant,problem",
    [
        ("outliers", "heavy_flush"),
        ("zero", "collapsed_weights"),
        ("nan", "nonfinite"),
        ("heavy_tail", "heavy_flush"),
        ("tiny_amax", "high_weight_error"),
    ],
)
def test_planted_problem_is_detected_with_layer_metric_threshold_and_fix(tmp_path, plant, problem):
    policy = {"heavy_tail": {"rules": [], "default": "mxfp4"}, "tiny_amax": {"rules": [], "default": "fp8"}}.get(
        plant, "fp_embeddings"
    )
    mon, _, _ = _run(tmp_path, plant=plant, policy=policy, steps=3)
    hits = [f for f in mon.findings if f.problem == problem and f.layer == LAYER]
    assert hits, [str(f) for f in mon.findings]
    f = hits[0]
    assert f.metric and f.suggestion and f.threshold is not None
    assert any(d["problem"] == problem for d in json.loads((tmp_path / "quant_report.json").read_text())["findings"])
    if plant != "nan":  # the other layers stay clean
        assert {f.layer for f in mon.findings if f.problem == problem} == {LAYER}


def test_stop_action_ends_the_run_cleanly(tmp_path):
    mon, _, trainer = _run(tmp_path, plant="zero", action="stop", steps=10)
    assert mon.findings and trainer.global_step < 10
    assert (tmp_path / "quant_report.json").exists()


def test_rollback_action_moves_the_group_back_one_stage(tmp_path):
    sched = {"stages": [{"start": 0, "format": "fp8"}, {"start": 2, "format": "target"}]}
    mon, qat, _ = _run(tmp_path, plant="zero", action="rollback", steps=6, sched=sched)
    assert mon.findings
    ctl = qat.controller
    group = ctl._targets()[LAYER][2]
    assert ctl.pins[group] == 0
    assert ctl.current[LAYER] == ("fp8", "fp8")  # back from nvfp4 to the previous stage's format


class SpikyLM(LitLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 10 if self.trainer.global_step == 4 else loss


def test_loss_spike_right_after_a_switch_is_detected(tmp_path):
    lit = SpikyLM(MegatronStyleGPT(seed=5), lr=1e-3)
    sched = {"stages": [{"start": 0, "format": "fp8"}, {"start": 4, "format": "target"}]}
    mon = QuantizationMonitor(every_n_steps=100, out_dir=str(tmp_path))
    qat = FP4QATCallback(policy="fp_embeddings", schedule=sched, calibration=16)
    trainer = pl.Trainer(max_steps=7, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[qat, mon])  # fmt: skip
    trainer.fit(lit, loader())
    spikes = [f for f in mon.findings if f.problem == "loss_spike_after_switch"]
    assert spikes and spikes[0].step == 4


def test_bad_monitor_arguments():
    with pytest.raises(ValueError, match="action must be one of"):
        QuantizationMonitor(action="explode")
    with pytest.raises(ValueError, match="every_n_steps"):
        QuantizationMonitor(every_n_steps=0)


class InjectInf(pl.Callback):
    """At one step, one element of LAYER's input becomes +Inf (before its input quantizer sees it)."""

    def __init__(self, step: int, value: float = float("inf"), count: int = 1):
        self.step, self.handle, self.value, self.count = step, None, value, count

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        layer = dict(pl_module.named_modules())[LAYER]
        if trainer.global_step == self.step:

            def inject(module, args):
                x = args[0].clone()
                x.view(-1)[7 : 7 + self.count] = self.value
                return (x, *args[1:])

            self.handle = layer.register_forward_pre_hook(inject)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def test_an_inf_clipped_by_the_fake_quant_is_still_reported_with_layer_and_step(tmp_path):
    """NVFP4 clips the Inf to a finite value (as modelopt's kernels do), so the loss stays finite; the
    monitor still names the layer and the step, on a step where it does not measure (every_n_steps=2)."""
    lit = LitLM(MegatronStyleGPT(seed=5), lr=1e-4)
    qat = FP4QATCallback(policy="fp_embeddings", schedule="direct", calibration=16)
    mon = QuantizationMonitor(every_n_steps=2, out_dir=str(tmp_path))
    trainer = pl.Trainer(max_steps=5, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[qat, mon, InjectInf(step=3)])  # fmt: skip
    trainer.fit(lit, loader())
    assert all(np.isfinite(lit.losses)), "the fake quant did not clip: this test no longer shows the hidden case"
    hits = [f for f in mon.findings if f.problem == "nonfinite"]
    assert [(f.layer, f.step, f.metric, f.value) for f in hits] == [(LAYER, 3, "input_nonfinite", 1.0)]
    off = QuantizationMonitor(every_n_steps=2, out_dir=str(tmp_path / "off"), check_finite_every_step=False)
    lit2 = LitLM(MegatronStyleGPT(seed=5), lr=1e-4)
    pl.Trainer(max_steps=5, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False,
               callbacks=[FP4QATCallback(policy="fp_embeddings", calibration=16), off, InjectInf(step=3)],
               ).fit(lit2, loader())  # fmt: skip
    assert not [f for f in off.findings if f.problem == "nonfinite"], "without the check, step 3 passes unseen"


def test_an_inf_on_the_last_measured_step_is_reported_once(tmp_path):
    """The end-of-training analysis reads weights only; it does not report the last measured step's inputs again
    (as a second finding at another step), and the report still shows them in the final table."""
    lit = LitLM(MegatronStyleGPT(seed=5), lr=1e-4)
    mon = QuantizationMonitor(every_n_steps=2, out_dir=str(tmp_path))
    pl.Trainer(max_steps=5, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[FP4QATCallback(policy="fp_embeddings", calibration=16), mon,
               InjectInf(step=4)]).fit(lit, loader())  # fmt: skip
    hits = [(f.layer, f.step, f.metric) for f in mon.findings if f.problem == "nonfinite"]
    assert hits == [(LAYER, 4, "input_nonfinite")]
    final = mon.records[-1]
    assert final["final"] and final["step"] == 5 and final["layers"][LAYER]["input_nonfinite"] == 1


def test_finite_inputs_whose_sum_overflows_are_not_reported_as_nonfinite(tmp_path):
    """The every-step check reads one sum per input; a sum that overflows on finite values is recounted."""
    lit = LitLM(MegatronStyleGPT(seed=5), lr=1e-4)
    mon = QuantizationMonitor(every_n_steps=100, out_dir=str(tmp_path))
    pl.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[FP4QATCallback(policy="fp_embeddings", calibration=16), mon,
               InjectInf(step=2, value=3e38, count=4)]).fit(lit, loader())  # fmt: skip
    assert not [f for f in mon.findings if f.metric == "input_nonfinite"]
