"""Add FP4 QAT to any NeMo 2 recipe (``llm.<model>.finetune_recipe(...)`` / ``pretrain_recipe``)."""

from __future__ import annotations

from typing import Any

from ..qat.config import QATConfig

__all__ = ["with_fp4_qat"]


def with_fp4_qat(
    recipe: Any,
    policy: str | dict = QATConfig.policy,
    schedule: str | dict = QATConfig.schedule,
    calibration: int | dict = QATConfig.calibration,
    distillation: bool | dict | None = QATConfig.distillation,
    monitor: bool | dict = False,
) -> Any:
    """Append ``NeMoFP4QATCallback`` (and optionally ``QuantizationMonitor``) to ``recipe.trainer``'s
    callbacks as ``run.Config`` objects, so the recipe stays serializable for NeMo-Run, and make the recipe's
    ``AutoResume`` a :class:`~nemo_fp4qat.nemo.QATAutoResume` (same arguments: it also resumes a run killed
    while writing its first checkpoint). Returns the recipe (changed in place). The arguments are checked now
    (:class:`QATConfig`), not when the job starts."""
    import nemo_run as run
    from nemo.lightning import AutoResume

    from ..lightning.monitor import QuantizationMonitor
    from .callback import NeMoFP4QATCallback

    QATConfig(policy=policy, schedule=schedule, calibration=calibration, distillation=distillation)
    trainer = recipe.trainer
    callbacks = list(trainer.callbacks or [])
    callbacks.append(
        run.Config(
            NeMoFP4QATCallback, policy=policy, schedule=schedule, calibration=calibration, distillation=distillation
        )
    )
    if monitor:
        callbacks.append(run.Config(QuantizationMonitor, **(monitor if isinstance(monitor, dict) else {})))
    trainer.callbacks = callbacks
    resume = getattr(recipe, "resume", None)
    if isinstance(resume, run.Config) and resume.__fn_or_cls__ is AutoResume:
        import fiddle as fdl

        from .resume import QATAutoResume

        fdl.update_callable(resume, QATAutoResume)
    return recipe
