"""QAD inside a megatron-core ``GPTModel``: the per-token KL takes the cross entropy's place.

A megatron-core ``GPTModel`` given labels returns the per-token cross entropy from its
``compute_language_model_loss``; the front ends (NeMo 2's ``MaskedTokenLossReduction``, Megatron-Bridge's
``masked_next_token_loss``) then reduce it over the loss mask, across micro-batches and data-parallel ranks.
Replacing that one method keeps every front end's reduction, logging and gradient path as they are, and the
loss they report is the distillation loss. The teacher runs on the inputs the student's forward received.
Tensor-parallel logits are not gathered here: the front ends refuse QAD at TP > 1 (a vocabulary-parallel KL is
what NeMo's ``llm.distill`` and modelopt's distillation plugin implement).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from .distillation import DistillationConfig, kd_per_token

__all__ = ["MegatronDistiller", "freeze", "frozen_copy", "quantizers_off"]

_NOT_TEACHER_INPUTS = ("labels", "loss_mask")
_MISSING = object()


def quantizers_off(module: nn.Module) -> None:
    """Disable every modelopt ``TensorQuantizer`` in ``module`` (a teacher copied from a quantized student)."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    for m in module.modules():
        if isinstance(m, TensorQuantizer):
            m.disable()


def freeze(model: nn.Module, like: nn.Module | None = None) -> nn.Module:
    """``model`` as a teacher: quantizers off, eval mode, no gradients, on ``like``'s device and dtype (if given)."""
    quantizers_off(model)
    if like is not None:
        ref = next(p for p in like.parameters() if p.is_floating_point())
        model = model.to(device=ref.device, dtype=ref.dtype)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _copy_sharing_process_groups(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, the copy's modules holding the same torch.distributed process groups (megatron-core
    >= 0.16 keeps them on the modules; a process group cannot be copied, and the copy talks to the same ranks).
    ``copy`` has no public way to declare a type atomic, hence its dispatch table, for the length of the copy."""
    try:
        from torch.distributed import ProcessGroup
    except ImportError:  # pragma: no cover - torch built without distributed
        return copy.deepcopy(model)
    table = copy._deepcopy_dispatch  # type: ignore[attr-defined]
    before = table.get(ProcessGroup)
    table[ProcessGroup] = copy._deepcopy_atomic  # type: ignore[attr-defined]
    try:
        return copy.deepcopy(model)
    finally:
        if before is None:
            del table[ProcessGroup]
        else:
            table[ProcessGroup] = before


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen copy of ``model`` (see :func:`freeze`), taken without touching the RNG, so the run's data order
    does not change."""
    with torch.random.fork_rng(devices=[]):
        return freeze(_copy_sharing_process_groups(model))


class MegatronDistiller:
    """Puts ``alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE`` per token in place of the megatron-core
    student's cross entropy (validation forwards, which are not in training mode, keep the cross entropy).

    Args:
        student: the megatron-core ``GPTModel`` being trained (unwrapped from DDP).
        teacher: a frozen model taking the same inputs and returning ``[b, s, vocab]`` logits without labels.
        cfg: alpha and temperature.
    """

    def __init__(self, student: nn.Module, teacher: nn.Module, cfg: DistillationConfig) -> None:
        self.cfg = cfg
        self.teacher = teacher  # a plain attribute: never part of the student's state dict or optimizer
        self._student = student
        self._inputs: tuple[tuple, dict] | None = None
        self._hook = student.register_forward_pre_hook(self._capture, with_kwargs=True)
        self._saved = student.__dict__.get("compute_language_model_loss", _MISSING)
        student.compute_language_model_loss = self._make_loss(student.compute_language_model_loss)

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training:
            self._inputs = (args, {k: v for k, v in kwargs.items() if k not in _NOT_TEACHER_INPUTS})

    def teacher_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.teacher.parameters())

    def _make_loss(self, original: Any) -> Any:
        def compute_language_model_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            if self._inputs is None:  # not a training forward (e.g. validation): plain cross entropy
                return original(labels, logits)
            args, kwargs = self._inputs
            self._inputs = None
            with torch.no_grad():
                teacher_logits = self.teacher(*args, **kwargs)  # [b, s, v] without labels
            kd = kd_per_token(logits.transpose(0, 1), teacher_logits, self.cfg.temperature)  # [b, s]
            a = self.cfg.alpha
            return a * kd + (1.0 - a) * original(labels, logits) if a < 1.0 else kd

        return compute_language_model_loss

    def remove(self) -> None:
        """Take the hook off and give the student its own loss back."""
        self._hook.remove()
        if self._saved is _MISSING:
            self._student.__dict__.pop("compute_language_model_loss", None)
        else:
            self._student.compute_language_model_loss = self._saved
