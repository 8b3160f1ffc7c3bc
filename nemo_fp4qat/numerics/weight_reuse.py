"""Weight fake quant computed once per optimizer step and reused by every micro-batch of that step.

Under gradient accumulation (Lightning's ``accumulate_grad_batches``, megatron-core's micro-batches) every
micro-batch's forward fake-quantizes the same weights: they change only at the optimizer step. While reuse is on,
the fake-quant op (:mod:`.cpu_backend`, CPU and CUDA tensors alike) keeps the quantize->dequantize of each weight
parameter and hands it to the next forward of the same step instead of quantizing again. modelopt's autograd
function still wraps every use, so the straight-through gradient of each micro-batch reaches the weight as before;
the result is the same bit for bit. Activations (anything that is not an ``nn.Parameter``) are never kept.

A kept result is used only while all of these hold: the same parameter object, its storage and version counter
unchanged (torch optimizers update in place, which bumps it), the same amax storage (modelopt hands its amax buffer
over as ``amax.data``, a new object without the buffer's version counter), the same format and block size. Writes
that bypass the version counter (``param.data.copy_``, as megatron-core's optimizer copies its float32 main weights
into the model's; amax written through ``.data``) are covered by dropping everything kept at each optimizer step (a
global ``torch.optim`` step hook, which fires inside megatron-core's optimizer before that copy), at every
calibration and format switch of the controller, and at the start and end of validation. torch's autocast keeps its
weight casts the same way, for the same reason; no library keeps a fake-quantized weight across micro-batches, so
this is written here.

Memory: one fake-quantized copy of each quantized weight, alive from the step's first forward to its optimizer
step (the first micro-batch's autograd graph holds that copy anyway until its backward).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["WeightReuse", "clear_weight_reuse", "reuse_weight_fake_quant", "weight_reuse_active", "weight_reuse_stats"]

_ACTIVE = 0  # nested activations (a callback and a mixin, or two runs in one process)
_KEPT: dict[int, tuple[Any, tuple, torch.Tensor]] = {}
_STATS = {"computed": 0, "reused": 0}
_HOOK: Any = None


def _drop_at_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _KEPT.clear()


def reuse_weight_fake_quant(on: bool) -> None:
    """Turn reuse on (counted: each ``True`` needs its ``False``) or off; off drops everything kept.

    Example:
        >>> reuse_weight_fake_quant(True)  # a training run starts
        >>> reuse_weight_fake_quant(False)  # it ends
    """
    global _ACTIVE, _HOOK
    if on:
        _ACTIVE += 1
        if _HOOK is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _HOOK = register_optimizer_step_post_hook(_drop_at_optimizer_step)
        return
    _ACTIVE = max(0, _ACTIVE - 1)
    _KEPT.clear()
    if _ACTIVE == 0 and _HOOK is not None:
        _HOOK.remove()
        _HOOK = None


class WeightReuse:
    """One training run's share of reuse: :meth:`start` when training starts, :meth:`stop` when it ends (either
    any number of times). ``NEMO_FP4QAT_WEIGHT_REUSE=0`` keeps it off: every micro-batch quantizes again."""

    def __init__(self) -> None:
        self.on = False

    def start(self) -> None:
        if not self.on and os.environ.get("NEMO_FP4QAT_WEIGHT_REUSE", "1") != "0":
            reuse_weight_fake_quant(True)
            self.on = True

    def stop(self) -> None:
        if self.on:
            reuse_weight_fake_quant(False)
            self.on = False


def weight_reuse_active() -> bool:
    return _ACTIVE > 0


def clear_weight_reuse() -> None:
    """Drop every kept weight (the weights or their scales may have changed outside an optimizer step)."""
    _KEPT.clear()


def weight_reuse_stats(reset: bool = False) -> dict[str, int]:
    """How many weight fake quants were computed and how many reused while reuse was on."""
    out = dict(_STATS)
    if reset:
        _STATS.update(computed=0, reused=0)
    return out


def _key(inputs: torch.Tensor, amax: torch.Tensor | None, fmt: tuple) -> tuple:
    # modelopt hands the amax buffer over as ``amax.data``: a new object each call, with a version counter of its own
    a = (amax.data_ptr(), tuple(amax.shape), amax.dtype) if isinstance(amax, torch.Tensor) else amax
    return (inputs._version, inputs.data_ptr(), tuple(inputs.shape), inputs.dtype, a, fmt)


def kept(inputs: torch.Tensor, amax: torch.Tensor | None, fmt: tuple) -> torch.Tensor | None:
    """The kept fake quant of weight ``inputs`` if it still holds (a new view of it), else None."""
    if not _ACTIVE or not isinstance(inputs, torch.nn.Parameter):
        return None
    entry = _KEPT.get(id(inputs))
    if entry is None or entry[0]() is not inputs or entry[1] != _key(inputs, amax, fmt):
        return None
    _STATS["reused"] += 1
    return entry[2].view_as(entry[2])  # a new tensor object: each micro-batch's autograd node owns its own output


def keep(inputs: torch.Tensor, amax: torch.Tensor | None, fmt: tuple, out: torch.Tensor) -> torch.Tensor:
    """Keep ``out`` (the fake quant of weight ``inputs``) for the rest of the step; returns ``out``."""
    if _ACTIVE and isinstance(inputs, torch.nn.Parameter):
        _KEPT[id(inputs)] = (weakref.ref(inputs), _key(inputs, amax, fmt), out)
        _STATS["computed"] += 1
        return out.view_as(out)
    return out


def kept_or_computed(
    inputs: torch.Tensor, amax: torch.Tensor | None, fmt: tuple, compute: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """The fake quant of ``inputs`` in format ``fmt``: the one kept in this step if it still holds, else
    ``compute()`` (kept for the step's other micro-batches when ``inputs`` is a weight and reuse is on)."""
    hit = kept(inputs, amax, fmt)
    return hit if hit is not None else keep(inputs, amax, fmt, compute())
