"""FP4 QAT for NeMo 2 Megatron models (``llm.GPTModel`` & co. trained with ``nl.MegatronStrategy``).

The quantizers must live on the megatron-core module (what NeMo's checkpointing saves
``modelopt_state`` for, and what modelopt's megatron plugin quantizes), not on NeMo's wrappers,
whose names change once the strategy wraps the model in its DDP/Float16 modules. Calibration
forwards use megatron-core's ``GPTModel.forward(input_ids, position_ids, attention_mask)`` on the
batches NeMo's data modules yield (``tokens``, ``position_ids``, ``attention_mask``).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..callback import FP4QATCallback

__all__ = ["NeMoFP4QATCallback", "megatron_module", "nemo_gpt_forward"]


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


def nemo_gpt_forward(model: nn.Module, batch: dict[str, Any]) -> Any:
    """One calibration forward of a megatron-core GPT on a NeMo GPT batch."""
    return model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=batch.get("attention_mask"),
    )


class NeMoFP4QATCallback(FP4QATCallback):
    """:class:`FP4QATCallback` preset for NeMo 2 Megatron GPT models (same arguments)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("module_getter", megatron_module)
        kwargs.setdefault("forward_fn", nemo_gpt_forward)
        super().__init__(**kwargs)
