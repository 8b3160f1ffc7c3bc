"""Explicit, opt-in shims for library code that assumes CUDA, for CPU-only machines.

Each shim is a context manager that does nothing when CUDA is available, and patches only for the
duration of the ``with`` block. Nothing here is applied on import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["modelopt_export_on_cpu"]


@contextlib.contextmanager
def modelopt_export_on_cpu() -> Iterator[None]:
    """Let modelopt's pure-torch qtensors (``NVFP4QTensor.quantize`` ...) run without CUDA.

    modelopt 0.37 asks ``torch.cuda.get_device_capability(0)`` (``fp4_compatible``) before it
    quantizes, which raises on a CPU-only torch; 0.47 checks ``input.is_cuda`` first. On a CPU-only
    machine the answer is simply "no FP4 hardware".
    """
    if torch.cuda.is_available():
        yield
        return
    from modelopt.torch.quantization.qtensor import nvfp4_tensor

    patched = hasattr(nvfp4_tensor, "fp4_compatible")
    original = getattr(nvfp4_tensor, "fp4_compatible", None)
    if patched:
        nvfp4_tensor.fp4_compatible = lambda: False
    try:
        yield
    finally:
        if patched:
            nvfp4_tensor.fp4_compatible = original
