"""CPU mode for Megatron / NeMo 2 training: a development aid, explicit and opt-in.

megatron-core and NeMo's Megatron path assume CUDA in a handful of places
(``torch.cuda.current_device()`` for buffers and rotary embeddings, CUDA RNG tracker forks,
``torch.cuda.Stream``, ``torch.cuda.synchronize``, ``.cuda()`` / ``device="cuda"`` tensors, config
checks that demand Transformer Engine for the kernel fusions NeMo's model configs enable). Inside
``with megatron_cpu_mode():`` those are answered with the CPU so a tiny model can be trained,
checkpointed and quantized on a laptop or in CI to smoke-test QAT configs.

It never activates when CUDA is available (the context manager is then a no-op with a warning),
and it patches only for the duration of the block. Not for production training.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_mode_active", "megatron_cpu_mode"]

_ACTIVE = False


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaToCpu(TorchFunctionMode):
    """Redirects ``device="cuda"`` arguments, ``.cuda()`` and ``.to("cuda")`` to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "to" and args and isinstance(args[0], torch.Tensor):
            args = tuple("cpu" if i > 0 and _is_cuda(a) and not isinstance(a, int) else a for i, a in enumerate(args))
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        return func(*args, **kwargs)


class _NullStream:
    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def wait_stream(self, *_: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *_: Any) -> None:
        return None


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    missing = object()
    old = getattr(obj, name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


# Kernel fusions that need Transformer Engine, Apex or CUDA kernels. Turning them off changes only
# how the same math is computed, so a stock NeMo config (``LlamaConfig`` enables several) builds on a CPU.
CUDA_FUSIONS = (
    "apply_rope_fusion",
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "bias_dropout_fusion",
    "gradient_accumulation_fusion",
)


def _fusions_off(post_init: Any) -> Any:
    def __post_init__(self: Any) -> None:
        for name in CUDA_FUSIONS:
            if getattr(self, name, False):
                setattr(self, name, False)
        post_init(self)

    return __post_init__


def _clip_grads_on_cpu(parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False) -> None:
    """megatron's ``clip_grad_by_total_norm_fp32`` (same scaling) without its CUDA-tensor assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in parameters:
            grad = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
            if grad is not None:
                grad.detach().mul_(coeff)


def _mock_dataset_with_mask(mock: Any) -> Any:
    """NeMo's ``MockDataModule`` datasets with the attention mask megatron needs without Transformer Engine.

    NeMo 2.7.3's ``MockDataModule`` passes its ``create_attention_mask`` flag positionally into the
    dataset's ``seed`` parameter, so no mask is made and NeMo's GPT step then refuses to run without TE.
    """
    orig = mock._MockGPTDataset.__init__

    def __init__(self, tokenizer, name, num_samples, seq_length, seed=42, create_attention_mask=False):
        if isinstance(seed, bool):  # the flag arrived in `seed`
            seed = 42
        orig(self, tokenizer, name, num_samples, seq_length, seed, True)

    return __init__


def cpu_mode_active() -> bool:
    return _ACTIVE


@contextlib.contextmanager
def megatron_cpu_mode() -> Iterator[bool]:
    """Run Megatron/NeMo code on the CPU inside this block. Yields whether the mode is active."""
    global _ACTIVE
    if torch.cuda.is_available():
        warnings.warn("megatron_cpu_mode() does nothing on a machine with CUDA.", stacklevel=3)
        yield False
        return
    if _ACTIVE:
        yield True
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(torch.cuda, "current_device", lambda: torch.device("cpu")))
        stack.enter_context(_patched(torch.cuda, "synchronize", lambda *a, **k: None))
        stack.enter_context(_patched(torch.cuda, "Stream", _NullStream))
        stack.enter_context(_patched(torch.cuda, "current_stream", lambda *a, **k: _NullStream()))
        stack.enter_context(_patched(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()))
        stack.enter_context(_patched(torch.cuda, "empty_cache", lambda: None))
        stack.enter_context(_patched(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()))
        stack.enter_context(_patched(torch.cuda, "set_rng_state", lambda *a, **k: None))
        stack.enter_context(_patched(torch.cuda, "manual_seed", lambda *a, **k: None))
        stack.enter_context(_patched(torch.cuda, "max_memory_allocated", lambda *a, **k: 0))
        stack.enter_context(_patched(torch.cuda, "memory_allocated", lambda *a, **k: 0))
        stack.enter_context(_patched(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None))
        try:
            from megatron.core.tensor_parallel import random as mrandom

            stack.enter_context(
                _patched(mrandom.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())
            )
            stack.enter_context(_patched(mrandom, "_set_cuda_rng_state", lambda *a, **k: None))
            from megatron.core.optimizer import optimizer as moptimizer
            from megatron.core.transformer.transformer_config import TransformerConfig

            stack.enter_context(_patched(moptimizer, "clip_grad_by_total_norm_fp32", _clip_grads_on_cpu))

            stack.enter_context(
                _patched(TransformerConfig, "__post_init__", _fusions_off(TransformerConfig.__post_init__))
            )
        except ImportError:  # megatron-core not installed: torch-level patches only
            pass
        try:
            from nemo.lightning.io import pl as nemo_io_pl

            # NeMo's dist-checkpoint load asserts CUDA is initialised to move tensors to the current
            # GPU; on a CPU they are already where they belong.
            stack.enter_context(_patched(nemo_io_pl, "_fix_tensors_device", lambda ckpt: ckpt))
            from nemo.lightning.pytorch.callbacks.progress_printer import ProgressPrinter

            # NeMo's progress printer gathers megatron's timers from every rank, but only rank 0 prints
            # (Lightning disables progress bars elsewhere): an all-gather only rank 0 enters, which
            # blocks a multi-process gloo run for good. No timer summary on CPU.
            stack.enter_context(_patched(ProgressPrinter, "log_megatron_timers", lambda self, timers: None))
            from nemo.collections.llm.gpt.data import mock

            stack.enter_context(_patched(mock._MockGPTDataset, "__init__", _mock_dataset_with_mask(mock)))
        except ImportError:  # NeMo not installed
            pass
        stack.enter_context(_CudaToCpu())
        _ACTIVE = True
        try:
            yield True
        finally:
            _ACTIVE = False
