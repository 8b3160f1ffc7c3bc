"""QAD on the NeMo path: a frozen teacher restored from the base NeMo checkpoint teaches the quantized model.

The Lightning path's :class:`~nemo_fp4qat.qat.distillation.Distiller` mixes a KD term into the loss a
``training_step`` returns. NeMo's ``training_step`` returns megatron-core's per-token cross entropy instead,
which NeMo's ``MaskedTokenLossReduction`` then reduces over the loss mask (and across micro-batches and
data-parallel ranks). So here the per-token KL takes the cross entropy's place inside the megatron-core
``GPTModel`` (its ``compute_language_model_loss``): NeMo's reduction, logging and gradient path stay as they
are, and the loss NeMo reports is the distillation loss.

The teacher is built the way NeMo's own ``llm.distill`` builds one (``teacher_provider``: the model config's
``configure_model`` and the checkpoint's sharded weights), from the base checkpoint a recipe restores with
``RestoreConfig``, a path given as ``DistillationConfig.teacher``, or the one saved in a resumed run's callback
state. Without any, a fresh run copies the student as restored, before calibration, with its quantizers off.
Tensor- and pipeline-parallel runs are refused: the per-token KL would need the vocabulary-parallel softmax
NeMo's ``llm.distill`` implements.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from ..qat.distillation import DistillationConfig, kd_per_token

__all__ = ["MegatronDistiller", "build_teacher"]

_NOT_TEACHER_INPUTS = ("labels", "loss_mask")


def _quantizers_off(module: nn.Module) -> None:
    from modelopt.torch.quantization.nn import TensorQuantizer

    for m in module.modules():
        if isinstance(m, TensorQuantizer):
            m.disable()


def build_teacher(pl_module: Any, trainer: Any, student: nn.Module, path: str | None) -> nn.Module:
    """The frozen teacher: restored from the NeMo checkpoint at ``path`` (NeMo's ``teacher_provider``), or
    a copy of ``student`` as it stands, quantizers off. The RNG is left as it was (data order unchanged)."""
    with torch.random.fork_rng(devices=[]):
        if path is not None:
            from nemo.collections.llm.modelopt.distill.utils import teacher_provider

            teacher = teacher_provider(pl_module.config, str(path), pl_module.tokenizer, trainer)
        else:
            teacher = copy.deepcopy(student)
            _quantizers_off(teacher)
    dtype = next(p.dtype for p in student.parameters() if p.is_floating_point())
    device = next(student.parameters()).device
    teacher = teacher.to(device=device, dtype=dtype).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


class MegatronDistiller:
    """Puts ``alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE`` per token in place of the megatron-core
    student's cross entropy; the teacher runs on the inputs the student's forward received."""

    def __init__(self, student: nn.Module, teacher: nn.Module, cfg: DistillationConfig, patches: Any) -> None:
        self.cfg = cfg
        self.teacher = teacher  # a plain attribute: never part of the student's state dict or optimizer
        self._inputs: tuple[tuple, dict] | None = None
        self._hook = student.register_forward_pre_hook(self._capture, with_kwargs=True)
        patches.patch(student, "compute_language_model_loss", self._make_loss)

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
        self._hook.remove()
