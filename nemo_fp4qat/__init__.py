"""nemo-fp4qat: FP4 quantization-aware training for NVIDIA NeMo, built on NVIDIA Model Optimizer.

Importing the package installs the fake-quant backend: CPU tensors in modelopt's CUDA-only block formats
(NVFP4, MXFP4/6/8) go to the plugin's C kernels, and NVFP4 on CUDA tensors to an exact Triton kernel that
rounds as modelopt's exporter does (``NEMO_FP4QAT_CPU_BACKEND=0`` disables both).
Optional integrations (NeMo/megatron-core, export, serving) live in subpackages and are imported
only when used.
"""

from __future__ import annotations

from .lightning.callback import FP4QATCallback
from .lightning.mixin import FP4QATMixin
from .lightning.monitor import QuantizationMonitor
from .monitor import Finding, MonitorThresholds, analyze_model
from .numerics.cpu_backend import cpu_backend_installed, install_cpu_backend, uninstall_cpu_backend
from .numerics.formats import FORMATS, QuantFormat, get_format, list_formats
from .qat.calibration import CalibrationConfig
from .qat.config import QATConfig
from .qat.controller import QATController
from .qat.distillation import DistillationConfig
from .qat.policy import POLICY_PRESETS, LayerPolicy, PolicyRule, PolicyTable
from .qat.schedule import SCHEDULE_PRESETS, PrecisionSchedule, Stage

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
    "QATConfig",
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
