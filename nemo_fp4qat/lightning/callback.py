"""``FP4QATCallback``: FP4 QAT as one Lightning callback.

Hook order (Lightning 2.4 ``Trainer._run``): ``setup`` -> ``configure_model`` -> checkpoint restore
-> strategy set-up (DDP wrap, device) -> ``on_train_start`` -> per batch ``on_train_batch_start``.

* ``setup``: insert quantizers per policy (after ``configure_model`` if the module builds its layers
  there). When resuming, the quantizers are rebuilt from the checkpoint's ``modelopt_state`` first
  so Lightning can load their amax buffers with the weights.
* ``on_train_start``: collect calibration samples (RNG state preserved, so the training data order
  is unchanged) and calibrate; all ranks end with the same amax.
* ``on_train_batch_start``: apply the precision schedule for ``trainer.global_step`` and log the
  bits of each layer group.
* ``state_dict``/``on_save_checkpoint``: schedule progress, ``modelopt_state`` and the calibration
  samples, so a resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ..numerics.cpu_backend import set_cuda_nvfp4_kernel
from ..numerics.weight_reuse import WeightReuse, clear_weight_reuse
from ..qat.calibration.calibrate import collect_batches
from ..qat.calibration.scale_levers import learned_scale_parameters
from ..qat.config import QATConfig
from ..qat.controller import QATController
from ..qat.deploy_precision import AUTO, DEPLOY_DTYPES, DeployPrecision
from ..qat.distillation.distiller import DistillationConfig, Distiller
from ..qat.policy.rules import is_quantizable_linear
from ..specs import from_fields
from .patches import MethodPatches

__all__ = ["CHECKPOINT_KEY", "FP4QATCallback"]

CHECKPOINT_KEY = "nemo_fp4qat"
log = logging.getLogger("nemo_fp4qat")


def _modelopt_converted(module: nn.Module) -> bool:
    import modelopt.torch.opt as mto

    return mto.ModeloptStateManager.is_converted(module)


def _default_export_kind(module: nn.Module) -> str:
    """The end-of-fit export's kind when none is given: unified HF for a Hugging Face model, else TensorRT-LLM."""
    return "hf" if hasattr(module, "save_pretrained") else "trtllm"


class FP4QATCallback(pl.Callback):
    """Quantization-aware training in FP4 (and friends) with layer policies and precision schedules.

    Args:
        policy: preset (``"default"``, ``"fp_embeddings"``, ``"aggressive_mlp"``,
            ``"conservative_attention"``, ``"trtllm_mixed"``), YAML path, dict or LayerPolicy.
        schedule: preset (``"direct"``, ``"progressive"``), YAML path, dict or PrecisionSchedule.
        calibration: CalibrationConfig, dict, or a sample count.
        calibration_data: iterable of batches to calibrate on (default: the train dataloader).
        forward_fn: ``forward_fn(model, batch)`` for calibration forwards (default: ``model(batch)``
            / ``model(**batch)`` / ``model(batch[0])``).
        module_getter: returns the ``nn.Module`` to quantize from the LightningModule (default: the
            LightningModule itself).
        share_fused_amax: give q/k/v and gate/up siblings one amax.
        log_every_n_steps: how often the per-group bits are logged.
        distillation: quantization-aware distillation: ``True``, a dict or a
            :class:`DistillationConfig` (alpha, temperature). A frozen copy of the model taken before
            quantization is the teacher; the training loss becomes the KD/LM mix.
        export_dir: when set, export the trained model there at the end of training (rank 0), through
            :func:`nemo_fp4qat.export.export_checkpoint` (validated, atomic).
        export: :class:`~nemo_fp4qat.export.ExportConfig` or dict (kind ``"hf"``/``"trtllm"``,
            runtime, tensor_parallel ...); default: a unified HF checkpoint for TensorRT-LLM.
        cuda_nvfp4_kernel: ``"exact"`` (NVFP4 on CUDA tensors rounds as the exporter does), ``"modelopt"``
            (modelopt's own Triton kernel), or ``None`` (default: ``NEMO_FP4QAT_CUDA_NVFP4``, else exact); set
            process-wide from setup to teardown.
        learned_scales: learned NVFP4 weight block scales (modelopt's LSQ; ``"post"``, ``"dual"``,
            ``"scale_only"`` or ``{"mode": ..., "lr": ...}``): the scales join the optimizer as their own
            parameter group after calibration (one process).
        deploy_dtype: ``"float16"`` / ``"bfloat16"``: a float32 model trains its unquantized weights rounded to the
            dtype its export holds them in (straight-through), so the checkpoint holds what trained; ``"auto"``
            (default): the end-of-fit export's dtype where ``export_dir`` is set and that export holds a float32
            model's unquantized tensors in 16 bits (the engines' checkpoints), else off; ``None``: off.

    Raises:
        ConfigError: a bad or unknown field (a :class:`QATConfig` is built here, before any training), or an export
            runtime the policy does not deploy to.

    Example:
        >>> trainer = pl.Trainer(callbacks=[FP4QATCallback(policy="default", distillation="qad", export_dir="out")])
        >>> cb = FP4QATCallback.from_config(QATConfig(policy="aggressive_mlp", schedule="progressive"))
    """

    def __init__(
        self,
        policy: Any = QATConfig.policy,
        schedule: Any = QATConfig.schedule,
        calibration: Any = QATConfig.calibration,
        calibration_data: Iterable[Any] | None = None,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        module_getter: Callable[[pl.LightningModule], nn.Module] | None = None,
        share_fused_amax: bool = QATConfig.share_fused_amax,
        log_every_n_steps: int = QATConfig.log_every_n_steps,
        distillation: Any = QATConfig.distillation,
        export_dir: str | None = QATConfig.export_dir,
        export: Any = QATConfig.export,
        cuda_nvfp4_kernel: str = QATConfig.cuda_nvfp4_kernel,
        learned_scales: Any = QATConfig.learned_scales,
        deploy_dtype: str | None = QATConfig.deploy_dtype,
    ) -> None:
        super().__init__()
        self.config = QATConfig(
            policy=policy,
            schedule=schedule,
            calibration=calibration,
            distillation=distillation,
            share_fused_amax=share_fused_amax,
            log_every_n_steps=log_every_n_steps,
            export_dir=export_dir,
            export=export,
            cuda_nvfp4_kernel=cuda_nvfp4_kernel,
            learned_scales=learned_scales,
            deploy_dtype=deploy_dtype,
        )
        self.controller = QATController.from_config(self.config, forward_fn=forward_fn)
        self.deploy_precision = DeployPrecision(deploy_dtype) if deploy_dtype not in (None, AUTO) else None
        self.export_dir = export_dir
        self._train_ended = False  # on_train_end ran in this fit (see on_fit_end)
        self.export = self._check_export(export)
        self.calibration_data = calibration_data
        self.module_getter = module_getter
        self.log_every_n_steps = log_every_n_steps
        self.distillation = DistillationConfig.resolve_spec(distillation)
        self.distiller: Distiller | None = None
        self._prepared = False
        self._kernel_before: str | None = None
        self.weight_reuse = WeightReuse()  # each weight's fake quant reused across an optimizer step's micro-batches
        self.patches = MethodPatches()

    @classmethod
    def from_config(cls, config: QATConfig | dict[str, Any], **hooks: Any) -> FP4QATCallback:
        """The callback for a :class:`QATConfig` (or a dict of its fields); ``hooks`` are the
        non-serializable arguments (``calibration_data``, ``forward_fn``, ``module_getter``)."""
        config = config if isinstance(config, QATConfig) else from_fields(QATConfig, config, "QATConfig")
        return cls(**vars(config), **hooks)

    def _check_export(self, export: Any) -> Any:
        """Refuse a bad export configuration now, not after training: unknown kind / runtime / dtype, or a
        runtime the policy does not deploy to. Without an explicit runtime, the policy's is used."""
        if export is None:
            return None
        from ..export import ExportConfig

        if isinstance(export, ExportConfig):
            cfg = export
        else:
            d = dict(export)
            d.setdefault("runtime", self.controller.policy.runtime)
            cfg = from_fields(ExportConfig, d, "export")
        if cfg.runtime == "trtllm" and self.controller.policy.runtime != "trtllm":
            raise ValueError(
                f"export runtime 'trtllm' with policy {self.controller.policy.name!r}, which TensorRT-LLM cannot run "
                f"(its runtime is {self.controller.policy.runtime!r}): use a TensorRT-LLM policy (e.g. 'default') or "
                f"export={{'runtime': {self.controller.policy.runtime!r}, ...}} (or 'pytorch' for this plugin's own "
                "server)."
            )
        return cfg

    # --- helpers ------------------------------------------------------------------------------
    def target_module(self, pl_module: pl.LightningModule) -> nn.Module:
        return self.module_getter(pl_module) if self.module_getter else pl_module

    def _has_linears(self, pl_module: pl.LightningModule) -> bool:
        try:
            module = self.target_module(pl_module)
        except (RuntimeError, AttributeError):  # e.g. NeMo builds its megatron module in configure_model
            return False
        return any(is_quantizable_linear(m) for m in module.modules())

    def prepare(self, trainer: pl.Trainer | None, pl_module: pl.LightningModule) -> None:
        """Insert quantizers per policy, and arrange for a resumed checkpoint to reconfigure them."""
        if self._prepared:
            return
        if self.distillation is not None:
            # the teacher is the model as it is now, before any quantizer exists
            self.distiller = Distiller(self.target_module(pl_module), self.distillation)
            self._wrap_training_step(pl_module)
            rank_zero_info(f"nemo_fp4qat: QAD teacher holds {self.distiller.teacher_bytes() / 2**20:.0f} MiB")
        module = self.target_module(pl_module)
        if trainer is not None and trainer.ckpt_path and _modelopt_converted(module):
            # Resuming, and the framework has already rebuilt the quantizers from the checkpoint's
            # modelopt_state (NeMo's GPTModel.configure_model does): quantizing again would reset
            # them to step 0 and drop their amax buffers before the weights load. Adopt them; the
            # controller state comes with the callback state.
            table = self.controller.resolve(module)
        else:
            table = self.controller.prepare(module)
        # the end-of-fit export's kind (by default: unified HF for a Hugging Face model, else TensorRT-LLM)
        kind = self.export.kind if self.export is not None else _default_export_kind(module)
        if self.export_dir and kind == "trtllm":
            from ..export.exporters import refuse_moe_trtllm

            refuse_moe_trtllm(module)  # before training, not after it
        rank_zero_info(f"nemo_fp4qat: policy {self.controller.policy.name!r}\n{table.format_table()}")
        self._prepared = True

    def _wrap_training_step(self, pl_module: pl.LightningModule) -> None:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def training_step(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                lm = out["loss"] if isinstance(out, dict) else out
                loss = self.distiller.mix(lm)  # type: ignore[union-attr]
                pl_module.log_dict({f"qad/{k}": v for k, v in self.distiller.last.items()}, on_step=True, batch_size=1)  # type: ignore[union-attr]
                return {**out, "loss": loss} if isinstance(out, dict) else loss

            return training_step

        self.patches.patch(pl_module, "training_step", make)

    def restore_from_checkpoint(self, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> bool:
        """Reconfigure quantizers to a checkpoint's saved state (before Lightning loads its weights)."""
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            return False
        self.sync_to_saved(pl_module, saved, checkpoint.get("state_dict", {}))
        rank_zero_info("nemo_fp4qat: quantizers reconfigured from the checkpoint being resumed")
        return True

    def sync_to_saved(self, root: nn.Module, saved: dict[str, Any], state_dict: dict[str, Any]) -> None:
        """Apply this callback's checkpoint payload: schedule state, quantizer formats and buffers
        (``state_dict`` keys relative to ``root``), calibration samples."""
        self.controller.sync_to_checkpoint(root, saved["controller"], state_dict)
        self.controller.calib_batches = saved.get("calib_batches", [])

    # --- Lightning hooks ----------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.config.cuda_nvfp4_kernel is not None:
            self._kernel_before = set_cuda_nvfp4_kernel(self.config.cuda_nvfp4_kernel)
        if self.controller.learned_scales is not None and trainer.world_size > 1:
            raise ValueError(
                f"learned_scales={self.controller.learned_scales.mode!r} on {trainer.world_size} processes: the "
                "learned block scales are created at calibration, after Lightning wrapped the model for data "
                "parallelism, so their gradients would not be averaged. Train them on one process, or through "
                "Megatron-Bridge / NeMo, or set learned_scales=None."
            )
        if self.controller.total_steps is None and trainer.max_steps and trainer.max_steps > 0:
            self.controller.total_steps = int(trainer.max_steps)

        # LightningModule.on_load_checkpoint runs before the weights are loaded (callbacks' hooks run
        # after): reconfigure the quantizers there so their amax buffers load with the weights.
        def on_load(original: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
            def on_load_checkpoint_then_restore(checkpoint: dict[str, Any]) -> None:
                original(checkpoint)
                self.restore_from_checkpoint(pl_module, checkpoint)

            return on_load_checkpoint_then_restore

        self.patches.patch(pl_module, "on_load_checkpoint", on_load)
        if self.distiller is not None:
            self._wrap_training_step(pl_module)  # again, when a second fit follows a teardown
        if self._has_linears(pl_module):
            self.prepare(trainer, pl_module)
            return

        # Layers are created in configure_model: quantize right after it runs.
        def configure(original: Callable[[], None]) -> Callable[[], None]:
            def configure_model_then_quantize() -> None:
                original()
                self.prepare(trainer, pl_module)

            return configure_model_then_quantize

        self.patches.patch(pl_module, "configure_model", configure)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Put back every method this callback wrapped (see :mod:`nemo_fp4qat.lightning.patches`), and the CUDA
        NVFP4 kernel setting."""
        self.patches.restore()
        if self.deploy_precision is not None:
            self.deploy_precision.remove()
        self.weight_reuse.stop()
        if self.config.cuda_nvfp4_kernel is not None:
            set_cuda_nvfp4_kernel(self._kernel_before)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A fit that fails calls no ``teardown`` hook (Lightning 2.x): undo this callback's process-wide settings
        (weight reuse, the CUDA kernel choice) and method patches here, so the process goes on as before the run."""
        self.teardown(trainer, pl_module, "fit")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        clear_weight_reuse()  # callbacks that swap in other weights (EMA, SWA) write them through .data

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        clear_weight_reuse()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._on_train_start(trainer, pl_module)
        self.weight_reuse.start()

    def _deploy_precision_of_export(self, module: nn.Module) -> DeployPrecision | None:
        """``deploy_dtype="auto"``: the end-of-fit export's 16-bit dtype for a float32 model's unquantized
        tensors (an engine's checkpoint), else None."""
        if self.config.deploy_dtype != AUTO or not self.export_dir or not hasattr(module, "save_pretrained"):
            return None  # megatron-core modules train in bfloat16 on GPUs and are not hooked (deploy_precision)
        from ..export.exporters import export_dtype

        trained = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
        cfg = self.export or self._check_export({"kind": _default_export_kind(module)})
        target = str(export_dtype(module, cfg)).replace("torch.", "")
        return DeployPrecision(target) if trained == torch.float32 and target in DEPLOY_DTYPES else None

    def _on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ctl = self.controller
        if self.deploy_precision is None:
            self.deploy_precision = self._deploy_precision_of_export(self.target_module(pl_module))
        if self.deploy_precision is not None and not self.deploy_precision.handles:
            # before calibration: the scales are those of the weights the checkpoint will hold
            n = self.deploy_precision.install(self.target_module(pl_module))
            rank_zero_info(f"nemo_fp4qat: {n} modules train their unquantized weights in "
                           f"{str(self.deploy_precision.dtype).replace('torch.', '')} "
                           "(the export's dtype for them)")  # fmt: skip
        if ctl.total_steps is None:
            ctl.total_steps = self._total_steps(trainer)
            if ctl.schedule.needs_total_steps:
                ctl.schedule.boundaries(ctl.total_steps)  # fail early with a clear message
        if ctl.calibrated:
            return
        if not ctl.calib_batches:
            source = self.calibration_data if self.calibration_data is not None else trainer.train_dataloader
            ctl.calib_batches = self._collect(source)
        ctl.calibrate(self.target_module(pl_module))
        self._learned_scales_to_optimizer(trainer, pl_module)
        smoothed = f"; smoothing folded into {len(ctl.smoothed)} inputs first" if ctl.smoothed else ""
        rank_zero_info(
            f"nemo_fp4qat: calibrated on {ctl.calibration.num_samples} samples ({len(ctl.calib_batches)} batches)"
            + smoothed
        )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a resumed run's learned scales exist now (restored with the weights): their parameter group must be in
        # the optimizer before Lightning loads the optimizer's state
        self._learned_scales_to_optimizer(trainer, pl_module)

    def _learned_scales_to_optimizer(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Give the learned block scales (modelopt's LSQ amax parameters) the first optimizer's last parameter group
        (``learned_scales.lr``, no weight decay), once. On a resume they exist before ``configure_optimizers`` and may
        sit in its groups: they are moved out, so the groups match the checkpoint's. A learning-rate scheduler built
        before leaves that group at its own rate."""
        cfg = self.controller.learned_scales
        if cfg is None or not trainer.optimizers:
            return
        learned = learned_scale_parameters(self.target_module(pl_module))
        if not learned:
            return
        opt = trainer.optimizers[0]
        ids = {id(p) for p in learned}
        if any(g.get("nemo_fp4qat_learned_scales") for g in opt.param_groups):
            return
        for g in opt.param_groups:
            g["params"] = [p for p in g["params"] if id(p) not in ids]
        opt.add_param_group({"params": learned, "lr": cfg.lr, "weight_decay": 0.0, "nemo_fp4qat_learned_scales": True})

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        events = self.controller.step(self.target_module(pl_module), step)
        for ev in events:
            rank_zero_info(
                f"nemo_fp4qat: step {step}: {ev['group']} {ev['from']} -> {ev['to']} ({ev['modules']} modules)"
            )
        if step % self.log_every_n_steps == 0 or events:
            metrics = {f"qat/bits_{g}": float(b) for g, b in self.controller.stage_summary().items()}
            if metrics:
                pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1, sync_dist=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weight_reuse.stop()
        ctl = self.controller
        if ctl.table is None:
            return
        self._train_ended = True
        try:
            final = ctl.formats_at(10**12)  # where the schedule ends: every layer in its target format
        except ValueError:  # fractional schedule with an unknown run length
            return
        behind = sorted(m for m, f in ctl.current.items() if final.get(m) != f and not ctl.pins)
        if behind:
            rank_zero_warn(
                f"nemo_fp4qat: training ended before the schedule reached the target formats for {len(behind)} "
                f"modules (e.g. {behind[0]}: {ctl.current[behind[0]]}); the model is not in its deployment "
                "formats. Train longer or start the last stage earlier."
            )
        if self.export_dir:
            self.export_at_end(trainer, pl_module)

    def export_at_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The end-of-training export (``export_dir``), called on every rank: global rank 0 exports."""
        if trainer.is_global_zero:
            self.export_model(pl_module, self.export_dir)

    def owes_export(self, trainer: pl.Trainer) -> bool:
        """At the end of ``fit``: whether this run finished training in an earlier fit but was not exported.

        A run killed while exporting and then resumed is restored from its final checkpoint: Lightning skips
        the training loop and ``on_train_end``, but still ends the fit, so the export it owes happens then.
        """
        trained, self._train_ended = self._train_ended, False
        if trained or not self.export_dir or self.controller.table is None:
            return False
        return bool(trainer.max_steps and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # (after the strategy's teardown: on a GPU run the model is back on the CPU by now)
        if not self.owes_export(trainer) or not trainer.is_global_zero:
            return
        from ..export.atomic import read_manifest, recover_interrupted

        recover_interrupted(self.export_dir)
        if read_manifest(Path(self.export_dir)) is not None:
            rank_zero_info(f"nemo_fp4qat: the run was already complete and exported to {self.export_dir}")
            return
        self.export_model(pl_module, self.export_dir)

    def export_model(self, pl_module: pl.LightningModule, out_dir: str, module: nn.Module | None = None) -> Any:
        """Export the quantized module (see ``export_dir``), or ``module`` when given; returns the export directory."""
        from ..export import export_checkpoint

        module = module if module is not None else self.target_module(pl_module)
        # default: unified HF checkpoint for Hugging Face models, TRT-LLM (qnemo) for megatron-core ones
        cfg = self.export or self._check_export({"kind": _default_export_kind(module)})
        path = export_checkpoint(module, out_dir, cfg, tokenizer=getattr(pl_module, "tokenizer", None))
        rank_zero_info(f"nemo_fp4qat: exported to {path}")
        return path

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.controller.load_state_dict(state_dict)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        import modelopt.torch.opt as mto

        checkpoint[CHECKPOINT_KEY] = {
            "modelopt_state": mto.modelopt_state(self.target_module(pl_module)),
            "controller": self.controller.state_dict(),
            "calib_batches": self.controller.calib_batches,
        }

    # --- internals ----------------------------------------------------------------------------
    @staticmethod
    def _total_steps(trainer: pl.Trainer) -> int | None:
        if trainer.max_steps and trainer.max_steps > 0:
            return int(trainer.max_steps)
        try:
            return int(trainer.estimated_stepping_batches)
        except Exception:  # an infinite or unsized dataloader
            return None

    def _collect(self, source: Iterable[Any]) -> list[Any]:
        # Drawing batches must not shift the RNG streams the training data order depends on.
        cpu_state = torch.get_rng_state()
        py_state = random.getstate()
        try:
            import numpy as np

            np_state = np.random.get_state()
        except ImportError:  # pragma: no cover
            np_state = None
        try:
            cfg = self.controller.calibration
            return collect_batches(source, cfg.num_samples, cfg.seq_len)
        finally:
            torch.set_rng_state(cpu_state)
            random.setstate(py_state)
            if np_state is not None:
                np.random.set_state(np_state)
