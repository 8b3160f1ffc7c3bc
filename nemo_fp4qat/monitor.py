"""``QuantizationMonitor``: watches quantization quality during QAT (or once after PTQ).

Every ``every_n_steps`` steps and at every precision-stage switch it measures, per quantized layer,
the weight quantization error and statistics (:mod:`nemo_fp4qat.quality_metrics`), the input
quantization error on the current batch (through forward hooks on modelopt's input quantizers),
amax drift since calibration, and non-finite gradients; it logs them to the trainer's loggers under
stable names (``quant/<layer>/<metric>``), checks them against named thresholds, and acts on findings
per policy: warn, stop the run cleanly, or roll the affected layer group back one stage.
At each switch and at the end it prints a table, and it writes ``quant_report.json`` and PNG plots
next to the run's logs.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from .quality_metrics import quantization_error, weight_statistics

__all__ = ["ACTIONS", "SUGGESTIONS", "Finding", "MonitorThresholds", "QuantizationMonitor", "analyze_model"]

log = logging.getLogger("nemo_fp4qat")
ACTIONS = ("warn", "stop", "rollback")


@dataclass
class MonitorThresholds:
    """Named thresholds; each finding cites the one it crossed.

    Attributes:
        max_weight_rel_err: weight ||Q(w)-w||/||w|| above this is "high_weight_error"
            (NVFP4 on Gaussian weights is ~0.10; MXFP4 ~0.12).
        max_input_rel_err: same for inputs on the current batch ("high_input_error").
        min_weight_std: weights with a smaller standard deviation have "collapsed".
        max_saturated_frac: share of weights beyond the static amax ("heavy_saturation").
        max_flushed_frac: share of non-zero weights quantized to zero ("heavy_flush").
        loss_spike_factor: loss above this times its running mean within ``spike_window`` steps
            after a switch is a "loss_spike_after_switch".
    """

    max_weight_rel_err: float = 0.25
    max_input_rel_err: float = 0.35
    min_weight_std: float = 1e-6
    max_saturated_frac: float = 0.01
    max_flushed_frac: float = 0.5
    loss_spike_factor: float = 1.5
    spike_window: int = 5


SUGGESTIONS = {
    "nonfinite": "a NaN/Inf reached this layer: lower the learning rate, check the data, or keep the layer at FP8",
    "high_weight_error": "keep this layer at a higher precision (fp8/mxfp8) in the policy, or recalibrate",
    "high_input_error": "keep this layer's inputs at FP8 (policy 'input: fp8') or recalibrate on more samples",
    "collapsed_weights": "weights have (near) zero variance: check for dead layers or too high weight decay",
    "heavy_saturation": "recalibrate amax (weights grew past the calibrated range) or use a block format",
    "heavy_flush": "most weights round to zero: use a finer block scale (nvfp4) or a higher precision",
    "loss_spike_after_switch": "lower the learning rate around switches, add a ramp (ramp_steps), or stay "
    "longer in the previous stage",
}


@dataclass
class Finding:
    step: int
    layer: str
    problem: str
    metric: str
    value: float
    threshold: float
    suggestion: str
    action: str = "warn"

    def __str__(self) -> str:
        return (
            f"step {self.step}: {self.problem} in {self.layer}: {self.metric}={self.value:.4g} "
            f"(threshold {self.threshold:.4g}) -> {self.suggestion} [{self.action}]"
        )


def _quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    out = {}
    for name, m in model.named_modules():
        wq = getattr(m, "weight_quantizer", None)
        iq = getattr(m, "input_quantizer", None)
        if (wq is not None and wq.is_enabled) or (iq is not None and iq.is_enabled):
            out[name] = m
    return out


def _amax(q: Any) -> float | None:
    a = getattr(q, "_amax", None)
    if isinstance(a, torch.Tensor) and a.numel() == 1:
        return float(a)
    return None


def _block(q: Any) -> int | None:
    bs = getattr(q, "block_sizes", None) or {}
    return bs.get(-1)


def analyze_model(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Weight metrics for every enabled weight quantizer of ``model`` (usable alone after PTQ)."""
    out: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for name, m in _quantized_layers(model).items():
            wq = getattr(m, "weight_quantizer", None)
            if wq is None or not wq.is_enabled or not isinstance(getattr(m, "weight", None), torch.Tensor):
                continue
            w = m.weight
            qw = wq(w)
            rec = {f"weight_{k}": v for k, v in quantization_error(w, qw).items()}
            # saturation only where a static per-tensor amax enters the numerics (not MX formats)
            static_amax = None if getattr(wq, "is_mx_format", False) else _amax(wq)
            rec.update({f"weight_{k}": v for k, v in weight_statistics(w, qw, static_amax, _block(wq)).items()})
            rec["weight_amax"] = _amax(wq)
            rec["input_amax"] = _amax(getattr(m, "input_quantizer", None))
            out[name] = rec
    return out


class QuantizationMonitor(pl.Callback):
    """Quantization-quality monitoring and automatic problem detection.

    Args:
        every_n_steps: measure every N optimizer steps (and at every stage switch).
        thresholds: :class:`MonitorThresholds` or a dict of its fields.
        action: what a finding triggers: ``"warn"``, ``"stop"`` (``trainer.should_stop``) or
            ``"rollback"`` (the layer's group goes back to its previous format, needs FP4QATCallback).
        out_dir: where ``quant_report.json`` and the plots go (default: the trainer's log dir).
        module_getter: the module holding the quantizers (default: the LightningModule).
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        thresholds: MonitorThresholds | dict[str, Any] | None = None,
        action: str = "warn",
        out_dir: str | None = None,
        module_getter: Any = None,
    ) -> None:
        super().__init__()
        if action not in ACTIONS:
            raise ValueError(f"QuantizationMonitor action must be one of {ACTIONS}, got {action!r}")
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive int, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.thresholds = (
            thresholds if isinstance(thresholds, MonitorThresholds) else MonitorThresholds(**(thresholds or {}))
        )
        self.action = action
        self.out_dir = out_dir
        self.module_getter = module_getter
        self.findings: list[Finding] = []
        self.records: list[dict[str, Any]] = []  # one per measurement: step, stage label, per-layer metrics
        self._calib_amax: dict[str, dict[str, float | None]] = {}
        self._input_errs: dict[str, dict[str, float]] = {}
        self._hooks: list[Any] = []
        self._loss_mean: float | None = None
        self._last_switch: int | None = None
        self._n_switches = 0
        self._measure_now = False

    # --- helpers ------------------------------------------------------------------------------
    def _module(self, pl_module: pl.LightningModule) -> nn.Module:
        return self.module_getter(pl_module) if self.module_getter else pl_module

    def _qat(self, trainer: pl.Trainer) -> Any:
        from .callback import FP4QATCallback

        return next((c for c in trainer.callbacks if isinstance(c, FP4QATCallback)), None)

    def _stage_label(self, trainer: pl.Trainer) -> str:
        qat = self._qat(trainer)
        if qat is None:
            return "static"
        fmts = sorted({w for w, _ in qat.controller.current.values()})
        return "+".join(fmts)

    def _install_input_hooks(self, module: nn.Module) -> None:
        self._remove_hooks()
        for name, m in _quantized_layers(module).items():
            iq = getattr(m, "input_quantizer", None)
            if iq is None or not iq.is_enabled:
                continue

            def hook(q, args, output, _name=name):
                x = args[0]
                if isinstance(x, torch.Tensor):
                    rec = quantization_error(x, output)
                    rec["nonfinite"] = int((~torch.isfinite(x.detach())).sum())
                    self._input_errs[_name] = rec

            self._hooks.append(iq.register_forward_hook(hook))

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # --- Lightning hooks ----------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._snapshot_amax(self._module(pl_module))

    def _snapshot_amax(self, module: nn.Module) -> None:
        for name, m in _quantized_layers(module).items():
            self._calib_amax[name] = {
                "weight": _amax(getattr(m, "weight_quantizer", None)),
                "input": _amax(getattr(m, "input_quantizer", None)),
            }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        qat = self._qat(trainer)
        switched = bool(qat and qat.controller.history and qat.controller.history[-1]["step"] == trainer.global_step)
        if switched and len(qat.controller.history) != self._n_switches:
            self._n_switches = len(qat.controller.history)
            self._last_switch = trainer.global_step
            self._snapshot_amax(self._module(pl_module))  # amax was recalibrated at the switch
        self._measure_now = switched or trainer.global_step % self.every_n_steps == 0
        if self._measure_now:
            self._input_errs = {}
            self._install_input_hooks(self._module(pl_module))

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._measure_now:
            return
        self._remove_hooks()
        step = trainer.global_step
        for name, m in _quantized_layers(self._module(pl_module)).items():
            for pname, p in m.named_parameters(recurse=False):
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    self._find(trainer, step, name, "nonfinite", f"grad_{pname}_nonfinite", 1.0, 0.0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        step = trainer.global_step - 1  # the step that just ran
        if isinstance(loss, torch.Tensor):
            lv = float(loss.detach())
            th = self.thresholds
            if not math.isfinite(lv):
                self._find(trainer, step, "<model>", "nonfinite", "loss", lv, 0.0)
            elif self._loss_mean is not None:
                recent = self._last_switch is not None and 0 <= step - self._last_switch < th.spike_window
                if recent and lv > th.loss_spike_factor * self._loss_mean:
                    self._find(trainer, step, "<model>", "loss_spike_after_switch", "loss/mean", lv / self._loss_mean,
                               th.loss_spike_factor)  # fmt: skip
            if math.isfinite(lv):
                self._loss_mean = lv if self._loss_mean is None else 0.9 * self._loss_mean + 0.1 * lv
        if self._measure_now:
            self._measure(trainer, pl_module, step)
            self._measure_now = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()
        self._measure(trainer, pl_module, trainer.global_step, final=True)
        self.write_report(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"findings": [asdict(f) for f in self.findings], "loss_mean": self._loss_mean}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.findings = [Finding(**f) for f in state_dict.get("findings", [])]
        self._loss_mean = state_dict.get("loss_mean")

    # --- measurement and detection ------------------------------------------------------------
    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, final: bool = False) -> None:
        module = self._module(pl_module)
        layers = analyze_model(module)
        th = self.thresholds
        metrics: dict[str, float] = {}
        for name, rec in layers.items():
            if name in self._input_errs:
                rec["input_rel_err"] = self._input_errs[name]["rel_err"]
                rec["input_sqnr_db"] = self._input_errs[name]["sqnr_db"]
                rec["input_nonfinite"] = self._input_errs[name]["nonfinite"]
            base = self._calib_amax.get(name, {})
            for kind in ("weight", "input"):
                a0, a = base.get(kind), rec.get(f"{kind}_amax")
                if a0 and a is not None:
                    rec[f"{kind}_amax_drift"] = a / a0 - 1.0
            for k, v in rec.items():
                if isinstance(v, (int, float)) and v is not None and math.isfinite(float(v)):
                    metrics[f"quant/{name}/{k}"] = float(v)
            self._check(trainer, step, name, rec, th)
        self.records.append({"step": step, "stage": self._stage_label(trainer), "final": final, "layers": layers})
        if trainer.logger is not None and metrics:
            trainer.logger.log_metrics(metrics, step=step)
        qat = self._qat(trainer)
        if final or (qat and qat.controller.history and qat.controller.history[-1]["step"] == step):
            rank_zero_info(
                self.summary_table(layers, f"quantization quality at step {step} ({self._stage_label(trainer)})")
            )

    def _check(self, trainer, step: int, name: str, rec: dict[str, Any], th: MonitorThresholds) -> None:
        if rec.get("weight_nonfinite", 0) or rec.get("input_nonfinite", 0):
            metric = "weight_nonfinite" if rec.get("weight_nonfinite", 0) else "input_nonfinite"
            self._find(trainer, step, name, "nonfinite", metric, float(rec[metric]), 0.0)
            return
        if rec["weight_std"] < th.min_weight_std:
            self._find(trainer, step, name, "collapsed_weights", "weight_std", rec["weight_std"], th.min_weight_std)
            return
        if rec["weight_rel_err"] > th.max_weight_rel_err:
            self._find(trainer, step, name, "high_weight_error", "weight_rel_err", rec["weight_rel_err"],
                       th.max_weight_rel_err)  # fmt: skip
        if rec.get("input_rel_err", 0.0) > th.max_input_rel_err:
            self._find(trainer, step, name, "high_input_error", "input_rel_err", rec["input_rel_err"],
                       th.max_input_rel_err)  # fmt: skip
        if rec["weight_saturated_frac"] > th.max_saturated_frac:
            self._find(trainer, step, name, "heavy_saturation", "weight_saturated_frac", rec["weight_saturated_frac"],
                       th.max_saturated_frac)  # fmt: skip
        if rec["weight_flushed_frac"] > th.max_flushed_frac:
            self._find(trainer, step, name, "heavy_flush", "weight_flushed_frac", rec["weight_flushed_frac"],
                       th.max_flushed_frac)  # fmt: skip

    def _find(self, trainer, step, layer, problem, metric, value, threshold) -> None:
        f = Finding(step, layer, problem, metric, float(value), float(threshold), SUGGESTIONS[problem], self.action)
        if any((g.layer, g.problem, g.step) == (f.layer, f.problem, f.step) for g in self.findings):
            return
        self.findings.append(f)
        rank_zero_warn(f"nemo_fp4qat monitor: {f}")
        if self.action == "stop":
            trainer.should_stop = True
        elif self.action == "rollback":
            self._rollback(trainer, layer)

    def _rollback(self, trainer: pl.Trainer, layer: str) -> None:
        qat = self._qat(trainer)
        if qat is None:
            rank_zero_warn("nemo_fp4qat monitor: rollback needs FP4QATCallback; only warning.")
            return
        ctl = qat.controller
        targets = ctl._targets() if ctl.table else {}
        group = targets[layer][2] if layer in targets else None
        if group is None:
            return
        ctl.roll_back_group(group)

    # --- output ---------------------------------------------------------------------------------
    @staticmethod
    def summary_table(layers: dict[str, dict[str, Any]], title: str, top: int = 15) -> str:
        """The ``top`` layers with the highest weight error (all layers are in the JSON report)."""
        head = (
            f"{'layer':<48} {'rel_err':>8} {'sqnr_dB':>8} {'in_err':>8} {'std':>9} {'kurt':>7} {'flush':>6} {'sat':>6}"
        )
        worst = sorted(layers.items(), key=lambda kv: -kv[1]["weight_rel_err"])[:top]
        rows = [f"{title}: {min(top, len(layers))} of {len(layers)} layers, highest error first", head, "-" * len(head)]
        for name, r in worst:
            rows.append(
                f"{name[-48:]:<48} {r['weight_rel_err']:8.4f} {r['weight_sqnr_db']:8.2f} "
                f"{r.get('input_rel_err', float('nan')):8.4f} {r['weight_std']:9.3g} {r['weight_kurtosis']:7.2f} "
                f"{r['weight_flushed_frac']:6.3f} {r['weight_saturated_frac']:6.3f}"
            )
        return "\n".join(rows)

    def report_dir(self, trainer: pl.Trainer | None) -> Path:
        if self.out_dir:
            return Path(self.out_dir)
        if trainer is not None and trainer.log_dir:
            return Path(trainer.log_dir)
        return Path(trainer.default_root_dir if trainer is not None else ".")

    def write_report(self, trainer: pl.Trainer | None) -> Path:
        """``quant_report.json`` + ``quant_error_by_stage.png`` + ``weight_stats_heatmap.png``."""
        out = self.report_dir(trainer)
        out.mkdir(parents=True, exist_ok=True)
        report = {
            "thresholds": asdict(self.thresholds),
            "action": self.action,
            "findings": [asdict(f) for f in self.findings],
            "measurements": self.records,
        }
        tmp = out / "quant_report.json.tmp"
        tmp.write_text(json.dumps(report, indent=1, default=float))
        tmp.replace(out / "quant_report.json")
        try:
            self._plots(out)
        except Exception as e:  # plotting must never fail a training run
            log.warning("nemo_fp4qat monitor: plots not written (%s)", e)
        return out / "quant_report.json"

    def _plots(self, out: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np

        if not self.records:
            return
        # last measurement of each stage
        by_stage: dict[str, dict[str, Any]] = {}
        for r in self.records:
            by_stage[r["stage"]] = r["layers"]
        layers = list(self.records[-1]["layers"])
        fig, ax = plt.subplots(figsize=(min(16, max(6, 0.3 * len(layers))), 4.5))
        for stage, recs in by_stage.items():
            ax.plot(range(len(layers)), [recs.get(n, {}).get("weight_rel_err", np.nan) for n in layers], ".-",
                    label=stage, lw=0.8)  # fmt: skip
        every = max(1, math.ceil(len(layers) / 40))  # at most ~40 labels stay readable
        ax.set_xticks(range(0, len(layers), every))
        ax.set_xticklabels([n[-28:] for n in layers[::every]], rotation=90, fontsize=6)
        ax.set_ylabel("weight ||Q(w)-w|| / ||w||")
        ax.set_title("Weight quantization error by layer and stage")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "quant_error_by_stage.png", dpi=120)
        plt.close(fig)
        stats = ["weight_rel_err", "weight_std", "weight_absmax", "weight_kurtosis", "weight_flushed_frac",
                 "weight_saturated_frac"]  # fmt: skip
        last = self.records[-1]["layers"]
        mat = np.array([[float(last[n].get(s) or 0.0) for s in stats] for n in layers])
        span = mat.max(axis=0) - mat.min(axis=0)
        norm = (mat - mat.min(axis=0)) / np.where(span > 0, span, 1.0)
        fig, ax = plt.subplots(figsize=(7, min(14, max(3, 0.3 * len(layers)))))
        im = ax.imshow(norm, aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(stats)))
        ax.set_xticklabels([s.replace("weight_", "") for s in stats], rotation=45, ha="right", fontsize=7)
        ax.set_yticks(range(0, len(layers), every))
        ax.set_yticklabels([n[-32:] for n in layers[::every]], fontsize=6)
        ax.set_title("Weight statistics (column-normalized), final")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(out / "weight_stats_heatmap.png", dpi=120)
        plt.close(fig)
