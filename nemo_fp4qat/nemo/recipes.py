"""Add FP4 QAT to any NeMo 2 recipe (``llm.<model>.finetune_recipe(...)`` / ``pretrain_recipe``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..qat.config import QATConfig
from ..specs import from_fields

__all__ = ["with_fp4_qat"]


def with_fp4_qat(
    recipe: Any,
    policy: Any = QATConfig.policy,
    schedule: Any = QATConfig.schedule,
    calibration: Any = QATConfig.calibration,
    distillation: Any = QATConfig.distillation,
    share_fused_amax: bool = QATConfig.share_fused_amax,
    log_every_n_steps: int = QATConfig.log_every_n_steps,
    export_dir: str | None = QATConfig.export_dir,
    export: Any = QATConfig.export,
    cuda_nvfp4_kernel: str | None = QATConfig.cuda_nvfp4_kernel,
    learned_scales: Any = QATConfig.learned_scales,
    deploy_dtype: str | None = QATConfig.deploy_dtype,
    monitor: bool | dict = False,
    config: QATConfig | dict | None = None,
) -> Any:
    """Add FP4 QAT to a NeMo 2 recipe.

    Appends ``NeMoFP4QATCallback`` (and optionally ``QuantizationMonitor``) to ``recipe.trainer``'s callbacks as
    ``run.Config`` objects, so the recipe stays serializable for NeMo-Run, and makes the recipe's ``AutoResume`` a
    :class:`~nemo_fp4qat.nemo.QATAutoResume` (it also resumes a run killed while writing its first checkpoint).

    Args:
        recipe: a NeMo 2 recipe (``llm.<model>.finetune_recipe(...)`` / ``pretrain_recipe``), changed in place.
        policy, schedule, calibration, distillation, share_fused_amax, log_every_n_steps, export_dir, export,
            cuda_nvfp4_kernel, learned_scales, deploy_dtype: the :class:`QATConfig` fields (``deploy_dtype`` is
            refused on NeMo's megatron-core models).
        monitor: ``True`` or a dict of ``QuantizationMonitor`` arguments to add the monitor.
        config: a whole :class:`QATConfig` (or a dict of its fields) instead of the field arguments.

    Returns:
        The recipe.

    Raises:
        ConfigError: a bad field, now rather than when the job starts.

    Example:
        >>> recipe = with_fp4_qat(llm.llama3_8b.finetune_recipe(...), policy="default", distillation=True)
    """
    import nemo_run as run
    from nemo.lightning import AutoResume

    from ..lightning.monitor_callback import QuantizationMonitor
    from ..qat.deploy_precision import refuse_deploy_dtype
    from .callback import NeMoFP4QATCallback

    if config is None:
        config = QATConfig(policy=policy, schedule=schedule, calibration=calibration, distillation=distillation,
                           share_fused_amax=share_fused_amax, log_every_n_steps=log_every_n_steps,
                           export_dir=export_dir, export=export, cuda_nvfp4_kernel=cuda_nvfp4_kernel,
                           learned_scales=learned_scales, deploy_dtype=deploy_dtype)  # fmt: skip
    elif not isinstance(config, QATConfig):
        config = from_fields(QATConfig, config, "QATConfig")
    refuse_deploy_dtype(config.deploy_dtype)
    # only what differs from the defaults goes into the recipe (what a reader of the job's config sees)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(QATConfig)}
    changed = {k: v for k, v in fields.items() if v != getattr(QATConfig(), k)}
    trainer = recipe.trainer
    callbacks = list(trainer.callbacks or [])
    callbacks.append(run.Config(NeMoFP4QATCallback, **changed))
    if monitor:
        callbacks.append(run.Config(QuantizationMonitor, **(monitor if isinstance(monitor, dict) else {})))
    trainer.callbacks = callbacks
    resume = getattr(recipe, "resume", None)
    if isinstance(resume, run.Config) and resume.__fn_or_cls__ is AutoResume:
        import fiddle as fdl

        from .resume import QATAutoResume

        fdl.update_callable(resume, QATAutoResume)
    return recipe
