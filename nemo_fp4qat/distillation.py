"""Quantization-aware distillation (QAD): the full-precision model teaches its quantized copy.

The teacher is a frozen copy of the model taken *before* quantizers are inserted. Each training
step, a forward hook on the student captures its inputs and logits; the teacher runs on the same
inputs (no gradients) and the step's loss becomes

    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * loss_lm

Implemented with hooks rather than a custom LightningModule so it works for any module whose
forward returns logits (Hugging Face ``CausalLMOutput.logits`` or a tensor, e.g. megatron-core GPT).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["DistillationConfig", "Distiller", "kd_loss"]


@dataclass
class DistillationConfig:
    """Attributes:
    alpha: weight of the KL term (1.0: distillation only, 0.0: plain QAT).
    temperature: softmax temperature of both distributions.
    """

    alpha: float = 1.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"distillation alpha must be in [0, 1], got {self.alpha}")
        if self.temperature <= 0:
            raise ValueError(f"distillation temperature must be > 0, got {self.temperature}")

    @classmethod
    def resolve_spec(cls, spec: Any) -> DistillationConfig | None:
        if spec is None or spec is False:
            return None
        if spec is True:
            return cls()
        if isinstance(spec, DistillationConfig):
            return spec
        return cls(**{k: v for k, v in dict(spec).items() if k != "_target_"})


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean per-token ``T^2 * KL(p_teacher || p_student)`` over all positions."""
    t = temperature
    s = F.log_softmax(student.float() / t, dim=-1).reshape(-1, student.shape[-1])
    p = F.log_softmax(teacher.float() / t, dim=-1).reshape(-1, teacher.shape[-1])
    return F.kl_div(s, p, log_target=True, reduction="batchmean") * (t * t)


class Distiller:
    """Holds the frozen teacher and mixes the KD loss into the student's training loss."""

    def __init__(self, student: nn.Module, cfg: DistillationConfig) -> None:
        self.cfg = cfg
        self.teacher = copy.deepcopy(student).eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self._captured: tuple[Any, Any, torch.Tensor] | None = None
        self._hook = student.register_forward_hook(self._capture, with_kwargs=True)
        self.last: dict[str, float] = {}

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if module.training:
            self._captured = (args, kwargs, _logits(output))

    def teacher_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.teacher.parameters())

    def mix(self, lm_loss: torch.Tensor) -> torch.Tensor:
        """The step's loss given the student's LM loss (uses the student forward just captured)."""
        if self._captured is None:
            raise RuntimeError("QAD: no student forward was captured in this step.")
        args, kwargs, student_logits = self._captured
        self._captured = None
        dev = student_logits.device
        if next(self.teacher.parameters()).device != dev:
            self.teacher.to(dev)
        with torch.no_grad():
            teacher_logits = _logits(self.teacher(*args, **kwargs))
        kd = kd_loss(student_logits, teacher_logits, self.cfg.temperature)
        self.last = {"kd": float(kd.detach()), "lm": float(lm_loss.detach())}
        a = self.cfg.alpha
        return a * kd + (1.0 - a) * lm_loss if a < 1.0 else kd

    def remove(self) -> None:
        self._hook.remove()
