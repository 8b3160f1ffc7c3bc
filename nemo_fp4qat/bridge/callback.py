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
  export at the end (``on_train_end``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..qat.batches import collect_batches
from ..qat.config import QATConfig
from ..qat.controller import QATController
from ..specs import ConfigError, from_fields

__all__ = ["STATE_FILE", "FP4QATBridgeCallback", "bridge_gpt_forward"]

log = logging.getLogger("nemo_fp4qat")
STATE_FILE = "nemo_fp4qat_state.pt"

try:  # subclass Bridge's Callback where Bridge is installed (its CallbackManager accepts only those)
    from megatron.bridge.training.callbacks import Callback as _BridgeCallback
except ImportError:  # pragma: no cover - the module still imports for documentation without Bridge
    _BridgeCallback = object  # type: ignore[assignment,misc]


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _unwrap(model: Any) -> nn.Module:
    from megatron.core.utils import unwrap_model

    return unwrap_model(model[0] if isinstance(model, list | tuple) else model)


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
            drawn = self.owner.calibrate_from(_unwrap(model), data_iterator)
            it = _Prepended(drawn, data_iterator)
            self._chained[id(data_iterator)] = it
        return self.inner(state, it, model, *args, **kwargs)


class FP4QATBridgeCallback(_BridgeCallback):
    """FP4 quantization-aware training for a Megatron-Bridge ``pretrain`` / ``finetune`` run.

    Args:
        config: a :class:`~nemo_fp4qat.QATConfig` (or a dict of its fields): policy, schedule, calibration,
            export. The same object every front end takes.
        calibration_data: micro-batches (dicts with ``tokens``, ``position_ids``, ``attention_mask``) to
            calibrate on at the start of training; by default the run's own first micro-batches are used
            (see :meth:`forward_step`).

    Raises:
        ConfigError: a field of ``config`` is wrong, or (at :meth:`install`) the run uses pipeline or virtual
            pipeline parallelism, or asks for QAD, which this front end does not run yet.

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
        self.calibration_data = calibration_data
        self.resuming = False
        self.exported: Path | None = None
        self._installed = False

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
        for field in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"):
            if (getattr(model, field, None) or 1) > 1:
                raise ConfigError(
                    f"{field}={getattr(model, field)}: the Megatron-Bridge front end runs tensor and data "
                    f"parallelism; set {field}=1, or train with pipeline parallelism through NeMo 2 "
                    "(nemo_fp4qat.nemo.with_fp4_qat)."
                )
        if self.config.distillation is not None:
            raise ConfigError(
                "distillation: QAD through Megatron-Bridge is not available in this version; use "
                "distillation=None here, or run QAD through NeMo 2 (nemo_fp4qat.nemo.with_fp4_qat)."
            )
        model.gradient_accumulation_fusion = False
        load = getattr(cfg.checkpoint, "load", None)
        self.resuming = bool(load) and checkpoint_exists(load)
        if self.resuming and has_modelopt_state(load):
            model.restore_modelopt_state = True
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
        if _rank() == 0:
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
        if _rank() == 0:
            log.info("nemo_fp4qat: calibrated on %d batches", len(self.controller.calib_batches))

    # --- Bridge events --------------------------------------------------------------------------
    def on_train_start(self, context: Any) -> None:
        model = _unwrap(context.model)
        step = int(context.state.train_state.step)
        if self.resuming and step > 0:
            self._restore(model, context.state.cfg.checkpoint.load, step)
        elif self.controller.table is None:
            raise ConfigError(
                "FP4QATBridgeCallback was not installed on this run's config: call qat.install(cfg) before "
                "pretrain(cfg, qat.forward_step(forward_step), callbacks=[qat])."
            )
        if self.calibration_data is not None and self.needs_calibration:
            self._calibrate(model, self.calibration_data)

    def on_train_step_start(self, context: Any) -> None:
        step = int(context.state.train_state.step)
        for ev in self.controller.step(_unwrap(context.model), step):
            if _rank() == 0:
                log.info("nemo_fp4qat: step %d: %s %s -> %s (%d modules)", step, ev["group"], ev["from"], ev["to"],
                         ev["modules"])  # fmt: skip

    def on_checkpoint_save(self, context: Any) -> None:
        from megatron.bridge.training.utils.checkpoint_utils import get_checkpoint_name

        if _rank() != 0:
            return
        iter_dir = Path(get_checkpoint_name(context.state.cfg.checkpoint.save, context.state.train_state.step))
        payload = {"controller": self.controller.state_dict(), "calib_batches": self.controller.calib_batches}
        tmp = iter_dir / (STATE_FILE + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, iter_dir / STATE_FILE)  # a checkpoint never holds half a state file

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
        self.controller.resolve(model)
        self.controller.load_state_dict(saved["controller"])
        self.controller.calib_batches = saved.get("calib_batches", [])
        self.controller.attach(model)
        if _rank() == 0:
            log.info("nemo_fp4qat: QAT state restored from %s (step %d)", path.parent, step)

    def on_train_end(self, context: Any) -> None:
        if self.config.export_dir and _rank() == 0:
            self.exported = self.export_model(_unwrap(context.model), self.config.export_dir)

    def export_model(self, model: nn.Module, out_dir: str | Path) -> Path:
        """Export the quantized megatron-core model (``config.export``; TensorRT-LLM checkpoint by default)."""
        from ..export import export_checkpoint

        export = self.config.export or {"kind": "trtllm"}
        path = Path(export_checkpoint(model, str(out_dir), export))
        log.info("nemo_fp4qat: exported to %s", path)
        return path
