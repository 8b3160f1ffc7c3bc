"""``QuantizationMonitor``: watches quantization quality during QAT (or once after PTQ).

Every ``every_n_steps`` steps and at every precision-stage switch it measures, per quantized layer,
the weight quantization error and statistics (:mod:`nemo_fp4qat.monitor.analysis`), the input
quantization error on the current batch (through forward hooks on modelopt's input quantizers),
amax drift since calibration, and non-finite gradients; it logs them to the trainer's loggers under
stable names (``quant/<layer>/<metric>``), checks them against named thresholds
(:mod:`nemo_fp4qat.monitor.findings`), and acts on findings per policy: warn, stop the run cleanly,
or roll the affected layer group back one stage. At each switch and at the end it prints a table,
and it writes ``quant_report.json`` and PNG plots (:mod:`nemo_fp4qat.monitor.report`) next to the
run's logs.

Under megatron pipeline parallelism each stage measures the layers it holds, under the whole model's layer names;
the findings of every rank are exchanged after each step, so that every rank applies the same actions (a stop on
all stages at once, a rollback of the finding's layer group on every stage that holds part of it); the report on
global rank 0 gathers every stage's layers.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ..monitor.analysis import amax_of, analyze_model, quantized_layers
from ..monitor.experts import ExpertLoad, expert_load_findings
from ..monitor.findings import ACTIONS, Finding, MonitorThresholds, add_finding, check_layer
from ..monitor.report import summary_table, write_report
from ..monitor.stages import exchange_findings, merge_stage_records
from ..numerics.metrics import quantization_error
from ..qat.experts.moe import module_standing_for
from ..qat.parallel.groups import data_parallel_group
from ..qat.parallel.stage_names import stage_layer_offset, to_global_name

__all__ = ["QuantizationMonitor"]


def _pipeline_size() -> int:
    """Megatron's pipeline-parallel size where its parallel state is set up, else 1 (no megatron imported: 1)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return 1
    return int(ps.get_pipeline_model_parallel_world_size())


class QuantizationMonitor(pl.Callback):
    """Quantization-quality monitoring and automatic problem detection (beside :class:`FP4QATCallback`).

    Example:
        >>> pl.Trainer(callbacks=[FP4QATCallback(), QuantizationMonitor(every_n_steps=50, action="rollback")])

    Raises:
        ValueError: an unknown action or cadence (at construction).
        ConfigError: an unknown threshold field (at construction).

    Args:
        every_n_steps: measure every N optimizer steps (and at every stage switch).
        thresholds: :class:`MonitorThresholds` or a dict of its fields.
        action: what a finding triggers: ``"warn"``, ``"stop"`` (``trainer.should_stop``) or
            ``"rollback"`` (the layer's group goes back to its previous format, needs FP4QATCallback).
        out_dir: where ``quant_report.json`` and the plots go (default: the trainer's log dir).
        module_getter: the module holding the quantizers (default: the LightningModule).
        check_finite_every_step: on every step (not only measurement steps), check each quantized
            layer's input for NaN/Inf before it is quantized. The fake quant clips an Inf to the format's
            largest value (as modelopt's kernels do), so nothing downstream would show it; this check
            costs one read of each quantized input per step.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        thresholds: MonitorThresholds | dict[str, Any] | None = None,
        action: str = "warn",
        out_dir: str | None = None,
        module_getter: Any = None,
        check_finite_every_step: bool = True,
    ) -> None:
        super().__init__()
        if action not in ACTIONS:
            raise ValueError(f"QuantizationMonitor action must be one of {ACTIONS}, got {action!r}")
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive int, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.thresholds = MonitorThresholds.resolve_spec(thresholds)
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
        self.check_finite_every_step = check_finite_every_step
        self._finite_hooks: list[Any] = []
        self._nonfinite: dict[str, int] = {}  # layer -> non-finite input elements seen this step
        self._pp = 1  # pipeline stages; > 1: names are the whole model's, findings are exchanged every step
        self._offset = 0  # this stage's first transformer layer
        self._pending: list[tuple[dict[str, Any], str | None]] = []  # this step's findings and their layer groups
        self.expert_load = ExpertLoad()  # tokens per routed expert since the last measurement (MoE models)

    # --- helpers ------------------------------------------------------------------------------
    def _module(self, pl_module: pl.LightningModule) -> nn.Module:
        return self.module_getter(pl_module) if self.module_getter else pl_module

    def _g(self, name: str) -> str:
        """A layer's name in the whole model (a pipeline stage's own names start at its first layer)."""
        return to_global_name(name, self._offset)

    def _local_layers(self, module: nn.Module) -> dict[str, nn.Module]:
        """The quantized layers, by their names in the whole model."""
        return {self._g(n): m for n, m in quantized_layers(module).items()}

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
        for name, m in self._local_layers(module).items():
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
        module = self._module(pl_module)
        self._pp = _pipeline_size()
        self._offset = stage_layer_offset(module) if self._pp > 1 else 0
        self._snapshot_amax(module)
        if self.check_finite_every_step:
            self._install_finite_hooks(module)
        self.expert_load.attach(module, {n: self._g(n) for n, _ in module.named_modules()})

    def _install_finite_hooks(self, module: nn.Module) -> None:
        """A pre-hook on every enabled input quantizer: counts NaN/Inf in what it is about to clip."""
        for h in self._finite_hooks:
            h.remove()
        self._finite_hooks = []
        for name, m in self._local_layers(module).items():
            iq = getattr(m, "input_quantizer", None)
            if iq is None or not iq.is_enabled:
                continue

            def pre_hook(q, args, _name=name):
                x = args[0] if args else None
                # NaN/Inf make the sum non-finite: one reduction per input and step (an elementwise isfinite
                # costs 20x more); only a non-finite sum (or one that overflowed) pays for the exact count
                floating = isinstance(x, torch.Tensor) and x.is_floating_point()
                if floating and not math.isfinite(float(x.detach().sum())):  # detached: no autograd node per step
                    n = int((~torch.isfinite(x)).sum())
                    if n:
                        self._nonfinite[_name] = self._nonfinite.get(_name, 0) + n

            self._finite_hooks.append(iq.register_forward_pre_hook(pre_hook))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.expert_load.detach()
        for h in self._finite_hooks:
            h.remove()
        self._finite_hooks = []
        self._remove_hooks()

    def _snapshot_amax(self, module: nn.Module) -> None:
        for name, m in self._local_layers(module).items():
            self._calib_amax[name] = {
                "weight": amax_of(getattr(m, "weight_quantizer", None)),
                "input": amax_of(getattr(m, "input_quantizer", None)),
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
        for name, m in self._local_layers(self._module(pl_module)).items():
            for pname, p in m.named_parameters(recurse=False):
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    self._find(trainer, step, name, "nonfinite", f"grad_{pname}_nonfinite", 1.0, 0.0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        step = trainer.global_step - 1  # the step that just ran
        if self._nonfinite:
            # the first layers (in forward order) whose inputs carried NaN/Inf into a quantizer this step
            for layer, count in self._nonfinite.items():
                self._find(trainer, step, layer, "nonfinite", "input_nonfinite", float(count), 0.0)
            self._nonfinite = {}
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
        self._exchange_findings(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()
        self._measure(trainer, pl_module, trainer.global_step, final=True)
        self._exchange_findings(trainer)
        if self._pp > 1:
            self._gather_stage_records()
        if trainer.is_global_zero:
            self.write_report(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {"findings": [asdict(f) for f in self.findings], "loss_mean": self._loss_mean}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.findings = [Finding(**f) for f in state_dict.get("findings", [])]
        self._loss_mean = state_dict.get("loss_mean")

    # --- measurement and detection ------------------------------------------------------------
    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, final: bool = False) -> None:
        t0 = time.perf_counter()
        module = self._module(pl_module)
        layers = {self._g(n): rec for n, rec in analyze_model(module).items()}
        th = self.thresholds
        metrics: dict[str, float] = {}
        for name, rec in layers.items():
            e = self._input_errs.get(name, {})
            inputs = {f"input_{k}": e[k] for k in ("rel_err", "sqnr_db", "nonfinite") if k in e}
            rec.update(inputs)
            base = self._calib_amax.get(name, {})
            for kind in ("weight", "input"):
                a0, a = base.get(kind), rec.get(f"{kind}_amax")
                if a0 and a is not None:
                    rec[f"{kind}_amax_drift"] = a / a0 - 1.0
            for k, v in rec.items():
                if isinstance(v, (int, float)) and v is not None and math.isfinite(float(v)):
                    metrics[f"quant/{name}/{k}"] = float(v)
            # the end-of-training analysis runs no forward: the inputs it shows are the last measured step's, whose
            # findings were made at that step
            self._check(trainer, step, name, {k: v for k, v in rec.items() if k not in inputs} if final else rec, th)
        experts = self._check_expert_load(trainer, step, metrics)
        # what a measurement costs (the budget: under 5 s per switch on the demo's SmolLM2)
        seconds = time.perf_counter() - t0
        record = {"step": step, "stage": self._stage_label(trainer), "final": final, "seconds": seconds,
                  "layers": layers}  # fmt: skip
        if experts:
            record["expert_tokens"] = experts
        self.records.append(record)
        if trainer.logger is not None and metrics:
            trainer.logger.log_metrics(metrics, step=step)
        qat = self._qat(trainer)
        if final or (qat and qat.controller.history and qat.controller.history[-1]["step"] == step):
            rank_zero_info(
                self.summary_table(layers, f"quantization quality at step {step} ({self._stage_label(trainer)})")
            )

    def _check_expert_load(self, trainer: pl.Trainer, step: int, metrics: dict[str, float]) -> dict[str, list[int]]:
        """Tokens each routed expert received since the last measurement (per MoE layer, by the router's name), summed
        over the data-parallel ranks (each routes its own tokens; megatron's data-parallel group spans the expert-
        parallel ranks, whose routers score every expert); dead and starved experts become findings under the
        expert's name (``<layer>.experts.<global index>``)."""
        counts = self.expert_load.summed(data_parallel_group())
        self.expert_load.reset()
        for router, per_expert in counts.items():
            for i, tokens in enumerate(per_expert):
                metrics[f"moe/{router}/expert_{i}_tokens"] = float(tokens)
        for finding in expert_load_findings(counts, self.thresholds.min_expert_share):
            self._find(trainer, step, *finding)
        return counts

    def _check(self, trainer, step: int, name: str, rec: dict[str, Any], th: MonitorThresholds) -> None:
        for problem, metric, value, threshold in check_layer(rec, th):
            self._find(trainer, step, name, problem, metric, value, threshold)

    def _find(self, trainer, step, layer, problem, metric, value, threshold) -> None:
        f = add_finding(self.findings, step, layer, problem, metric, value, threshold, self.action)
        if f is None:
            return
        rank_zero_warn(f"nemo_fp4qat monitor: {f}")
        if self._pp > 1:  # acted on by every rank at the end of the step (_exchange_findings)
            self._pending.append((asdict(f), self._group_of(trainer, layer)))
        elif self.action == "stop":
            trainer.should_stop = True
        elif self.action == "rollback":
            self._rollback(trainer, self._group_of(trainer, layer))

    def _group_of(self, trainer: pl.Trainer, layer: str) -> str | None:
        """The layer group (policy rule) a quantized layer belongs to; None without FP4QATCallback or for a
        layer it does not quantize (the loss)."""
        qat = self._qat(trainer)
        if qat is None:
            return None
        local = {self._g(n): n for n in qat.controller.current}
        module = module_standing_for(layer, local)  # an expert's finding names the expert, not its linears
        return qat.controller.group_of(local[module]) if module is not None else None

    def _rollback(self, trainer: pl.Trainer, group: str | None) -> None:
        qat = self._qat(trainer)
        if qat is None:
            rank_zero_warn("nemo_fp4qat monitor: rollback needs FP4QATCallback; only warning.")
            return
        if group is not None:
            qat.controller.roll_back_group(group)

    def _exchange_findings(self, trainer: pl.Trainer) -> None:
        """Under pipeline parallelism: every rank learns every rank's findings of this step and applies the same
        actions once (:func:`~nemo_fp4qat.monitor.stages.exchange_findings`)."""
        if self._pp == 1:
            return
        groups, found = exchange_findings(self._pending, self.findings, self.action)
        self._pending = []
        if found and self.action == "stop":
            trainer.should_stop = True
        if self.action == "rollback":
            for group in groups:
                self._rollback(trainer, group)

    def _gather_stage_records(self) -> None:
        """Every stage's measurements merged into this rank's records (same steps on every stage)."""
        self.records = merge_stage_records(self.records)

    # --- output ---------------------------------------------------------------------------------
    summary_table = staticmethod(summary_table)

    def report_dir(self, trainer: pl.Trainer | None) -> Path:
        if self.out_dir:
            return Path(self.out_dir)
        if trainer is not None and trainer.log_dir:
            return Path(trainer.log_dir)
        return Path(trainer.default_root_dir if trainer is not None else ".")

    def write_report(self, trainer: pl.Trainer | None) -> Path:
        """``quant_report.json`` + ``quant_error_by_stage.png`` + ``weight_stats_heatmap.png``."""
        return write_report(self.report_dir(trainer), self.thresholds, self.action, self.findings, self.records)
