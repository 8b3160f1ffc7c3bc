"""``FP4QATMixin``: for LightningModules that build (and quantize) their model themselves.

Use it when layers are created in ``configure_model`` or when the module wants explicit control::

    class MyLM(FP4QATMixin, L.LightningModule):
        def configure_model(self):
            self.model = build()
            self.fp4qat_quantize(policy="default", schedule="progressive")

The mixin runs the same :class:`FP4QATCallback` logic from the module's own hooks, and restores
quantizers in ``on_load_checkpoint`` (which Lightning calls *before* loading weights), so resuming
works without the callback being registered on the trainer.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from .callback import CHECKPOINT_KEY, FP4QATCallback

__all__ = ["FP4QATMixin"]


class FP4QATMixin:
    """Mix into a ``LightningModule`` (before it in the bases) to add FP4 QAT."""

    _fp4qat: FP4QATCallback | None = None

    def fp4qat_quantize(self, module: nn.Module | None = None, **callback_kwargs: Any) -> FP4QATCallback:
        """Insert quantizers into ``module`` (default: ``self``) per policy; returns the driver.

        ``callback_kwargs`` are those of :class:`FP4QATCallback` (policy, schedule, calibration ...).
        """
        target = module if module is not None else self
        if module is not None:
            callback_kwargs.setdefault("module_getter", lambda _pl: target)
        if self._fp4qat is None:
            self._fp4qat = FP4QATCallback(**callback_kwargs)
        self._fp4qat.prepare(None, self)  # type: ignore[arg-type]
        return self._fp4qat

    @property
    def fp4qat(self) -> FP4QATCallback:
        if self._fp4qat is None:
            raise RuntimeError("Call self.fp4qat_quantize(...) (e.g. in configure_model) first.")
        return self._fp4qat

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        if self._fp4qat is not None:
            self._fp4qat.on_train_start(self.trainer, self)  # type: ignore[attr-defined]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        out = super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        if self._fp4qat is not None:
            self._fp4qat.on_train_batch_start(self.trainer, self, batch, batch_idx)  # type: ignore[attr-defined,arg-type]
        return out

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]
        if self._fp4qat is not None:
            self._fp4qat.on_save_checkpoint(self.trainer, self, checkpoint)  # type: ignore[attr-defined,arg-type]

    def teardown(self, stage: str) -> None:
        super().teardown(stage)  # type: ignore[misc]
        if self._fp4qat is not None:
            self._fp4qat.patches.restore()
            self._fp4qat.weight_reuse.stop()
            if self._fp4qat.deploy_precision is not None:
                self._fp4qat.deploy_precision.remove()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        if CHECKPOINT_KEY in checkpoint and self._fp4qat is not None:
            self._fp4qat.restore_from_checkpoint(self, checkpoint)  # type: ignore[arg-type]
