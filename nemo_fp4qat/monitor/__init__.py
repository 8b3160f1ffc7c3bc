"""Quantization quality: per-layer analysis, problem rules and reports (no Lightning; hooks live in
:mod:`nemo_fp4qat.lightning.monitor_callback`)."""

from .analysis import analyze_model
from .findings import ACTIONS, SUGGESTIONS, Finding, MonitorThresholds, check_layer
from .report import summary_table, write_report

__all__ = [
    "ACTIONS",
    "SUGGESTIONS",
    "Finding",
    "MonitorThresholds",
    "analyze_model",
    "check_layer",
    "summary_table",
    "write_report",
]
