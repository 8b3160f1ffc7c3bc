"""FP4 QAT in a Megatron-Bridge run: one callback object, added to a ``ConfigContainer`` and to ``pretrain``.

How a Bridge run flows through it (the same :class:`~nemo_fp4qat.QATController` as the NeMo 2 and Lightning
front ends, so policies, schedules, calibration and export behave identically):

* :meth:`FP4QATBridgeCallback.install` registers a pre-wrap hook on ``cfg.model``: quantizers are inserted by
  policy in the schedule's first formats on the megatron-core model, before Bridge wraps it in DDP (what
  Bridge's own modelopt flow does). When the run resumes from a checkpoint with modelopt state, Bridge's
  ``restore_modelopt_state`` rebuilds the quantizers instead, with their formats and amax.
* :meth:`FP4QATBridgeCallback.forward_step` wraps the run's forward step. On the first training step it draws
  the calibration micro-batches from the run's own data iterator, calibrates on them, and hands them back to
  training first, so the run trains on exactly the data it would have without QAT.
* Bridge's callback events drive the schedule (``on_train_step_start``), save the controller's state and the
  calibration batches beside each checkpoint (``on_checkpoint_save``: ``<iter_dir>/nemo_fp4qat_state.pt``;
  Bridge's checkpoint has no place for a callback's state), restore them on resume (``on_train_start``) and
  export at the end (``on_train_end``): a unified Hugging Face checkpoint when the model was imported from one
  (``AutoBridge``), else a TensorRT-LLM checkpoint; validated against the trained model before it is published.
* QAD (``QATConfig.distillation``): at ``on_train_start``, once Bridge has loaded the weights, a frozen copy of
  the model with its quantizers off becomes the teacher (or the megatron-core model given as the teacher), and
  its per-token KL takes the cross entropy's place inside the student
  (:class:`~nemo_fp4qat.qat.distillation.megatron.MegatronDistiller`), so Bridge's loss reduction and logging
  stay as they are; under tensor parallelism the teacher is sharded like the student and the KL is computed
  over the vocabulary-parallel logits without gathering them; under pipeline parallelism each stage's teacher runs
  beside the student's stage and hands its hidden states on over a process group of its own. The copied teacher's
  weights are saved once beside the checkpoints (``<save>/nemo_fp4qat_teacher.pt``, each tensor-parallel rank and
  pipeline stage its part) so that a resumed run distils from the same teacher.
* Pipeline parallelism: each stage calibrates its own layers on the same first micro-batches, inside Bridge's
  schedule (:class:`~nemo_fp4qat.qat.parallel.pipeline.StagedForward`), every stage's state is saved in one file
  and taken back by its stage. Under tensor and/or pipeline parallelism the end-of-training export assembles the
  whole model on rank 0 (:func:`~nemo_fp4qat.qat.parallel.whole_model.gather_whole_model`).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..numerics.weight_reuse import WeightReuse
from ..qat.calibration.batches import collect_batches
from ..qat.config import QATConfig
from ..qat.controller import QATController
from ..qat.deploy_precision import refuse_deploy_dtype
from ..qat.distillation.distiller import DistillationConfig
from ..qat.distillation.megatron import MegatronDistiller, freeze, frozen_copy, require_megatron_loss
from ..qat.experts.moe import grouped_experts_error
from ..qat.parallel.pipeline import StagedForward, every_stage, this_stage
from ..qat.parallel.whole_model import alone_on_rank_0, at_size_one, gather_whole_model, sharded_over_ranks
from ..qat.policy.rules import LayerPolicy
from ..specs import ConfigError, from_fields

__all__ = ["STATE_FILE", "TEACHER_FILE", "FP4QATBridgeCallback", "bridge_gpt_forward"]

log = logging.getLogger("nemo_fp4qat")
STATE_FILE = "nemo_fp4qat_state.pt"
TEACHER_FILE = "nemo_fp4qat_teacher.pt"
_RESTART_HINT = "start from it with cfg.checkpoint.pretrained_checkpoint instead of resuming"

try:  # subclass Bridge's Callback where Bridge is installed (its CallbackManager accepts only those)
    from megatron.bridge.training.callbacks import Callback as BridgeCallbackBase
except ImportError:  # pragma: no cover - the module still imports for documentation without Bridge
    BridgeCallbackBase = object  # type: ignore[assignment,misc]


def global_rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _teacher_file(save_dir: str | Path) -> Path:
    """Where this rank's part of the copied teacher is kept: one file per tensor-parallel rank and pipeline stage
    (``nemo_fp4qat_teacher.tp1.pp0.pt``; data-parallel replicas hold the same part)."""
    from megatron.core import parallel_state as ps

    parts = ""
    if ps.get_tensor_model_parallel_world_size() > 1:
        parts += f".tp{ps.get_tensor_model_parallel_rank()}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        parts += f".pp{ps.get_pipeline_model_parallel_rank()}"
    if ps.get_expert_model_parallel_world_size() > 1:  # each expert-parallel rank holds other experts
        parts += f".ep{ps.get_expert_model_parallel_rank()}"
    return Path(save_dir) / TEACHER_FILE.replace(".pt", f"{parts}.pt")


def _first_replica() -> bool:
    """Whether this rank is the first of the ranks holding the same part of the model: data-parallel rank 0 (of its
    tensor-parallel position), or under expert parallelism the first rank of its experts' data-parallel group."""
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_world_size() > 1:
        return parallel_state.get_expert_data_parallel_rank() == 0
    return parallel_state.get_data_parallel_rank() == 0


def _calib_file(iter_dir: Path) -> Path:
    """This rank's calibration batches beside a checkpoint (data-parallel ranks calibrate on different samples, and a
    resumed run recalibrates at its later switches on the ones it drew)."""
    return iter_dir / f"nemo_fp4qat_calib.rank{global_rank()}.pt"


def _save_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a checkpoint never holds half a file


def unwrap_model_chunk(model: Any) -> nn.Module:
    from megatron.core.utils import unwrap_model

    return unwrap_model(model[0] if isinstance(model, list | tuple) else model)


def refuse_grouped_gemm(provider: Any, policy: LayerPolicy) -> None:
    """Refuse, before any module is built, a mixture-of-experts provider whose ``moe_grouped_gemm`` builds grouped
    experts unless ``policy`` keeps the experts in 16 bits on purpose: the quantizers would miss them
    (:func:`~nemo_fp4qat.qat.experts.moe.refuse_grouped_experts` refuses the built model too). megatron-core >= 0.16
    builds them under Transformer Engine (``TEGroupedMLP``; ``InferenceGroupedMLP`` for ``inference_optimized``); its
    local spec builds ``SequentialMLP`` whatever the flag says.

    Raises:
        ConfigError: naming the provider's setting and the fix.
    """
    if not (getattr(provider, "num_moe_experts", None) and getattr(provider, "moe_grouped_gemm", False)):
        return
    impl = getattr(provider, "transformer_impl", "transformer_engine")
    if impl == "local" or policy.keeps_in_full_precision("decoder.layers.0.mlp.experts"):
        return
    container = "InferenceGroupedMLP" if impl == "inference_optimized" else "TEGroupedMLP"
    raise grouped_experts_error(
        f"{type(provider).__name__} with {provider.num_moe_experts} experts and moe_grouped_gemm=True (it builds "
        f"{container} experts, transformer_impl={impl!r})"
    )


def bridge_gpt_forward(model: nn.Module, batch: dict[str, Any]) -> Any:
    """One calibration forward of a megatron-core GPT on a micro-batch of Bridge's GPT datasets."""
    tokens = batch["tokens"]
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(tokens.shape[-1]).unsqueeze(0).expand_as(tokens)
    return model(input_ids=tokens, position_ids=position_ids, attention_mask=batch.get("attention_mask"))


class _Prepended:
    """``data_iterator`` with ``first`` put back in front (megatron's ``RerunDataIterator`` has ``__next__`` only)."""

    def __init__(self, first: list[Any], rest: Any) -> None:
        self._first, self._rest = list(first), rest

    def __iter__(self) -> _Prepended:
        return self

    def __next__(self) -> Any:
        return self._first.pop(0) if self._first else next(self._rest)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rest, name)


class _QATForwardStep:
    """The run's forward step, calibrating the model on its first micro-batches before training on them."""

    def __init__(self, owner: FP4QATBridgeCallback, inner: Callable[..., Any]) -> None:
        self.owner, self.inner = owner, inner
        self._chained: dict[int, _Prepended] = {}

    def __call__(self, state: Any, data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        it = self._chained.get(id(data_iterator), data_iterator)
        if self.owner.needs_calibration:
            drawn = self.owner.calibrate_from(unwrap_model_chunk(model), data_iterator)
            it = _Prepended(drawn, data_iterator)
            self._chained[id(data_iterator)] = it
        return self.inner(state, it, model, *args, **kwargs)


class FP4QATBridgeCallback(BridgeCallbackBase):
    """FP4 quantization-aware training for a Megatron-Bridge ``pretrain`` / ``finetune`` run.

    Args:
        config: a :class:`~nemo_fp4qat.QATConfig` (or a dict of its fields): policy, schedule, calibration,
            export. The same object every front end takes.
        calibration_data: micro-batches (dicts with ``tokens``, ``position_ids``, ``attention_mask``) to
            calibrate on at the start of training; by default the run's own first micro-batches are used
            (see :meth:`forward_step`).

    Raises:
        ConfigError: a field of ``config`` is wrong, or (at :meth:`install`) the run uses the interleaved (virtual)
            pipeline.

    Example:
        >>> qat = FP4QATBridgeCallback(QATConfig(policy="default", schedule="progressive"))
        >>> qat.install(cfg)
        >>> pretrain(cfg, qat.forward_step(forward_step), callbacks=[qat])  # doctest: +SKIP
    """

    def __init__(self, config: QATConfig | dict[str, Any] | None = None,
                 calibration_data: Iterable[Any] | None = None) -> None:  # fmt: skip
        if config is None:
            config = QATConfig()
        self.config = config if isinstance(config, QATConfig) else from_fields(QATConfig, config, "QATConfig")
        self.controller = QATController.from_config(self.config, forward_fn=bridge_gpt_forward)
        if self.controller.static_weights:
            cal = self.controller.calibration
            raise ConfigError(
                f"Calibrated or learned NVFP4 weight scales (weight_scale={cal.weight_scale!r}, act_scale="
                f"{cal.act_scale!r}, learned_scales={self.config.learned_scales!r}) are not supported on the "
                "Megatron-Bridge front end yet: learned scales would be created after Bridge wraps the model in its "
                "DDP buffers, and per-block scales of tensor-parallel shards are untested. Use weight_scale='max' or "
                "'search' here, or train through the Lightning front end."
            )
        if self.controller.calibration.gptq is not None:
            raise ConfigError(
                "calibration gptq is not supported on the Megatron-Bridge front end yet: the Hessians of "
                "tensor-parallel row shards and of pipeline stages are untested. Set gptq to null here, or train "
                "through the Lightning front end."
            )
        refuse_deploy_dtype(self.config.deploy_dtype)
        self.qad = DistillationConfig.resolve_spec(self.config.distillation)
        require_megatron_loss(self.qad)
        if self.qad is not None and isinstance(self.qad.teacher, (str, Path)):
            raise ConfigError(
                f"distillation teacher {str(self.qad.teacher)!r}: the Megatron-Bridge front end takes the teacher as "
                "a megatron-core model (e.g. AutoBridge.from_hf_pretrained(path).to_megatron_provider()"
                ".provide_distributed_model(wrap_with_ddp=False)[0]) or None, for the model as Bridge loaded it "
                "before quantization."
            )
        self._default_export: dict[str, Any] = {"kind": "trtllm"}
        self.distiller: MegatronDistiller | None = None
        self.weight_reuse = WeightReuse()  # each weight's fake quant reused across an optimizer step's micro-batches
        self._teacher_saved = False
        self.calibration_data = calibration_data
        self.resuming = False
        self._load_dir: str | None = None
        self.exported: Path | None = None
        self._installed = False
        self._staged: StagedForward | None = None
        self._provider: Any = None

    # --- set-up ---------------------------------------------------------------------------------
    def install(self, cfg: Any) -> Any:
        """Prepare a ``ConfigContainer`` for QAT (in place; returned for chaining).

        Registers the pre-wrap hook that inserts the quantizers, turns off gradient-accumulation fusion (a
        CUDA kernel modelopt's quantized linears do not use), and, when ``cfg.checkpoint.load`` holds a
        checkpoint with modelopt state, has Bridge restore the quantizers from it.
        """
        from megatron.bridge.training.post_training.checkpointing import has_modelopt_state
        from megatron.bridge.training.utils.checkpoint_utils import checkpoint_exists

        model = cfg.model
        if (getattr(model, "virtual_pipeline_model_parallel_size", None) or 1) > 1:
            raise ConfigError(
                f"virtual_pipeline_model_parallel_size={model.virtual_pipeline_model_parallel_size}: the interleaved "
                "schedule's model chunks are not supported; set it to None (pipeline parallelism itself is)."
            )
        pp = getattr(model, "pipeline_model_parallel_size", None) or 1
        self._staged = StagedForward(bridge_gpt_forward) if pp > 1 else None
        if self._staged is not None:
            self.controller.forward_fn = self._staged
        self._provider = model
        model.gradient_accumulation_fusion = False
        load = getattr(cfg.checkpoint, "load", None)
        self.resuming = bool(load) and checkpoint_exists(load)
        self._load_dir = load if self.resuming else None
        if self.resuming and has_modelopt_state(load):
            model.restore_modelopt_state = True
        hf = getattr(model, "hf_model_id", None)  # set by AutoBridge.to_megatron_provider
        self._default_export = {"kind": "hf", "hf_model": str(hf)} if hf else {"kind": "trtllm"}
        export = self.config.export or self._default_export
        kind = export.get("kind") if isinstance(export, dict) else getattr(export, "kind", None)
        if self.config.export_dir and getattr(model, "num_moe_experts", None) and kind == "trtllm":
            raise ConfigError(
                f"export kind 'trtllm' for a mixture-of-experts model ({model.num_moe_experts} experts): a "
                "TensorRT-LLM checkpoint of an MoE is not written by this plugin. Export a unified HF checkpoint: "
                "import the model through AutoBridge (its hf_model_id), or export={'kind': 'hf', 'hf_model': ID}."
            )
        refuse_grouped_gemm(model, self.controller.policy)
        if self.controller.total_steps is None and getattr(cfg.train, "train_iters", None):
            self.controller.total_steps = int(cfg.train.train_iters)
        if not self._installed:
            model.register_pre_wrap_hook(self._insert_quantizers)
            self._installed = True
        return cfg

    def _insert_quantizers(self, chunks: list[nn.Module]) -> list[nn.Module]:
        if self.resuming:  # Bridge's restore_modelopt_state hook (after this one) rebuilds them
            return chunks
        table = self.controller.prepare(chunks[0])
        if global_rank() == 0:
            log.info("nemo_fp4qat: policy %r\n%s", self.controller.policy.name, table.format_table())
        return chunks

    def forward_step(self, forward_step_func: Callable[..., Any]) -> Callable[..., Any]:
        """The run's forward step, calibrating on the first micro-batches it draws (then training on them)."""
        return _QATForwardStep(self, forward_step_func)

    # --- calibration ----------------------------------------------------------------------------
    @property
    def needs_calibration(self) -> bool:
        return self.controller.table is not None and not self.controller.calibrated

    def calibrate_from(self, model: nn.Module, data_iterator: Iterator[Any]) -> list[Any]:
        """Calibrate on micro-batches drawn from ``data_iterator``; returns what was drawn, to train on next."""
        cfg = self.controller.calibration
        drawn: list[Any] = []
        seen = 0
        while seen < cfg.num_samples:
            try:
                batch = next(data_iterator)
            except StopIteration:
                break
            drawn.append(batch)
            seen += int(batch["tokens"].shape[0])
        self._calibrate(model, drawn)
        return drawn

    def _calibrate(self, model: nn.Module, batches: Iterable[Any]) -> None:
        cfg = self.controller.calibration
        self.controller.calib_batches = collect_batches(batches, cfg.num_samples, cfg.seq_len)
        was_training = model.training
        model.eval()
        try:
            self.controller.calibrate(model)
        finally:
            model.train(was_training)
        if global_rank() == 0:
            log.info("nemo_fp4qat: calibrated on %d batches", len(self.controller.calib_batches))

    # --- Bridge events --------------------------------------------------------------------------
    def on_train_start(self, context: Any) -> None:
        model = unwrap_model_chunk(context.model)
        step = int(context.state.train_state.step)
        if self._staged is not None:
            self._staged.setup()  # every rank, before any calibration forward
        if self.resuming and step > 0:
            self._restore(model, context.state.cfg.checkpoint.load, step)
        elif self.controller.table is None:
            raise ConfigError(
                "FP4QATBridgeCallback was not installed on this run's config: call qat.install(cfg) before "
                "pretrain(cfg, qat.forward_step(forward_step), callbacks=[qat])."
            )
        if self.qad is not None and self.distiller is None:
            self._start_distillation(model, resumed=self.resuming and step > 0)
        if self.calibration_data is not None and self.needs_calibration:
            self._calibrate(model, self.calibration_data)
        self.weight_reuse.start()

    def _start_distillation(self, student: nn.Module, resumed: bool) -> None:
        assert self.qad is not None
        given = self.qad.teacher
        if isinstance(given, nn.Module):
            teacher, source = freeze(given, like=student), "the given model"
        else:
            teacher, source = frozen_copy(student), "a copy of the model as loaded, quantizers off"
            if resumed:
                self._load_teacher(teacher)
                source = f"restored from {_teacher_file(self._load_dir or '')}"
        self.distiller = MegatronDistiller(student, teacher, self.qad)
        if global_rank() == 0:
            log.info("nemo_fp4qat: QAD teacher (%s) holds %.1f MiB (alpha %s, T %s)", source,
                     self.distiller.teacher_bytes() / 2**20, self.qad.alpha, self.qad.temperature)  # fmt: skip

    def _load_teacher(self, teacher: nn.Module) -> None:
        path = _teacher_file(self._load_dir or "")
        if not path.is_file():
            raise ConfigError(
                f"distillation (QAD): resuming from {path.parent}, which has no {path.name} (the teacher the run "
                "started with); give the teacher as distillation={'teacher': megatron_core_model}."
            )
        saved = torch.load(path, map_location="cpu", weights_only=True)
        params = dict(teacher.named_parameters())
        missing = sorted(set(params) - set(saved))
        if missing:
            raise ConfigError(f"{path} does not hold this model's teacher (no {missing[:3]}...).")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(saved[name])

    def on_train_step_start(self, context: Any) -> None:
        step = int(context.state.train_state.step)
        for ev in self.controller.step(unwrap_model_chunk(context.model), step):
            if global_rank() == 0:
                log.info("nemo_fp4qat: step %d: %s %s -> %s (%d modules)", step, ev["group"], ev["from"], ev["to"],
                         ev["modules"])  # fmt: skip

    def on_train_step_end(self, context: Any) -> None:
        # the step's schedule is over: the next stage has received every activation sent to it
        if self._staged is not None:
            self._staged.flush()
        if self.distiller is not None:
            self.distiller.flush()

    def on_checkpoint_save(self, context: Any) -> None:
        from megatron.bridge.training.utils.checkpoint_utils import get_checkpoint_name

        save_dir = Path(context.state.cfg.checkpoint.save)
        if self.distiller is not None and not isinstance(self.qad.teacher, nn.Module):  # type: ignore[union-attr]
            path = _teacher_file(save_dir)
            if _first_replica() and not self._teacher_saved and not path.is_file():
                params = {k: v.detach().cpu() for k, v in self.distiller.teacher.named_parameters()}
                _save_atomic(params, path)
            self._teacher_saved = True
        controller = every_stage(self.controller.state_dict())  # under pipeline parallelism: every stage's
        iter_dir = Path(get_checkpoint_name(context.state.cfg.checkpoint.save, context.state.train_state.step))
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            _save_atomic(self.controller.calib_batches, _calib_file(iter_dir))
        if global_rank() != 0:
            return
        payload = {"controller": controller, "calib_batches": self.controller.calib_batches}
        _save_atomic(payload, iter_dir / STATE_FILE)

    def _restore(self, model: nn.Module, load_dir: str, step: int) -> None:
        from megatron.bridge.training.utils.checkpoint_utils import get_checkpoint_name

        path = Path(get_checkpoint_name(load_dir, step)) / STATE_FILE
        if not path.exists():
            raise ConfigError(
                f"Resuming from {path.parent}, which has no {STATE_FILE}: it was not saved by a QAT run with "
                "FP4QATBridgeCallback. Start QAT from it as a pretrained checkpoint instead "
                "(cfg.checkpoint.pretrained_checkpoint, with cfg.checkpoint.load pointing elsewhere)."
            )
        saved = torch.load(path, map_location="cpu", weights_only=False)
        try:
            stage = this_stage(saved["controller"], _RESTART_HINT)
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
        self.controller.resolve(model)
        self.controller.load_state_dict(stage)
        mine = _calib_file(path.parent)  # this rank's own batches (rank 0's are in the state file too)
        self.controller.calib_batches = (torch.load(mine, map_location="cpu", weights_only=False) if mine.is_file()
                                         else saved.get("calib_batches", []))  # fmt: skip
        self.controller.attach(model)
        if global_rank() == 0:
            log.info("nemo_fp4qat: QAT state restored from %s (step %d)", path.parent, step)

    def on_train_end(self, context: Any) -> None:
        self.weight_reuse.stop()
        if self.distiller is not None:
            self.distiller.remove()
            self.distiller = None
        if not self.config.export_dir:
            return
        if not sharded_over_ranks():
            if global_rank() == 0:
                self.exported = self.export_model(unwrap_model_chunk(context.model), self.config.export_dir)
            return
        whole = gather_whole_model(self._whole_model, unwrap_model_chunk(context.model), self.controller)  # every rank
        if whole is not None:
            with alone_on_rank_0():
                self.exported = self.export_model(whole, self.config.export_dir)
        torch.distributed.barrier()

    def _whole_model(self) -> nn.Module:
        """The run's model at tensor and pipeline size 1, from its provider (a shallow copy: the provider holds
        process groups), its vocabulary padded as the run padded it; built inside ``alone_on_rank_0``."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        provider = at_size_one(copy.copy(self._provider))
        provider._pre_wrap_hooks = []
        # Bridge's setup puts the run's training functions on the model config (a gradient finalizer holding process
        # groups, the optimizer's grad scaler); megatron-core's SequentialMLP deep-copies its config: drop them
        for name in ("finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func",
                     "param_sync_func"):  # fmt: skip
            if hasattr(provider, name):
                setattr(provider, name, None)
        provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        return provider.provide(pre_process=True, post_process=True)

    def export_model(self, model: nn.Module, out_dir: str | Path) -> Path:
        """Export the quantized megatron-core model (``config.export``; by default a unified HF checkpoint for a
        model imported from Hugging Face, else a TensorRT-LLM checkpoint)."""
        from ..export import export_checkpoint

        export = self.config.export or self._default_export
        path = Path(export_checkpoint(model, str(out_dir), export))
        log.info("nemo_fp4qat: exported to %s", path)
        return path
