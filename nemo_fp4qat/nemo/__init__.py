"""NeMo 2 / megatron-core integration (optional: needs the ``nemo`` extra)."""

from __future__ import annotations

from .callback import NeMoFP4QATCallback, megatron_module, nemo_gpt_forward
from .cpu_mode import cpu_mode_active, megatron_cpu_mode
from .cpu_task import on_cpu
from .hf_import import import_hf_model, load_nemo_model, megatron_logits, smollm2_nemo_checkpoint
from .recipes import with_fp4_qat

__all__ = [
    "NeMoFP4QATCallback",
    "QATAutoResume",
    "cpu_mode_active",
    "import_hf_model",
    "load_nemo_model",
    "megatron_cpu_mode",
    "megatron_logits",
    "megatron_module",
    "nemo_gpt_forward",
    "on_cpu",
    "smollm2_nemo_checkpoint",
    "with_fp4_qat",
]


def __getattr__(name: str):
    # QATAutoResume subclasses NeMo's AutoResume: imported on first use, so this package loads without NeMo
    if name == "QATAutoResume":
        from .resume import QATAutoResume

        return QATAutoResume
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
