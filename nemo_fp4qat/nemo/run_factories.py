"""NeMo-Run CLI factories: FP4 QAT from a YAML override or the command line, no Python needed.

Registered with NeMo-Run through the ``nemo_run.cli`` entry point (``pyproject.toml``), so the
``nemo`` CLI loads it. NeMo-Run 0.11's CLI cannot build callbacks from ``_target_`` dicts (its
parser has no rule for ``lightning.pytorch.Callback``), but it resolves factories, and ``+=``
extends the recipe's callback list with the list a factory returns::

    # conf/nemo_run/fp4qat.yaml
    trainer:
      callbacks+=: fp4qat(policy=trtllm_mixed, schedule=progressive, calibration=256)

    nemo llm finetune --factory llama3_8b --yaml conf/nemo_run/fp4qat.yaml
    nemo llm finetune --factory llama3_8b "trainer.callbacks+=fp4qat(policy=default)"
"""

# No `from __future__ import annotations`: NeMo-Run evaluates the factory's return annotation.
import lightning.pytorch as pl
import nemo_run as run

from ..lightning.monitor_callback import QuantizationMonitor
from ..qat.config import QATConfig
from .callback import NeMoFP4QATCallback

__all__ = ["fp4qat"]


@run.cli.factory
@run.autoconvert
def fp4qat(
    policy: str = QATConfig.policy,
    schedule: str = QATConfig.schedule,
    calibration: int = QATConfig.calibration,
    distillation: str | None = QATConfig.distillation,
    share_fused_amax: bool = QATConfig.share_fused_amax,
    log_every_n_steps: int = QATConfig.log_every_n_steps,
    export_dir: str | None = QATConfig.export_dir,
    export_kind: str = "trtllm",
    export_tensor_parallel: int = 1,
    cuda_nvfp4_kernel: str | None = QATConfig.cuda_nvfp4_kernel,
    learned_scales: str | None = QATConfig.learned_scales,
    deploy_dtype: str | None = QATConfig.deploy_dtype,
    monitor_every_n_steps: int = 0,
) -> list[pl.Callback]:
    """The QAT callback (every :class:`QATConfig` field; ``export`` as ``export_kind`` / ``export_tensor_parallel``,
    which a command line can give), and the quantization monitor when ``monitor_every_n_steps > 0``."""
    qat = NeMoFP4QATCallback(policy=policy, schedule=schedule, calibration=calibration, distillation=distillation,
                             share_fused_amax=share_fused_amax, log_every_n_steps=log_every_n_steps,
                             export_dir=export_dir,
                             export={"kind": export_kind, "tensor_parallel": export_tensor_parallel},
                             cuda_nvfp4_kernel=cuda_nvfp4_kernel, learned_scales=learned_scales,
                             deploy_dtype=deploy_dtype)  # fmt: skip
    monitor = QuantizationMonitor(every_n_steps=monitor_every_n_steps)
    # fiddle's auto_config (run.autoconvert) allows neither if-statements nor builtin calls:
    # repeat the monitor 0 or 1 times (a bool is 0 or 1)
    return [qat] + [monitor] * (monitor_every_n_steps > 0)
