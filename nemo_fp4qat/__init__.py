"""nemo-fp4qat: FP4 quantization-aware training for NVIDIA NeMo, built on NVIDIA Model Optimizer.

Importing the package installs the fake-quant backend: CPU tensors in modelopt's CUDA-only block formats
(NVFP4, MXFP4/6/8) go to the plugin's C kernels, and NVFP4 on CUDA tensors to an exact Triton kernel that
rounds as modelopt's exporter does (``NEMO_FP4QAT_CPU_BACKEND=0`` disables both).
Optional integrations (NeMo/megatron-core, export, serving) live in subpackages and are imported
only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

from .numerics.backend_hook import install_when_modelopt_loads

# The public API, imported on first use: ``import nemo_fp4qat`` loads neither torch nor Lightning nor modelopt.
_EXPORTS = {
    "ConfigError": ".specs",
    "FP4QATCallback": ".lightning.callback",
    "FP4QATMixin": ".lightning.mixin",
    "QuantizationMonitor": ".lightning.monitor_callback",
    "Finding": ".monitor",
    "MonitorThresholds": ".monitor",
    "analyze_model": ".monitor",
    "cpu_backend_installed": ".numerics.cpu_backend",
    "install_cpu_backend": ".numerics.cpu_backend",
    "uninstall_cpu_backend": ".numerics.cpu_backend",
    "FORMATS": ".numerics.formats",
    "QuantFormat": ".numerics.formats",
    "get_format": ".numerics.formats",
    "list_formats": ".numerics.formats",
    "auto_policy": ".qat.policy.auto",
    "CalibrationConfig": ".qat.calibration.calibrate",
    "QATConfig": ".qat.config",
    "QATController": ".qat.controller",
    "DistillationConfig": ".qat.distillation.distiller",
    "GPTQConfig": ".qat.calibration.gptq",
    "POLICY_PRESETS": ".qat.policy.rules",
    "LayerPolicy": ".qat.policy.rules",
    "PolicyRule": ".qat.policy.rules",
    "PolicyTable": ".qat.policy.rules",
    "SCHEDULE_PRESETS": ".qat.schedule",
    "PrecisionSchedule": ".qat.schedule",
    "Stage": ".qat.schedule",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "POLICY_PRESETS",
    "SCHEDULE_PRESETS",
    "CalibrationConfig",
    "ConfigError",
    "DistillationConfig",
    "FP4QATCallback",
    "FP4QATMixin",
    "Finding",
    "GPTQConfig",
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
    "auto_policy",
    "cpu_backend_installed",
    "get_format",
    "install_cpu_backend",
    "list_formats",
    "uninstall_cpu_backend",
]

install_when_modelopt_loads()
