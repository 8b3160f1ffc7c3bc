"""CPU mode for Megatron-Bridge training: a development aid, explicit and opt-in.

Megatron-Bridge 0.6.2 (with megatron-core 0.19.2) assumes CUDA: ``setup()`` calls
``initialize_megatron`` without ``allow_no_cuda`` ("Megatron requires CUDA"), builds its dataset helpers
with ``make`` (the wheel ships them prebuilt, without a Makefile), warms up JIT-fused CUDA kernels, and
megatron-core adds the CUDA assumptions :mod:`nemo_fp4qat.megatron_cpu` answers. Inside
``with bridge_cpu_mode():`` those are answered with the CPU, so a model trains, checkpoints, quantizes and
exports with Bridge's own ``pretrain`` loop on gloo. It never activates where CUDA is available (the block then
does nothing, with a warning) and patches only for the duration of the block. Not for production training.

The import fixes Megatron-Bridge needs without Transformer Engine are :mod:`.import_fixes` (installed when
``nemo_fp4qat.bridge`` is imported).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..megatron_cpu import CudaToCpu, megatron_core_on_cpu, patched, torch_cuda_on_cpu

__all__ = ["bridge_cpu_mode", "bridge_cpu_mode_active"]

_ACTIVE = False


def bridge_cpu_mode_active() -> bool:
    return _ACTIVE


@contextlib.contextmanager
def bridge_cpu_mode() -> Iterator[bool]:
    """Run Megatron-Bridge training on the CPU inside this block. Yields whether the mode is active.

    Enter it before importing ``megatron.core`` or ``megatron.bridge``; use gloo
    (``cfg.dist.distributed_backend = "gloo"``) and fp32.

    Example:
        >>> with bridge_cpu_mode():
        ...     from megatron.bridge.training.pretrain import pretrain
        ...     pretrain(cfg, forward_step, callbacks=[qat])
    """
    global _ACTIVE
    if torch.cuda.is_available():
        warnings.warn("bridge_cpu_mode() does nothing on a machine with CUDA.", stacklevel=3)
        yield False
        return
    if _ACTIVE:
        yield True
        return
    with contextlib.ExitStack() as stack:
        torch_cuda_on_cpu(stack)
        megatron_core_on_cpu(stack)
        from megatron.bridge.training import initialize as binit
        from megatron.bridge.training import setup as bsetup

        original_init = binit.initialize_megatron

        def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
            kwargs["allow_no_cuda"] = True  # setup() never passes it
            return original_init(*args, **kwargs)

        stack.enter_context(patched(binit, "initialize_megatron", initialize_megatron))
        stack.enter_context(patched(bsetup, "initialize_megatron", initialize_megatron))
        # the wheel ships the dataset helpers prebuilt; compile_helpers() would run `make` in site-packages
        stack.enter_context(patched(binit, "compile_helpers", lambda: None))
        # JIT warm-up of CUDA-fused kernels on device="cuda" tensors
        stack.enter_context(patched(binit, "_warmup_jit_function", lambda *a, **k: None))
        # _set_random_seed seeds megatron's model-parallel RNG tracker only when it sees a GPU; Bridge's checkpoint
        # load then refuses the run's RNG state for its empty tracker states. Seeded as with one device, the tracker
        # holds (CPU) states; forking it is a no-op here, as in megatron_core_on_cpu.
        original_seed = binit._set_random_seed

        def _set_random_seed(*args: Any, **kwargs: Any) -> Any:
            with patched(torch.cuda, "device_count", lambda: 1):
                return original_seed(*args, **kwargs)

        stack.enter_context(patched(binit, "_set_random_seed", _set_random_seed))
        stack.enter_context(CudaToCpu())
        _ACTIVE = True
        try:
            yield True
        finally:
            _ACTIVE = False
