"""QAD inside a megatron-core ``GPTModel``: the per-token KL takes the cross entropy's place.

A megatron-core ``GPTModel`` given labels returns the per-token cross entropy from its
``compute_language_model_loss``; the front ends (NeMo 2's ``MaskedTokenLossReduction``, Megatron-Bridge's
``masked_next_token_loss``) then reduce it over the loss mask, across micro-batches and data-parallel ranks.
Replacing that one method keeps every front end's reduction, logging and gradient path as they are, and the
loss they report is the distillation loss. The teacher runs on the inputs the student's forward received.

Under tensor parallelism the student and the teacher (sharded alike: a copy on the same ranks, or a checkpoint
loaded at the run's shape) return vocabulary-parallel logits, which are never gathered: modelopt's
``LogitsKLLoss`` (what NeMo's ``llm.distill`` and Megatron-Bridge's distillation use) forms the softmax
denominators across the tensor-parallel group and returns each rank's share of the KL; the shares are summed
across the group the way Bridge's ``_mask_loss`` does (an all-reduce outside autograd), so every rank holds the
whole per-token KL, as it holds the whole cross entropy, and back-propagates its own vocabulary slice.

Under pipeline parallelism the teacher is staged like the student (a copy of each stage on its rank, or a
checkpoint loaded at the run's shape): every training forward of a student stage runs the teacher's same stage
first, on the hidden states the previous teacher stage sent for that micro-batch, and sends its own on, on a
process group of its own (:class:`~nemo_fp4qat.qat.parallel.pipeline.StagedForward`), so the schedule's
point-to-point traffic is the student's alone; the last stage holds the teacher's logits when the student's
loss is computed. The front ends call :meth:`MegatronDistiller.flush` when a step's schedule is over.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from nemo_fp4qat.qat.distillation.distiller import DistillationConfig
from nemo_fp4qat.specs import ConfigError

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


def _teacher_forward(teacher: nn.Module, inputs: tuple[tuple, dict]) -> Any:
    args, kwargs = inputs
    return teacher(*args, **kwargs)


def _staged_teacher(student: nn.Module) -> Any:
    """The teacher's stage forward under pipeline parallelism (its process group created: a collective, every
    rank builds its distiller together), ``None`` without it."""
    from nemo_fp4qat.qat.parallel.pipeline import StagedForward, pipeline_world_size

    if pipeline_world_size() == 1:
        return None
    staged = StagedForward(_teacher_forward)
    staged.setup()
    return staged


def require_megatron_loss(cfg: DistillationConfig | None) -> None:
    """Refuse a distillation loss the megatron front ends do not run, naming the one they do."""
    if cfg is not None and cfg.loss != "kl":
        raise ConfigError(
            f"distillation loss {cfg.loss!r} runs on the Lightning / Hugging Face front end; the megatron front ends "
            "(NeMo 2, Megatron-Bridge) distil with modelopt's LogitsKLLoss: use loss 'kl'."
        )


class MegatronDistiller:
    """Puts ``alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE`` per token in place of the megatron-core
    student's cross entropy (validation forwards, which are not in training mode, keep the cross entropy).

    Args:
        student: the megatron-core ``GPTModel`` being trained (unwrapped from DDP).
        teacher: a frozen model taking the same inputs and returning ``[b, s, vocab]`` logits without labels
            (vocabulary-parallel like the student's under tensor parallelism).
        cfg: alpha and temperature.
    """

    def __init__(self, student: nn.Module, teacher: nn.Module, cfg: DistillationConfig) -> None:
        from modelopt.torch.distill.plugins.megatron import LogitsKLLoss

        require_megatron_loss(cfg)
        self.cfg = cfg
        self._kl = LogitsKLLoss(student.config, temperature=cfg.temperature)
        self._tp = int(student.config.tensor_model_parallel_size or 1)
        self.teacher = teacher  # a plain attribute: never part of the student's state dict or optimizer
        self._student = student
        self._inputs: tuple[tuple, dict] | None = None
        self._teacher_logits: torch.Tensor | None = None
        self._staged = _staged_teacher(student)
        self._hook = student.register_forward_pre_hook(self._capture, with_kwargs=True)
        self._saved = student.__dict__.get("compute_language_model_loss", _MISSING)
        student.compute_language_model_loss = self._make_loss(student.compute_language_model_loss)

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training:
            return
        inputs = (args, {k: v for k, v in kwargs.items() if k not in _NOT_TEACHER_INPUTS})
        if self._staged is None:
            self._inputs = inputs  # the teacher runs when the loss is computed
            return
        # a stage's input is the hidden states the schedule set on the student's decoder (none on the first stage)
        received = module.decoder.input_tensor
        shape = tuple(received.shape) if received is not None else None
        with torch.no_grad():
            out = self._staged(self.teacher, inputs, input_shape=shape)
        if module.post_process:
            self._teacher_logits, self._inputs = out, inputs

    def flush(self) -> None:
        """Wait for the teacher's hidden states sent to the next stage (at a step's end, when the schedule is over;
        nothing to do without pipeline parallelism)."""
        if self._staged is not None:
            self._staged.flush()

    def teacher_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.teacher.parameters())

    def _make_loss(self, original: Any) -> Any:
        def compute_language_model_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            if self._inputs is None:  # not a training forward (e.g. validation): plain cross entropy
                return original(labels, logits)
            args, kwargs = self._inputs
            self._inputs, teacher_logits = None, self._teacher_logits
            self._teacher_logits = None
            if teacher_logits is None:
                with torch.no_grad():
                    teacher_logits = self.teacher(*args, **kwargs)  # [b, s, v] without labels
            kd = self.kd_per_token(logits, teacher_logits.transpose(0, 1))  # [b, s]
            a = self.cfg.alpha
            return a * kd + (1.0 - a) * original(labels, logits) if a < 1.0 else kd

        return compute_language_model_loss

    def kd_per_token(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        """``T^2 * KL(p_teacher || p_student)`` per token (``[b, s]``, float32) from ``[s, b, vocab]`` logits,
        vocabulary-parallel under tensor parallelism (the value then summed over the tensor-parallel group)."""
        kd, tp_reduce, _ = self._kl(student_logits, teacher_logits)
        if tp_reduce and self._tp > 1:
            from megatron.core import parallel_state

            torch.distributed.all_reduce(kd, group=parallel_state.get_tensor_model_parallel_group())
        t = self.cfg.temperature
        return kd * (t * t)

    def remove(self) -> None:
        """Take the hook off and give the student its own loss back."""
        self.flush()
        self._hook.remove()
        if self._saved is _MISSING:
            self._student.__dict__.pop("compute_language_model_loss", None)
        else:
            self._student.compute_language_model_loss = self._saved
