"""``QATConfig``: what a QAT run is, with its defaults defined once.

Every entry point builds one: :class:`~nemo_fp4qat.FP4QATCallback` (and so the mixin and the NeMo
callback), :func:`nemo_fp4qat.nemo.with_fp4_qat` and the NeMo-Run ``fp4qat(...)`` factory take their
argument defaults from this class, so a run configured through any of them starts from the same
policy, schedule and calibration. The fields keep the specs as given (preset names, YAML paths,
dicts), so the config stays serializable for NeMo-Run; ``__post_init__`` resolves each once to fail
before training with an error that names the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_fp4qat.numerics.cpu_backend import CUDA_NVFP4_KERNELS
from nemo_fp4qat.qat.calibration.calibrate import CalibrationConfig
from nemo_fp4qat.qat.calibration.scale_levers import LearnedScalesConfig, require_levers, uses_static_weights
from nemo_fp4qat.qat.deploy_precision import AUTO, DeployPrecision
from nemo_fp4qat.qat.distillation.distiller import DistillationConfig
from nemo_fp4qat.qat.policy.rules import LayerPolicy
from nemo_fp4qat.qat.schedule import PrecisionSchedule
from nemo_fp4qat.specs import ConfigError

__all__ = ["QATConfig", "check_levers"]


def check_levers(
    calibration: CalibrationConfig, learned: LearnedScalesConfig | None, schedule: PrecisionSchedule
) -> None:
    """Refuse combinations of the scale levers this plugin cannot run, naming the fix."""
    if learned is not None:
        require_levers(f"learned_scales={learned.mode!r}")
        if calibration.gptq is not None:
            raise ConfigError(
                f"learned_scales={learned.mode!r} with calibration gptq: GPTQ rounds the weights on the calibrated "
                "scales, which LSQ then trains apart; use one of them (gptq=None, or learned_scales=None)."
            )
        if calibration.act_scale != "max":
            raise ConfigError(
                f"learned_scales={learned.mode!r} with calibration act_scale={calibration.act_scale!r}: modelopt "
                "calibrates LSQ and activation headroom as two algorithms that each recalibrate the weights; use "
                "one of them (act_scale='max', or learned_scales=None)."
            )
    if uses_static_weights(calibration.weight_scale, calibration.act_scale, learned) and len(schedule.stages) > 1:
        raise ConfigError(
            f"Static or learned NVFP4 weight scales (weight_scale={calibration.weight_scale!r}, act_scale="
            f"{calibration.act_scale!r}, learned_scales={None if learned is None else learned.mode!r}) are set once "
            "by calibration and run with the 'direct' schedule; a schedule that switches formats mid-run would "
            "drop them. Use schedule='direct', or the 'max' / 'search' weight scales."
        )


@dataclass
class QATConfig:
    """One QAT run's configuration.

    Attributes:
        policy: preset name, YAML path, dict or :class:`LayerPolicy`. The default policy deploys on
            TensorRT-LLM (FP8 attention, NVFP4 MLP, full-precision embeddings/output/norms).
        schedule: preset name (``"direct"``, ``"progressive"``), YAML path, dict or
            :class:`PrecisionSchedule`. ``"direct"`` by default: starting from the PTQ'd model at the
            target formats is what measured best here and in NVIDIA's QAD recipe.
        calibration: sample count, dict or :class:`CalibrationConfig` (default: its sample count).
        distillation: ``None`` (plain QAT), ``True``/``"qad"`` (KL to the model before quantization),
            a dict or a :class:`DistillationConfig`.
        share_fused_amax: one amax for q/k/v and gate/up siblings (TensorRT-LLM requires it).
        log_every_n_steps: how often per-group bits are logged.
        export_dir: export the trained model there at the end of training.
        export: export options (kind, runtime, tensor_parallel ...), dict or ``ExportConfig``.
        cuda_nvfp4_kernel: NVFP4 fake quant of CUDA tensors during the run: ``"exact"`` (a Triton kernel that
            rounds as modelopt's exporter does, so the trained weights are the deployed ones), ``"modelopt"``
            (modelopt's own Triton kernel), or ``None``: ``NEMO_FP4QAT_CUDA_NVFP4``, else ``"exact"``. CPU
            tensors always use the exact CPU kernels.
        learned_scales: learned NVFP4 weight block scales (modelopt's LSQ): ``None`` (off), ``"post"``,
            ``"dual"``, ``"scale_only"`` or a dict /
            :class:`~nemo_fp4qat.qat.calibration.scale_levers.LearnedScalesConfig` with its learning rate (``{"mode":
            "post", "lr": 1e-4}``); needs modelopt >= 0.46 and the ``direct`` schedule.
        deploy_dtype: ``"float16"`` or ``"bfloat16"``: a float32 run trains its unquantized weights (embeddings,
            norms, 16-bit linears) rounded to the dtype its export writes them in, straight-through, so the
            checkpoint holds what trained (:mod:`~nemo_fp4qat.qat.deploy_precision`); ``"auto"`` (default): the
            dtype of the end-of-fit export (``export_dir``) where a float32 model's export holds 16-bit tensors (an
            engine's checkpoint: float16), else off; ``None``: off. Lightning / Hugging Face models.

    Raises:
        ConfigError: any field the plugin cannot use (resolved once here: unknown presets, YAML files, fields,
            formats, a schedule that does not end in the policy's formats), naming the field and the fix.

    Example:
        >>> cfg = QATConfig(policy="default", schedule="direct", distillation="qad", export_dir="out/qnemo")
        >>> FP4QATCallback.from_config(cfg); with_fp4_qat(recipe, config=cfg)  # doctest: +SKIP
    """

    policy: Any = "default"
    schedule: Any = "direct"
    calibration: Any = CalibrationConfig.num_samples
    distillation: Any = None
    share_fused_amax: bool = True
    log_every_n_steps: int = 1
    export_dir: str | None = None
    export: Any = None
    cuda_nvfp4_kernel: str | None = None
    learned_scales: Any = None
    deploy_dtype: str | None = "auto"

    def __post_init__(self) -> None:
        policy = LayerPolicy.resolve_spec(self.policy)
        schedule = PrecisionSchedule.resolve_spec(self.schedule)
        schedule.validate_for(policy.target_format)
        calibration = CalibrationConfig.resolve_spec(self.calibration)
        learned = LearnedScalesConfig.resolve_spec(self.learned_scales)
        check_levers(calibration, learned, schedule)
        DistillationConfig.resolve_spec(self.distillation)
        if self.cuda_nvfp4_kernel is not None and self.cuda_nvfp4_kernel not in CUDA_NVFP4_KERNELS:
            raise ValueError(
                f"cuda_nvfp4_kernel={self.cuda_nvfp4_kernel!r}: use one of {list(CUDA_NVFP4_KERNELS)} ('exact' trains "
                "with the exporter's rounding, 'modelopt' with modelopt's own Triton kernel)"
            )
        if self.deploy_dtype not in (None, AUTO):
            DeployPrecision(self.deploy_dtype)  # refuses another dtype by name
        if not isinstance(self.share_fused_amax, bool):
            raise ValueError(f"share_fused_amax must be True or False, got {self.share_fused_amax!r}")
        if isinstance(self.log_every_n_steps, bool) or not isinstance(self.log_every_n_steps, int):
            raise ValueError(f"log_every_n_steps must be a positive int, got {self.log_every_n_steps!r}")
        if self.log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be a positive int, got {self.log_every_n_steps!r}")
