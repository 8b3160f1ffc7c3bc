"""Quantization-aware distillation (QAD): the full-precision model teaches its quantized copy.

The teacher is a frozen copy of the model taken *before* quantizers are inserted. Each training
step, a forward hook on the student captures its inputs and logits; the teacher runs on the same
inputs (no gradients) and the step's loss becomes

    loss = alpha * T^2 * D(softmax(teacher / T), softmax(student / T)) + (1 - alpha) * loss_lm

where ``D`` is the distillation loss: ``kl`` (KL(teacher || student), NVIDIA's QAD recipe), ``jsd`` (the
Jensen-Shannon divergence, as IST-DASLab's NVFP4 QAT checkpoints distil) or ``kl_mse`` (KL plus the relative mean
squared error of the last hidden state, the input of the output layer, as FAAR distils).

Implemented with hooks rather than a custom LightningModule so it works for any module whose
forward returns logits (Hugging Face ``CausalLMOutput.logits`` or a tensor, e.g. megatron-core GPT).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from nemo_fp4qat.specs import ConfigError, optional_spec

__all__ = ["DISTILLATION_LOSSES", "DistillationConfig", "Distiller", "is_nemo_checkpoint", "kd_loss", "kd_per_token"]

DISTILLATION_LOSSES = ("kl", "jsd", "kl_mse")


def is_nemo_checkpoint(path: str | Path) -> bool:
    """A NeMo 2 checkpoint directory (``weights/`` dist-checkpoint beside ``context/``)."""
    return (Path(path) / "weights").is_dir()


@dataclass
class DistillationConfig:
    """Attributes:
    alpha: weight of the KL term (1.0: distillation only, the QAD default; 0.0: plain QAT).
    temperature: softmax temperature of both distributions (NVIDIA's QAD recipe: 1).
    teacher: the full-precision teacher. ``None``: a frozen copy of the model as it stands before
        quantization (QAD started from a fine-tuned model: the fine-tune teaches its own PTQ; on the NeMo
        path, the base checkpoint a recipe's ``RestoreConfig`` loads); a Hugging Face model directory (e.g.
        the BF16 fine-tune saved elsewhere); a NeMo 2 checkpoint directory (NeMo path); or an ``nn.Module``.
    loss: ``"kl"`` (KL(teacher || student), the default), ``"jsd"`` (Jensen-Shannon divergence) or ``"kl_mse"``
        (KL plus ``hidden_weight`` times the last hidden state's mean squared error relative to the teacher's mean
        square; Hugging Face models, whose output layer ``get_output_embeddings`` names). The megatron front ends
        (NeMo 2, Megatron-Bridge) take ``"kl"``.
    hidden_weight: the weight of the hidden-state term of ``kl_mse``.
    """

    alpha: float = 1.0
    temperature: float = 1.0
    teacher: Any = None
    loss: str = "kl"
    hidden_weight: float = 1.0

    def __post_init__(self) -> None:
        from nemo_fp4qat.qat.calibration.scale_levers import check_choice

        check_choice(self.loss, DISTILLATION_LOSSES, "distillation loss")
        if (
            isinstance(self.hidden_weight, bool)
            or not isinstance(self.hidden_weight, (int, float))
            or not (self.hidden_weight >= 0)
        ):
            raise ConfigError(f"distillation hidden_weight must be a number >= 0, got {self.hidden_weight!r}.")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"distillation alpha must be in [0, 1], got {self.alpha}")
        if self.temperature <= 0:
            raise ValueError(f"distillation temperature must be > 0, got {self.temperature}")
        if isinstance(self.teacher, (str, Path)) and not (
            (Path(self.teacher) / "config.json").is_file() or is_nemo_checkpoint(self.teacher)
        ):
            raise ValueError(
                f"distillation teacher {str(self.teacher)!r} is neither a Hugging Face model directory (no "
                "config.json) nor a NeMo 2 checkpoint (no weights/); give the BF16 model's folder, an nn.Module, "
                "or None for a copy of the model before quantization."
            )
        if self.teacher is not None and not isinstance(self.teacher, (str, Path, nn.Module)):
            raise ValueError(
                f"distillation teacher must be a path, an nn.Module or None, got {type(self.teacher).__name__}"
            )

    @classmethod
    def resolve_spec(cls, spec: Any) -> DistillationConfig | None:
        if spec == "qad":
            return cls()  # KL only at T=1, the workflow NVIDIA's QAD report recommends
        hint = ("use True or 'qad' (KL only, T=1), a dict of DistillationConfig fields (alpha, temperature, teacher, "
                "loss) or a DistillationConfig.")  # fmt: skip
        return optional_spec(cls, spec, "distillation", hint)


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0, loss: str = "kl") -> torch.Tensor:
    """Mean per-token ``T^2 * D(p_teacher, p_student)`` over all positions; ``D``: ``kl`` (KL(teacher || student))
    or ``jsd`` (``(KL(p_t || m) + KL(p_s || m)) / 2`` with ``m`` the mean of the two distributions)."""
    t = temperature
    s = F.log_softmax(student.float() / t, dim=-1).reshape(-1, student.shape[-1])
    p = F.log_softmax(teacher.float() / t, dim=-1).reshape(-1, teacher.shape[-1])
    if loss == "jsd":
        m = torch.logsumexp(torch.stack([s, p]), dim=0) - math.log(2.0)  # log of the mixture, stable
        jsd = 0.5 * (F.kl_div(m, p, log_target=True, reduction="batchmean")
                     + F.kl_div(m, s, log_target=True, reduction="batchmean"))  # fmt: skip
        return jsd * (t * t)
    return F.kl_div(s, p, log_target=True, reduction="batchmean") * (t * t)


def hidden_mse(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """The last hidden state's mean squared error relative to the teacher's mean square (scale-free)."""
    t = teacher.float()
    return (student.float() - t).pow(2).mean() / t.pow(2).mean().clamp_min(1e-12)


def kd_per_token(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``T^2 * KL(p_teacher || p_student)`` at each position (shape ``student.shape[:-1]``), in float32:
    what a per-token loss reduction (NeMo's masked-token mean) takes in place of the cross entropy."""
    t = temperature
    s = F.log_softmax(student.float() / t, dim=-1)
    p = F.log_softmax(teacher.float() / t, dim=-1)
    return (p.exp() * (p - s)).sum(-1) * (t * t)


def _load_teacher(spec: Any, student: nn.Module) -> nn.Module:
    if spec is None:
        return copy.deepcopy(student)
    if isinstance(spec, nn.Module):
        return copy.deepcopy(spec)
    if is_nemo_checkpoint(spec):
        raise ValueError(
            f"distillation teacher {str(spec)!r} is a NeMo checkpoint, which only the NeMo path loads: use "
            "NeMoFP4QATCallback with a NeMo model, or give this model's teacher as a Hugging Face directory."
        )
    from transformers import AutoModelForCausalLM

    dtype = next((p.dtype for p in student.parameters() if p.is_floating_point()), torch.float32)
    return AutoModelForCausalLM.from_pretrained(str(spec), dtype=dtype)


class Distiller:
    """Holds the frozen teacher and mixes the KD loss into the student's training loss."""

    def __init__(self, student: nn.Module, cfg: DistillationConfig) -> None:
        self.cfg = cfg
        self.teacher = _load_teacher(cfg.teacher, student).eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self._captured: tuple[Any, Any, torch.Tensor] | None = None
        self._hook = student.register_forward_hook(self._capture, with_kwargs=True)
        self.last: dict[str, float] = {}
        self._hidden: dict[str, torch.Tensor] = {}
        self._hidden_hooks = []
        if cfg.loss == "kl_mse":  # the last hidden state: what each model's output layer takes in
            for who, model in (("student", student), ("teacher", self.teacher)):
                # the model itself or the Hugging Face model it wraps (a LightningModule's ``net``)
                hf = next((m for m in model.modules() if hasattr(m, "get_output_embeddings")), None)
                head = hf.get_output_embeddings() if hf is not None else None
                if head is None:
                    raise ConfigError(
                        f"distillation loss 'kl_mse' needs the {who}'s output layer (Hugging Face "
                        f"get_output_embeddings), which {type(model).__name__} does not name; use loss 'kl' or 'jsd'."
                    )
                self._hidden_hooks.append(head.register_forward_pre_hook(
                    lambda mod, args, who=who: self._hidden.__setitem__(who, args[0])))  # fmt: skip

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if module.training:
            self._captured = (args, kwargs, _logits(output))

    def teacher_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.teacher.parameters())

    def mix(self, lm_loss: torch.Tensor) -> torch.Tensor:
        """The step's loss given the student's LM loss (uses the student forward just captured)."""
        if self._captured is None:
            raise RuntimeError(
                "QAD: no student forward in training mode was captured in this step. The student must run its forward "
                "in train mode: a model put in .eval() before fit stays in eval mode under Lightning 2.x (it keeps "
                "submodules' modes), so call model.train() before trainer.fit."
            )
        args, kwargs, student_logits = self._captured
        self._captured = None
        dev = student_logits.device
        if next(self.teacher.parameters()).device != dev:
            self.teacher.to(dev)
        with torch.no_grad():
            teacher_logits = _logits(self.teacher(*args, **kwargs))
        kd = kd_loss(student_logits, teacher_logits, self.cfg.temperature, self.cfg.loss)
        self.last = {"kd": float(kd.detach()), "lm": float(lm_loss.detach())}
        if self.cfg.loss == "kl_mse":
            mse = hidden_mse(self._hidden.pop("student"), self._hidden.pop("teacher"))
            self.last["hidden_mse"] = float(mse.detach())
            kd = kd + self.cfg.hidden_weight * mse
        a = self.cfg.alpha
        return a * kd + (1.0 - a) * lm_loss if a < 1.0 else kd

    def remove(self) -> None:
        self._hook.remove()
        for h in self._hidden_hooks:
            h.remove()
