"""nemo-fp4qat: FP4 quantization-aware training for NVIDIA NeMo, built on NVIDIA Model Optimizer.

Importing the package installs the CPU fake-quant backend for modelopt's CUDA-only block formats
(NVFP4, MXFP4/6/8); it acts on CPU tensors only (``NEMO_FP4QAT_CPU_BACKEND=0`` disables it).
Optional integrations (NeMo/megatron-core, export, serving) live in subpackages and are imported
only when used.
"""

from __future__ import annotations

from .calibration import CalibrationConfig
from .callback import FP4QATCallback
from .controller import QATController
from .cpu_backend import cpu_backend_installed, install_cpu_backend, uninstall_cpu_backend
from .distillation import DistillationConfig
from .formats import FORMATS, QuantFormat, get_format, list_formats
from .mixin import FP4QATMixin
from .monitor import Finding, MonitorThresholds, QuantizationMonitor, analyze_model
from .policy import POLICY_PRESETS, LayerPolicy, PolicyRule, PolicyTable
from .schedule import SCHEDULE_PRESETS, PrecisionSchedule, Stage

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "POLICY_PRESETS",
    "SCHEDULE_PRESETS",
    "CalibrationConfig",
    "DistillationConfig",
    "FP4QATCallback",
    "FP4QATMixin",
    "Finding",
    "LayerPolicy",
    "MonitorThresholds",
    "PolicyRule",
    "PolicyTable",
    "PrecisionSchedule",
    "QATController",
    "QuantFormat",
    "QuantizationMonitor",
    "Stage",
    "analyze_model",
    "cpu_backend_installed",
    "get_format",
    "install_cpu_backend",
    "list_formats",
    "uninstall_cpu_backend",
]

install_cpu_backend()
