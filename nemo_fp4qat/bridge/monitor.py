"""``BridgeQuantizationMonitor``: quantization quality during a Megatron-Bridge QAT run.

The same measurements, thresholds and report as the Lightning ``QuantizationMonitor``
(:mod:`nemo_fp4qat.monitor`): every ``every_n_steps`` steps and at every precision switch, per quantized layer,
the weight quantization error and statistics; findings against named thresholds (a non-finite loss too);
scalars under ``quant/<layer>/<metric>`` in Bridge's TensorBoard writer when the run has one; a table at each
switch; ``quant_report.json`` and plots at the end. On a finding it warns, or rolls the layer's group back one
stage (``action="rollback"``, through the :class:`FP4QATBridgeCallback`'s controller).

Under pipeline parallelism each stage measures the layers it holds, under the whole model's layer names; the
findings are exchanged at the end of every step (every rank acts on all of them, a layer group once) and the
report on global rank 0 gathers every stage's layers (:mod:`nemo_fp4qat.monitor.stages`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..monitor.analysis import analyze_model
from ..monitor.experts import ExpertLoad, expert_load_findings
from ..monitor.findings import Finding, MonitorThresholds, add_finding, check_layer
from ..monitor.report import summary_table, write_report
from ..monitor.stages import exchange_findings, merge_stage_records
from ..qat.parallel.groups import data_parallel_group
from ..qat.parallel.pipeline import pipeline_world_size
from ..qat.parallel.stage_names import stage_layer_offset, to_global_name
from ..specs import ConfigError
from .callback import BridgeCallbackBase, FP4QATBridgeCallback, global_rank, unwrap_model_chunk

__all__ = ["BridgeQuantizationMonitor"]

log = logging.getLogger("nemo_fp4qat")
_ACTIONS = ("warn", "rollback")
_LOGGED = ("weight_rel_err", "weight_sqnr_db", "weight_flushed_frac", "weight_saturated_frac", "weight_amax")


class BridgeQuantizationMonitor(BridgeCallbackBase):
    """Quantization-quality monitoring for a Megatron-Bridge run (beside :class:`FP4QATBridgeCallback`).

    Args:
        qat: the run's :class:`FP4QATBridgeCallback` (stage labels, switches, rollbacks).
        every_n_steps: measure every N optimizer steps (and at every precision switch).
        thresholds: :class:`~nemo_fp4qat.monitor.findings.MonitorThresholds` or a dict of its fields.
        action: ``"warn"`` or ``"rollback"`` (the layer's group goes back one stage for the rest of the run).
        out_dir: where ``quant_report.json`` and the plots go (default: ``<checkpoint.save>/quant_report``).

    Raises:
        ConfigError: an unknown action, a bad cadence or an unknown threshold field.

    Example:
        >>> monitor = BridgeQuantizationMonitor(qat, every_n_steps=50, action="rollback")
        >>> pretrain(cfg, qat.forward_step(forward_step), callbacks=[qat, monitor])  # doctest: +SKIP
    """

    def __init__(
        self,
        qat: FP4QATBridgeCallback,
        every_n_steps: int = 50,
        thresholds: MonitorThresholds | dict[str, Any] | None = None,
        action: str = "warn",
        out_dir: str | Path | None = None,
    ) -> None:
        if action not in _ACTIONS:
            raise ConfigError(
                f"BridgeQuantizationMonitor action must be one of {_ACTIONS}, got {action!r} (Bridge's loop has no "
                "callback-side stop; a finding can warn or roll its layer group back)."
            )
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be a positive int, got {every_n_steps!r}")
        self.qat = qat
        self.every_n_steps = every_n_steps
        self.thresholds = MonitorThresholds.resolve_spec(thresholds)
        self.action = action
        self.out_dir = Path(out_dir) if out_dir else None
        self.findings: list[Finding] = []
        self.records: list[dict[str, Any]] = []
        self.report: Path | None = None
        self._pp = 1  # pipeline stages; > 1: names are the whole model's, findings are exchanged every step
        self._offset = 0  # this stage's first transformer layer
        self._pending: list[tuple[dict[str, Any], str | None]] = []
        self.expert_load = ExpertLoad()  # tokens per routed expert since the last measurement (MoE models)

    def _stage_label(self) -> str:
        return "+".join(sorted({w for w, _ in self.qat.controller.current.values()})) or "static"

    def on_train_start(self, context: Any) -> None:
        self._pp = pipeline_world_size()
        module = unwrap_model_chunk(context.model)
        self._offset = stage_layer_offset(module) if self._pp > 1 else 0
        self.expert_load.attach(module, {n: to_global_name(n, self._offset) for n, _ in module.named_modules()})

    def on_train_step_end(self, context: Any) -> None:
        done = int(context.state.train_state.step) + 1  # Bridge advances its counter after this event
        history = self.qat.controller.history
        switched = bool(history) and history[-1]["step"] == done - 1
        loss = (context.loss_dict or {}).get("lm loss")
        if loss is not None and not math.isfinite(float(loss)):
            self._find(done, "<model>", "nonfinite", "loss", float(loss), 0.0)
        if switched or done % self.every_n_steps == 0:
            self._measure(context, done, show=switched)
        self._exchange_findings()

    def on_train_end(self, context: Any) -> None:
        step = int(context.state.train_state.step)
        self._measure(context, step, show=True, final=True)
        self.expert_load.detach()
        self._exchange_findings()
        if self._pp > 1:
            self.records = merge_stage_records(self.records)
        if global_rank() == 0:
            out = self.out_dir or Path(context.state.cfg.checkpoint.save or ".") / "quant_report"
            self.report = write_report(out, self.thresholds, self.action, self.findings, self.records)

    def _measure(self, context: Any, step: int, show: bool, final: bool = False) -> None:
        t0 = time.perf_counter()
        model = unwrap_model_chunk(context.model)
        layers = {to_global_name(n, self._offset): r for n, r in analyze_model(model).items()}
        for name, rec in layers.items():
            for problem, metric, value, threshold in check_layer(rec, self.thresholds):
                self._find(step, name, problem, metric, value, threshold)
        experts = self._expert_tokens()
        for finding in expert_load_findings(experts, self.thresholds.min_expert_share):
            self._find(step, *finding)
        record = {"step": step, "stage": self._stage_label(), "final": final, "seconds": time.perf_counter() - t0,
                  "layers": layers}  # fmt: skip
        if experts:
            record["expert_tokens"] = experts
        self.records.append(record)
        writer = getattr(context.state, "tensorboard_logger", None) if global_rank() == 0 else None
        if writer is not None:
            for name, rec in layers.items():
                for k in _LOGGED:
                    v = rec.get(k)
                    if isinstance(v, (int, float)) and math.isfinite(float(v)):
                        writer.add_scalar(f"quant/{name}/{k}", float(v), step)
        if show and global_rank() == 0:
            log.info("%s", summary_table(layers, f"quantization quality at step {step} ({self._stage_label()})"))

    def _expert_tokens(self) -> dict[str, list[int]]:
        """Tokens each routed expert received since the last measurement, summed over the data-parallel ranks (each
        routes its own tokens; under expert parallelism every rank's router still scores every expert)."""
        counts = self.expert_load.summed(data_parallel_group())
        self.expert_load.reset()
        return counts

    def _find(self, step: int, layer: str, problem: str, metric: str, value: float, threshold: float) -> None:
        f = add_finding(self.findings, step, layer, problem, metric, value, threshold, self.action)
        if f is None:
            return
        if global_rank() == 0 or self._pp > 1:  # under pipeline parallelism the stage holding the layer tells
            log.warning("nemo_fp4qat monitor: %s", f)
        if self._pp > 1:  # acted on by every rank at the end of the step (_exchange_findings)
            local = {to_global_name(n, self._offset): n for n in self.qat.controller.current}
            group = self.qat.controller.group_of(local[layer]) if layer in local else None
            self._pending.append((asdict(f), group))
        elif self.action == "rollback":
            self.qat.controller.roll_back_layer(layer)

    def _exchange_findings(self) -> None:
        """Under pipeline parallelism: every rank learns every stage's findings of this step and rolls each layer
        group found back once, on the stages that hold part of it."""
        if self._pp == 1:
            return
        groups, _ = exchange_findings(self._pending, self.findings, self.action)
        self._pending = []
        if self.action == "rollback":
            for group in groups:
                self.qat.controller.roll_back_group(group)
