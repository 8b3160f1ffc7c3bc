"""NeMo 2 / megatron-core integration (optional: needs the ``nemo`` extra)."""

from __future__ import annotations

from .callback import NeMoFP4QATCallback, megatron_module, nemo_gpt_forward
from .cpu_mode import cpu_mode_active, megatron_cpu_mode
from .recipes import with_fp4_qat

__all__ = [
    "NeMoFP4QATCallback",
    "cpu_mode_active",
    "megatron_cpu_mode",
    "megatron_module",
    "nemo_gpt_forward",
    "with_fp4_qat",
]
