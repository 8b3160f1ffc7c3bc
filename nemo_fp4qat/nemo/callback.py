"""FP4 QAT for NeMo 2 Megatron models (``llm.GPTModel`` & co. trained with ``nl.MegatronStrategy``).

The quantizers must live on the megatron-core module (what NeMo's checkpointing saves
``modelopt_state`` for, and what modelopt's megatron plugin quantizes), not on NeMo's wrappers,
whose names change once the strategy wraps the model in its DDP/Float16 modules. Calibration
forwards use megatron-core's ``GPTModel.forward(input_ids, position_ids, attention_mask)`` on the
batches NeMo's data modules yield (``tokens``, ``position_ids``, ``attention_mask``).
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.utilities import rank_zero_info

from ..lightning.callback import CHECKPOINT_KEY, FP4QATCallback
from ..qat.deploy_precision import refuse_deploy_dtype
from ..qat.distillation.distiller import DistillationConfig
from ..qat.distillation.megatron import require_megatron_loss
from ..qat.parallel.pipeline import every_stage, pipeline_forward, pipeline_world_size, this_stage
from ..qat.parallel.whole_model import alone_on_rank_0, at_size_one, gather_whole_model, sharded_over_ranks

__all__ = ["NeMoFP4QATCallback", "megatron_module", "nemo_gpt_forward"]

_RESTART_HINT = "restore it with RestoreConfig instead of resuming"

_PER_LAYER_KEY = re.compile(r"\.layers\.\d+\.")


def megatron_module(pl_module: nn.Module) -> nn.Module:
    """The megatron-core model inside a NeMo LightningModule, through any strategy wrappers."""
    m = pl_module._modules.get("module")
    if m is None:
        raise RuntimeError(f"{type(pl_module).__name__} has no megatron module yet (configure_model not run).")
    # Walk real child modules only: NeMo's wrappers forward attribute access to the inner model, so
    # hasattr(wrapper, "decoder") is True for them too.
    while "decoder" not in m._modules and "module" in m._modules:
        m = m._modules["module"]
    return m


@contextlib.contextmanager
def _layer_layout_of(module: nn.Module, checkpoint_path: Any) -> Iterator[None]:
    """Load with the checkpoint's layer layout, whatever the quantized model would save.

    Quantizing a megatron model makes modelopt set ``config.hetereogenous_dist_checkpoint`` (one
    checkpoint entry per layer), while a model saved without quantizers stacks its layers
    (``decoder.layers.<name>`` with a layer axis). Fine-tuning with QAT from such a checkpoint, the
    way NeMo recipes restore a base model, would otherwise ask it for per-layer keys it does not have.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.module import MegatronModule
    from nemo.lightning.io.pl import ckpt_to_weights_subdir

    weights = ckpt_to_weights_subdir(checkpoint_path, is_saving=False)
    if not Path(weights, "metadata.json").exists():
        yield
        return
    per_layer = any(_PER_LAYER_KEY.search(k) for k in dist_checkpointing.load_tensors_metadata(str(weights)))
    configs = {id(m.config): m.config for m in module.modules() if isinstance(m, MegatronModule)}
    saved = {k: getattr(c, "hetereogenous_dist_checkpoint", False) for k, c in configs.items()}
    for c in configs.values():
        c.hetereogenous_dist_checkpoint = per_layer
    try:
        yield
    finally:
        for k, c in configs.items():
            c.hetereogenous_dist_checkpoint = saved[k]


def nemo_gpt_forward(model: nn.Module, batch: dict[str, Any]) -> Any:
    """One calibration forward of a megatron-core GPT on a NeMo GPT batch (through every pipeline stage)."""
    inputs = {
        "input_ids": batch["tokens"],
        "position_ids": batch["position_ids"],
        "attention_mask": batch.get("attention_mask"),
    }
    if pipeline_world_size() > 1:
        return pipeline_forward(model, inputs)
    return model(**inputs)


class NeMoFP4QATCallback(FP4QATCallback):
    """:class:`FP4QATCallback` preset for NeMo 2 Megatron GPT models (same arguments).

    ``distillation`` (QAD) here: the teacher is restored from the base checkpoint the recipe's
    ``RestoreConfig`` loads (or ``distillation={"teacher": "/path/to/nemo_ckpt"}``) and its per-token KL
    replaces the cross entropy under NeMo's own loss reduction (:mod:`nemo_fp4qat.nemo.distillation`).
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("module_getter", megatron_module)
        kwargs.setdefault("forward_fn", nemo_gpt_forward)
        # QAD is set up at on_train_start, after NeMo has restored the weights, not with the quantizers
        distillation = DistillationConfig.resolve_spec(kwargs.pop("distillation", None))
        require_megatron_loss(distillation)
        refuse_deploy_dtype(kwargs.get("deploy_dtype"))
        super().__init__(**kwargs)
        self.qad = distillation
        self.qad_teacher_path: str | None = None  # saved with the callback state: a resume rebuilds the teacher
        self.qad_distiller: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from nemo.lightning import MegatronStrategy

        super().setup(trainer, pl_module, stage)
        if stage != "fit" or not isinstance(trainer.strategy, MegatronStrategy):
            return
        self._keep_final_checkpoint_resumable(trainer)

        # MegatronStrategy.load_checkpoint builds the sharded state dict to load from the model as it
        # is: quantizers must already be in the checkpoint's formats, with its amax buffers, or their
        # tensors are never read. Lightning's on_load_checkpoint comes too late for dist-checkpoints.
        def make(original: Any) -> Any:
            def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
                self.match_checkpoint(pl_module, checkpoint_path)
                with _layer_layout_of(self.target_module(pl_module), checkpoint_path):
                    return original(checkpoint_path, *args, **kwargs)

            return load_checkpoint

        self.patches.patch(trainer.strategy, "load_checkpoint", make)

    def _keep_final_checkpoint_resumable(self, trainer: pl.Trainer) -> None:
        """With an end-of-fit export, make NeMo's final checkpoint a full one. By default NeMo's
        ``ModelCheckpoint`` saves it weights-only (``save_optim_on_train_end=False``): no optimizer state and no
        callback state, so a run killed during the export cannot be resumed from it (``AutoResume`` picks it and
        ``MegatronStrategy.load_checkpoint`` fails on the missing optimizer tensors), and even a loadable one
        would not say that the quantizers were calibrated and the schedule finished."""
        from nemo.lightning.pytorch.callbacks import ModelCheckpoint

        if self.export_dir is None:
            return
        for cb in trainer.callbacks:
            if isinstance(cb, ModelCheckpoint) and not cb.save_optim_on_train_end:
                cb.save_optim_on_train_end = True
                rank_zero_info(
                    "nemo_fp4qat: ModelCheckpoint(save_optim_on_train_end=True) so that a run killed while it exports "
                    f"to {self.export_dir} resumes from its final checkpoint (NeMo saves that one weights-only)"
                )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.qad is not None and self.qad_distiller is None:
            self._start_distillation(trainer, pl_module)
        super().on_train_start(trainer, pl_module)

    def _start_distillation(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from .distillation import MegatronDistiller, build_teacher

        assert self.qad is not None
        restore = getattr(trainer.strategy, "restore_config", None)
        path = (
            (str(self.qad.teacher) if self.qad.teacher is not None else None)
            or self.qad_teacher_path
            or (str(restore.path) if restore is not None and getattr(restore, "path", None) else None)
        )
        if path is None and trainer.ckpt_path:
            raise ValueError(
                "distillation (QAD): resuming a run whose teacher was a copy of the model before quantization, which "
                "no checkpoint holds; give the BF16 model as distillation={'teacher': '/path/to/nemo_checkpoint'} "
                "(or start the run from it with RestoreConfig, whose path is then saved for resumes)."
            )
        student = self.target_module(pl_module)
        # the teacher is built from the student's config, which quantization switched to per-layer checkpoint keys
        with _layer_layout_of(student, path) if path else contextlib.nullcontext():
            teacher = build_teacher(pl_module, trainer, student, path)
        self.qad_teacher_path = path
        self.qad_distiller = MegatronDistiller(student, teacher, self.qad)
        source = f"restored from {path}" if path else "a copy of the model before calibration, quantizers off"
        rank_zero_info(
            f"nemo_fp4qat: QAD teacher ({source}) holds {self.qad_distiller.teacher_bytes() / 2**20:.1f} MiB "
            f"(alpha {self.qad.alpha}, T {self.qad.temperature})"
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.qad_distiller is not None:  # the step's schedule is over: every stage received its teacher input
            self.qad_distiller.flush()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.qad_distiller is not None:
            self.qad_distiller.remove()
            self.qad_distiller = None
        super().teardown(trainer, pl_module, stage)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        checkpoint[CHECKPOINT_KEY]["qad_teacher_path"] = self.qad_teacher_path  # read back by match_checkpoint
        checkpoint[CHECKPOINT_KEY] = every_stage(checkpoint[CHECKPOINT_KEY])

    # A dist-checkpoint keeps one common (non-tensor) state dict, rank 0's; under pipeline parallelism each
    # stage has its own quantizers and schedule state, so every stage's goes in, and each takes back its own.
    def state_dict(self) -> dict[str, Any]:
        return every_stage(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(this_stage(state_dict, _RESTART_HINT))

    def sync_to_saved(self, root: nn.Module, saved: dict[str, Any], state_dict: dict[str, Any]) -> None:
        super().sync_to_saved(root, this_stage(saved, _RESTART_HINT), state_dict)

    def export_at_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Under tensor and/or pipeline parallelism the whole model is first assembled on global rank 0 from every
        shard and stage (:func:`~nemo_fp4qat.qat.parallel.whole_model.gather_whole_model`), so the export holds every
        layer whole."""
        if not sharded_over_ranks():
            super().export_at_end(trainer, pl_module)
            return
        import torch.distributed as dist

        def build_whole() -> nn.Module:  # the run's NeMo config at size 1, the vocabulary padded as the run's
            config = at_size_one(copy.deepcopy(pl_module.config))
            return config.configure_model(pl_module.tokenizer, pre_process=True, post_process=True)

        whole = gather_whole_model(build_whole, self.target_module(pl_module), self.controller)
        if whole is not None:
            with alone_on_rank_0():
                self.export_model(pl_module, self.export_dir, module=whole)
        dist.barrier()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not sharded_over_ranks():
            super().on_fit_end(trainer, pl_module)
            return
        # every stage takes part in assembling the model, so every rank decides alike whether an export is owed
        if not self.owes_export(trainer):
            return
        import torch.distributed as dist

        from ..export.atomic import read_manifest, recover_interrupted

        if trainer.is_global_zero:
            recover_interrupted(self.export_dir)
        dist.barrier()
        if read_manifest(Path(self.export_dir)) is None:
            self.export_at_end(trainer, pl_module)

    def export_model(self, pl_module: pl.LightningModule, out_dir: str, module: nn.Module | None = None) -> Any:
        """The deployable artifact at the end of ``fit`` (``export_dir``): a TensorRT-LLM checkpoint (qnemo).

        The same modelopt call NeMo's ``Quantizer.export`` makes (``export_tensorrt_llm_checkpoint`` on
        the megatron-core module), plus what NeMo's route lacks: preflight against the runtime, W4A8
        layers exported with their true amax (they train with 6 x amax, which NeMo's exporter would
        write as-is), validation against the trained model, an atomic directory. The trainer's NeMo
        context goes to ``nemo_context/`` (where ``nemo.export`` rebuilds the tokenizer, as after
        ``llm.ptq``).
        """
        import tempfile

        from nemo.lightning.io.pl import TrainerContext

        from ..export import export_checkpoint

        cfg = self.export or self._check_export({"kind": "trtllm"})
        with tempfile.TemporaryDirectory(prefix="nemo_fp4qat-context-") as ctx:
            TrainerContext.from_trainer(pl_module.trainer).io_dump(Path(ctx), yaml_attrs=["model"])
            module = module if module is not None else self.target_module(pl_module)
            path = export_checkpoint(module, out_dir, cfg, nemo_context=ctx)
        rank_zero_info(f"nemo_fp4qat: exported to {path}")
        return path

    def match_checkpoint(self, pl_module: pl.LightningModule, checkpoint_path: str | Path) -> bool:
        """Reconfigure the quantizers to a NeMo dist-checkpoint before its tensors are loaded."""
        from megatron.core import dist_checkpointing
        from nemo.lightning.io.pl import ckpt_to_weights_subdir

        weights = ckpt_to_weights_subdir(checkpoint_path, is_saving=False)
        if not Path(weights, "common.pt").exists():
            return False
        saved = dist_checkpointing.load_common_state_dict(str(weights)).get(CHECKPOINT_KEY)
        if saved is None:
            return False
        saved = this_stage(saved)
        self.qad_teacher_path = self.qad_teacher_path or saved.get("qad_teacher_path")
        module = self.target_module(pl_module)
        names = dict(module.named_modules())
        buffers: dict[str, torch.Tensor] = {}
        for key, meta in dist_checkpointing.load_tensors_metadata(str(weights)).items():
            rel = key
            while rel.startswith("module.") and rel.rpartition(".")[0] not in names:
                rel = rel[len("module.") :]  # NeMo's wrapper prefixes, relative to the megatron module
            if "_quantizer." in rel and rel.rpartition(".")[0] in names:
                buffers[rel] = torch.empty(meta.global_shape, dtype=meta.dtype)
            elif "_quantizer." in rel and ".experts.experts." in rel:
                # a routed expert's buffer: one sharded tensor for all experts of the layer (the expert axis first),
                # each rank's local experts a slice of it
                for i in range(len(names.get(rel.split(".experts.experts.")[0] + ".experts.local_experts", []))):
                    local = rel.replace(".experts.experts.", f".experts.local_experts.{i}.")
                    if local.rpartition(".")[0] in names:
                        buffers[local] = torch.empty(meta.global_shape[1:], dtype=meta.dtype)
        super().sync_to_saved(module, saved, buffers)
        rank_zero_info(f"nemo_fp4qat: quantizers matched to {checkpoint_path} before loading it")
        return True
