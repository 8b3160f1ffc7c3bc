"""Export of QAT-trained models (unified HF and TensorRT-LLM/qnemo checkpoints), validation,
the plugin's own unpacker, and the compressed-tensors conversion used as an independent consumer.

Imports only torch, safetensors and modelopt; TensorRT-LLM is never imported (its accepted values
are listed in :mod:`.runtime_support`).
"""

from __future__ import annotations

from .atomic import MANIFEST_NAME, atomic_directory
from .compressed_tensors import to_compressed_tensors
from .engine_plan import EnginePlan
from .exporters import EXPORT_KINDS, ExportConfig, ExportValidationError, export_checkpoint
from .runtime_support import ExportRefused, preflight
from .unpack import dequantize_linear
from .validate import ValidationReport, load_export, validate_export

__all__ = [
    "EXPORT_KINDS",
    "MANIFEST_NAME",
    "EnginePlan",
    "ExportConfig",
    "ExportRefused",
    "ExportValidationError",
    "ValidationReport",
    "atomic_directory",
    "dequantize_linear",
    "export_checkpoint",
    "load_export",
    "preflight",
    "to_compressed_tensors",
    "validate_export",
]
