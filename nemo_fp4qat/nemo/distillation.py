"""QAD on the NeMo path: a frozen teacher restored from the base NeMo checkpoint teaches the quantized model.

The Lightning path's :class:`~nemo_fp4qat.qat.distillation.distiller.Distiller` mixes a KD term into the loss a
``training_step`` returns. NeMo's ``training_step`` returns megatron-core's per-token cross entropy instead,
so the KL takes the cross entropy's place inside the megatron-core model
(:class:`~nemo_fp4qat.qat.distillation.megatron.MegatronDistiller`, shared with the Megatron-Bridge front end).

The teacher is built the way NeMo's own ``llm.distill`` builds one (``teacher_provider``: the model config's
``configure_model`` and the checkpoint's sharded weights), from the base checkpoint a recipe restores with
``RestoreConfig``, a path given as ``DistillationConfig.teacher``, or the one saved in a resumed run's callback
state. Without any, a fresh run copies the student as restored, before calibration, with its quantizers off.
Under tensor parallelism the teacher is sharded like the student (``teacher_provider`` loads the checkpoint at
the run's shape; a copy stays on the same ranks) and the KL is taken over the vocabulary-parallel logits; under
pipeline parallelism each rank's teacher is its stage (``configure_model`` builds the stage the rank holds) and
runs beside the student's stage.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..qat.distillation.megatron import MegatronDistiller, freeze, frozen_copy

__all__ = ["MegatronDistiller", "build_teacher"]


def build_teacher(pl_module: Any, trainer: Any, student: nn.Module, path: str | None) -> nn.Module:
    """The frozen teacher: restored from the NeMo checkpoint at ``path`` (NeMo's ``teacher_provider``), or
    a copy of ``student`` as it stands, quantizers off. The RNG is left as it was (data order unchanged)."""
    if path is None:
        return frozen_copy(student)
    from nemo.collections.llm.modelopt.distill.utils import teacher_provider

    with torch.random.fork_rng(devices=[]):
        teacher = teacher_provider(pl_module.config, str(path), pl_module.tokenizer, trainer)
    return freeze(teacher, like=student)
