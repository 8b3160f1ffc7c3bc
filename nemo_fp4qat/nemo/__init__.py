"""NeMo 2 / megatron-core integration (optional: needs the ``nemo`` extra)."""

from __future__ import annotations

from .cpu_mode import cpu_mode_active, megatron_cpu_mode

__all__ = ["cpu_mode_active", "megatron_cpu_mode"]
