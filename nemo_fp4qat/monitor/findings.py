"""What counts as a problem: named thresholds, the findings they produce, and what to do about each.

Pure rules over one layer's metrics (:func:`check_layer`), so they are tested without a trainer; the
Lightning callback decides what a finding triggers (warn, stop, roll back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..specs import from_fields

__all__ = ["ACTIONS", "SUGGESTIONS", "Finding", "MonitorThresholds", "add_finding", "check_layer"]

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
        min_expert_share: a routed expert that received less than this share of an even split of its MoE layer's
            tokens since the last measurement is a "starved_expert" (none at all: "dead_expert").
    """

    max_weight_rel_err: float = 0.25
    max_input_rel_err: float = 0.35
    min_weight_std: float = 1e-6
    max_saturated_frac: float = 0.01
    max_flushed_frac: float = 0.5
    loss_spike_factor: float = 1.5
    spike_window: int = 5
    min_expert_share: float = 0.1

    @classmethod
    def resolve_spec(cls, spec: MonitorThresholds | dict[str, Any] | None) -> MonitorThresholds:
        """A thresholds object, a dict of its fields or None (the defaults) -> MonitorThresholds."""
        return spec if isinstance(spec, MonitorThresholds) else from_fields(cls, spec or {}, "monitor thresholds")


SUGGESTIONS = {
    "nonfinite": "a NaN/Inf reached this layer: lower the learning rate, check the data, or keep the layer at FP8",
    "high_weight_error": "keep this layer at a higher precision (fp8/mxfp8) in the policy, or recalibrate",
    "high_input_error": "keep this layer's inputs at FP8 (policy 'input: fp8') or recalibrate on more samples",
    "collapsed_weights": "weights have (near) zero variance: check for dead layers or too high weight decay",
    "heavy_saturation": "recalibrate amax (weights grew past the calibrated range) or use a block format",
    "heavy_flush": "most weights round to zero: use a finer block scale (nvfp4) or a higher precision",
    "loss_spike_after_switch": "lower the learning rate around switches, add a ramp (ramp_steps), or stay "
    "longer in the previous stage",
    "dead_expert": "no token reached this expert: it gets no gradient and keeps what calibration gave it; balance the "
    "router (load-balancing loss) or train on more varied data",
    "starved_expert": "this expert gets few tokens, so QAT barely adapts it to its format; balance the router "
    "(load-balancing loss) or keep the layer's experts at a higher precision",
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


def add_finding(findings: list[Finding], step: int, layer: str, problem: str, metric: str, value: float,
                threshold: float, action: str) -> Finding | None:  # fmt: skip
    """Append the finding to ``findings`` and return it; None when the same layer, problem and step is there."""
    if any((g.layer, g.problem, g.step) == (layer, problem, step) for g in findings):
        return None
    f = Finding(step, layer, problem, metric, float(value), float(threshold), SUGGESTIONS[problem], action)
    findings.append(f)
    return f


def check_layer(rec: dict[str, Any], th: MonitorThresholds) -> list[tuple[str, str, float, float]]:
    """``(problem, metric, value, threshold)`` for each threshold one layer's metrics cross.

    Non-finite values and collapsed weights make the other metrics meaningless, so they are
    reported alone.
    """
    if rec.get("weight_nonfinite", 0) or rec.get("input_nonfinite", 0):
        metric = "weight_nonfinite" if rec.get("weight_nonfinite", 0) else "input_nonfinite"
        return [("nonfinite", metric, float(rec[metric]), 0.0)]
    if rec["weight_std"] < th.min_weight_std:
        return [("collapsed_weights", "weight_std", rec["weight_std"], th.min_weight_std)]
    out = []
    for problem, metric, limit in (
        ("high_weight_error", "weight_rel_err", th.max_weight_rel_err),
        ("high_input_error", "input_rel_err", th.max_input_rel_err),
        ("heavy_saturation", "weight_saturated_frac", th.max_saturated_frac),
        ("heavy_flush", "weight_flushed_frac", th.max_flushed_frac),
    ):
        value = rec.get(metric, 0.0)
        if value > limit:
            out.append((problem, metric, float(value), float(limit)))
    return out
