"""What both Megatron front ends (NeMo 2, Megatron-Bridge) need to run megatron-core on a CPU.

megatron-core assumes CUDA in a handful of places (``torch.cuda.current_device()`` for buffers and rotary
embeddings, ``torch.cuda.Stream`` for DDP, ``torch.cuda.synchronize``, ``.cuda()`` / ``device="cuda"``
tensors, the CUDA RNG tracker, a gradient clip that asserts ``torch.cuda.FloatTensor``, and in its MoE layer
Transformer Engine's router GEMM and the token dispatcher's device-to-host copies). The front ends'
CPU modes (:func:`nemo_fp4qat.nemo.megatron_cpu_mode`, :func:`nemo_fp4qat.bridge.bridge_cpu_mode`) answer
them with the CPU through :func:`torch_cuda_on_cpu` and :func:`megatron_core_on_cpu` for the duration of a
block; they are explicit, opt-in, and inert where CUDA is available. Plain torch only: this module imports
neither NeMo nor Lightning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaToCpu", "megatron_core_on_cpu", "patched", "torch_cuda_on_cpu"]


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


class CudaToCpu(TorchFunctionMode):
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
    """``torch.cuda.Stream`` / ``Event`` stand-in: every wait, record and synchronize is already done."""

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def wait_stream(self, *_: Any, **__: Any) -> None:
        pass

    def wait_event(self, *_: Any, **__: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *_: Any, **__: Any) -> _NullStream:
        return _NullStream()  # an event that is already done (megatron-core's MoE dispatcher synchronizes on it)

    def wait(self, *_: Any, **__: Any) -> None:
        pass

    def record(self, *_: Any, **__: Any) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``obj.name = value`` for the block, then put back what was there (or remove it)."""
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


def torch_cuda_on_cpu(stack: contextlib.ExitStack) -> None:
    """Answer the ``torch.cuda`` calls megatron-core makes with the CPU, until ``stack`` closes."""
    cuda = torch.cuda
    for name, value in {
        "current_device": lambda: torch.device("cpu"),
        "set_device": lambda *a, **k: None,
        "synchronize": lambda *a, **k: None,
        "Stream": _NullStream,
        "Event": _NullStream,
        "current_stream": lambda *a, **k: _NullStream(),
        "default_stream": lambda *a, **k: _NullStream(),
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "empty_cache": lambda *a, **k: None,
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda *a, **k: None,
        "manual_seed": lambda *a, **k: None,
        "manual_seed_all": lambda *a, **k: None,
        "max_memory_allocated": lambda *a, **k: 0,
        "memory_allocated": lambda *a, **k: 0,
        "memory_reserved": lambda *a, **k: 0,
        "max_memory_reserved": lambda *a, **k: 0,
        "reset_peak_memory_stats": lambda *a, **k: None,
        "memory_stats": lambda *a, **k: {},
    }.items():
        stack.enter_context(patched(cuda, name, value))
    stack.enter_context(patched(cuda.nvtx, "range_push", lambda *a, **k: None))
    stack.enter_context(patched(cuda.nvtx, "range_pop", lambda *a, **k: None))


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


def megatron_core_on_cpu(stack: contextlib.ExitStack) -> bool:
    """megatron-core's CUDA RNG tracker forks and gradient clip on the CPU; False if megatron-core is absent."""
    try:
        from megatron.core.optimizer import optimizer as moptimizer
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:
        return False
    stack.enter_context(patched(mrandom.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext()))
    stack.enter_context(patched(mrandom, "_set_cuda_rng_state", lambda *a, **k: None))
    stack.enter_context(patched(moptimizer, "clip_grad_by_total_norm_fp32", _clip_grads_on_cpu))
    _moe_on_cpu(stack)
    return True


def _moe_on_cpu(stack: contextlib.ExitStack) -> None:
    """megatron-core's mixture-of-experts layer on the CPU: the router's gating GEMM reads Transformer Engine's
    ``te_general_gemm``, which is undefined without TE (None takes its torch.mm path), and the alltoall token
    dispatcher passes its split sizes to ``all_to_all_single`` as CPU tensors where a GPU run passes the numpy
    arrays of its device-to-host copy (gloo's binding refuses tensors): CPU tensors asked for as numpy become numpy.
    """
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:
        return
    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        stack.enter_context(patched(moe_utils, "te_general_gemm", None))
    move = getattr(token_dispatcher, "maybe_move_tensor_to_cpu", None)
    if move is not None:

        def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
            if as_numpy and isinstance(tensor, torch.Tensor) and not tensor.is_cuda:
                return tensor.numpy()
            return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

        stack.enter_context(patched(token_dispatcher, "maybe_move_tensor_to_cpu", to_host))
