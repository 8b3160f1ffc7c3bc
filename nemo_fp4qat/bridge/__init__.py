"""Megatron-Bridge integration (optional: needs ``megatron-bridge``; see ``make test-bridge``).

Importing it installs :mod:`.import_fixes` first, so import it before ``megatron.core`` / ``megatron.bridge``.
"""

from __future__ import annotations

from .import_fixes import install_import_fixes

install_import_fixes()

from .callback import STATE_FILE, TEACHER_FILE, FP4QATBridgeCallback, bridge_gpt_forward  # noqa: E402
from .cpu_mode import bridge_cpu_mode, bridge_cpu_mode_active  # noqa: E402
from .dryrun import describe_run, launch, policy_plan  # noqa: E402
from .monitor import BridgeQuantizationMonitor  # noqa: E402

__all__ = [
    "STATE_FILE",
    "TEACHER_FILE",
    "BridgeQuantizationMonitor",
    "FP4QATBridgeCallback",
    "bridge_cpu_mode",
    "bridge_cpu_mode_active",
    "bridge_gpt_forward",
    "describe_run",
    "launch",
    "policy_plan",
]
